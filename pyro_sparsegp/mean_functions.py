r"""Mean functions of GP layers, as PyroModules: ``m(X)`` maps inputs ``[..., B, D_in]`` to ``[..., B, D_out]``.

A layer with a mean function models ``f(x) = m(x) + g(x)`` with ``g ~ GP(0, k)``, and its inducing outputs are
``u = g(Z)``: the deviations from the mean function (Salimbeni & Deisenroth 2017, section 3 and their reference code;
so ``m`` is added to the mean of ``p(f | u)`` and of ``q(f)`` and never enters ``Kuu``/``Kuf``). In a deep GP the mean
function of a hidden layer is the skip connection that makes training work (Salimbeni & Deisenroth 2017, section
4.1): the identity where the width is kept, a fixed projection where it changes (:meth:`FixedProjection.from_pca`
when it shrinks, :meth:`FixedProjection.zero_padding` when it grows). The same projection maps the running inducing
inputs of the next layers at initialisation (:func:`pyro_sparsegp.deep.build_deep_gp`).

========================  =====================  ===========================================
class                     ``m(x)``               parameters
========================  =====================  ===========================================
:class:`Zero`             ``0`` ``[D_out]``      none
:class:`Constant`         ``c`` ``[D_out]``      ``c`` (trained)
:class:`Linear`           ``x A + b``            ``A [D_in, D_out]``, ``b [D_out]`` (trained)
:class:`Identity`         ``x``                  none
:class:`FixedProjection`  ``x W``                ``W [D_in, D_out]`` (a buffer: not trained)
========================  =====================  ===========================================
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

__all__ = ["MeanFunction", "Zero", "Constant", "Linear", "Identity", "FixedProjection"]


class MeanFunction(PyroModule):
    """Base class: ``forward(X [..., B, D_in]) -> [..., B, D_out]``. ``out_dim`` is ``D_out`` (``None``: the
    input's width, for :class:`Identity`). The prior mean :math:`m(x)` of a layer's GP, added to the mean of
    q(f); the papers the package follows take it zero (Hensman et al. 2013, 2015) or linear in the hidden layers of
    a deep GP (Salimbeni & Deisenroth 2017). The base class implements no paper equation itself."""

    out_dim: int | None = None

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Zero(MeanFunction):
    """``m(x) = 0`` with ``D_out = out_dim`` outputs (the default of every layer when no mean function is given):
    ``X`` ``[..., B, D_in]`` -> zeros ``[..., B, D_out]``. The zero prior mean of Hensman, Fusi, Lawrence 2013 and
    Hensman, Matthews, Ghahramani 2015."""

    def __init__(self, out_dim: int = 1):
        super().__init__()
        self.out_dim = out_dim

    def forward(self, X):
        return X.new_zeros(X.shape[:-1] + (self.out_dim,))


class Constant(MeanFunction):
    """``m(x) = c`` with a trained ``c`` ``[D_out]`` (initial value ``value``): ``X`` ``[..., B, D_in]`` ->
    ``[..., B, D_out]``. A convenience prior mean: implements no paper equation."""

    def __init__(self, out_dim: int = 1, value: float | torch.Tensor = 0.0):
        super().__init__()
        self.out_dim = out_dim
        c = torch.as_tensor(value, dtype=torch.get_default_dtype()).expand(out_dim).clone()
        self.c = PyroParam(c, constraints.real)

    def forward(self, X):
        return self.c.expand(X.shape[:-1] + (self.out_dim,))


class Linear(MeanFunction):
    """``m(x) = x A + b`` with trained ``A`` ``[D_in, D_out]`` (initial ``A``, default zeros) and ``b`` ``[D_out]``
    (default zeros): ``X`` ``[..., B, D_in]`` -> ``[..., B, D_out]``. A linear prior mean, as Salimbeni & Deisenroth
    2017 use in hidden layers (theirs fixed, see :class:`FixedProjection`; this one trained)."""

    def __init__(self, in_dim: int, out_dim: int, A: torch.Tensor | None = None, b: torch.Tensor | None = None):
        super().__init__()
        dtype = torch.get_default_dtype()
        A = torch.zeros(in_dim, out_dim, dtype=dtype) if A is None else torch.as_tensor(A, dtype=dtype).clone()
        b = torch.zeros(out_dim, dtype=dtype) if b is None else torch.as_tensor(b, dtype=dtype).clone()
        if A.shape != (in_dim, out_dim) or b.shape != (out_dim,):
            raise ValueError(f"Linear({in_dim}, {out_dim}) needs A [{in_dim}, {out_dim}] and b [{out_dim}], "
                             f"got {tuple(A.shape)} and {tuple(b.shape)}")
        self.in_dim, self.out_dim = in_dim, out_dim
        self.A = PyroParam(A, constraints.real)
        self.b = PyroParam(b, constraints.real)

    def forward(self, X):
        return X @ self.A + self.b


class Identity(MeanFunction):
    """``m(x) = x`` (``D_out = D_in``): the skip connection of a hidden layer that keeps its width, ``X``
    ``[..., B, D]`` -> ``[..., B, D]``. The identity mean of the hidden layers of Salimbeni & Deisenroth 2017 when
    the width is kept."""

    def forward(self, X):
        return X


class FixedProjection(MeanFunction):
    """``m(x) = x W`` with a fixed ``W`` ``[D_in, D_out]`` (a buffer, never trained, as in the reference code of
    Salimbeni & Deisenroth 2017 and in GPflux). Build it with :meth:`from_pca` (``D_out < D_in``) or
    :meth:`zero_padding` (``D_out > D_in``)."""

    def __init__(self, W: torch.Tensor):
        super().__init__()
        if W.dim() != 2:
            raise ValueError(f"W must be [D_in, D_out], got shape {tuple(W.shape)}")
        self.register_buffer("W", W.detach().clone())
        self.out_dim = W.shape[1]

    def forward(self, X):
        return X @ self.W.to(X.dtype)

    @classmethod
    def from_pca(cls, X: torch.Tensor, out_dim: int) -> FixedProjection:
        """``W`` = the first ``out_dim`` right singular vectors of the (uncentred, as in the reference code) data
        matrix ``X`` ``[N, D_in]``: ``X W`` are its leading principal directions."""
        if out_dim > X.shape[-1]:
            raise ValueError(f"from_pca keeps at most D_in = {X.shape[-1]} directions, asked for {out_dim}; "
                             "use zero_padding to widen")
        _, _, Vh = torch.linalg.svd(X.detach(), full_matrices=False)
        return cls(Vh[:out_dim].mT)

    @classmethod
    def zero_padding(cls, in_dim: int, out_dim: int) -> FixedProjection:
        """``W = [I, 0]`` ``[D_in, D_out]``: the inputs copied into the first ``D_in`` of ``D_out >= D_in``
        outputs."""
        if out_dim < in_dim:
            raise ValueError(f"zero_padding widens ({in_dim} -> {out_dim} narrows); use from_pca")
        return cls(torch.eye(in_dim, out_dim, dtype=torch.get_default_dtype()))

    @classmethod
    def between(cls, X: torch.Tensor, out_dim: int) -> MeanFunction:
        """The mean function of a hidden layer taking ``X`` ``[N, D_in]`` to ``out_dim`` features: :class:`Identity`
        when the width is kept, PCA when it shrinks, zero padding when it grows (Salimbeni & Deisenroth 2017)."""
        D = X.shape[-1]
        if out_dim == D:
            return Identity()
        return cls.from_pca(X, out_dim) if out_dim < D else cls.zero_padding(D, out_dim)
