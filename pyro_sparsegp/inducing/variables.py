r"""Inducing variables: what ``u`` is, as data and shapes. Their covariances (``Kuu``, ``Kuf``) are rules of
:mod:`pyro_sparsegp.covariances`, registered per (inducing type, kernel type); nothing here evaluates a kernel.

* :class:`InducingPoints`: ``u_m = f(z_m)``, ``Z [.., M, D]``.
* :class:`InducingPatches`: ``u_m = g(z_m)``, ``Z [.., M, d]``: inter-domain inducing patches of a convolutional
  kernel (van der Wilk et al. 2017, eqs. 12-13; Lázaro-Gredilla and Figueiras-Vidal 2009).
* :class:`IndexedInducingPatches`: ``u_m = g(z_m, tau_m)``, plus locations ``T [.., M, 2]`` (TICK: Dutordoir et al.
  2020, sec. 3).
* :class:`InducingSum`: one inducing variable per part of a :class:`~pyro_sparsegp.kernels.SumKernel`
  (e.g. patches for a convolutional part, images for an RBF part).

Each kind is a :class:`~pyro.nn.PyroModule` whose tensors are ``PyroParam`` s (trained by SVI). Leading dimensions:
``Z`` may be ``[L, M, d]`` (one set per output); the layers read ``num_inducing`` (``M``), ``batch_shape`` (``()`` or
``(L,)``), ``dtype``, ``device`` and ``input_dim(kernel)`` (the ``D`` of their inputs ``X`` ``[..., B, D]``).
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from ..checks.inputs import as_tensor

__all__ = [
    "InducingVariables",
    "InducingPoints",
    "InducingPatches",
    "IndexedInducingPatches",
    "InducingSum",
    "as_inducing",
]


def _check_finite(name, t):
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")


class InducingVariables(PyroModule):
    """Base class: ``Z`` ``[M, d]`` or ``[L, M, d]`` (a ``PyroParam``); ``num_inducing`` is ``M``. The inducing
    variables ``u`` of Titsias 2009 and Hensman, Fusi, Lawrence 2013 (section 3.1); ``Kuu`` and ``Kuf`` are the
    :math:`K_{mm}`, :math:`K_{mn}` of Hensman, Matthews, Ghahramani 2015, eq. 19."""

    def __init__(self, Z: torch.Tensor):
        super().__init__()
        if not isinstance(Z, torch.Tensor):
            Z = as_tensor(Z, "Z")  # numpy, lists, pandas: in the default dtype (pyro_sparsegp.checks.inputs)
        if Z.dim() not in (2, 3):
            raise ValueError(f"Z must be [M, D] (M inducing inputs of D features) or [L, M, D] (one set per output), "
                             f"got shape {tuple(Z.shape)}")
        _check_finite("Z", Z)
        self.Z = PyroParam(Z.detach().clone(), constraints.real)

    @property
    def num_inducing(self) -> int:
        """``M``, the size of ``Z``'s dimension ``-2`` (``Z`` ``[M, d]`` or ``[L, M, d]``); an ``int``."""
        return self.Z.shape[-2]

    @property
    def batch_shape(self) -> torch.Size:
        """``()`` for one set shared by every output, ``(L,)`` for one set per output (``Z`` ``[L, M, d]``)."""
        return self.Z.shape[:-2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``Z`` (and of every tensor of this inducing variable); no shape."""
        return self.Z.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``Z``; no shape."""
        return self.Z.device

    def check_like(self, other: InducingVariables) -> None:
        """``ValueError`` unless ``other`` (SOLVE-GP's orthogonal set) is of this kind with the same feature width
        ``d`` and the same ``batch_shape``: ``Z`` ``[..., M, d]``, ``other.Z`` ``[..., M2, d]``."""
        if type(other) is not type(self):
            raise ValueError(f"O must be the same kind of inducing variable as Z ({type(self).__name__}), "
                             f"got {type(other).__name__}")
        Z, O = self.Z, other.Z  # noqa: E741
        if O.dim() != Z.dim() or O.shape[-1] != Z.shape[-1] or O.shape[:-2] != Z.shape[:-2]:
            raise ValueError(f"O must be shaped like Z ([..., M2, D] with D = {Z.shape[-1]}); got {tuple(O.shape)}")

    def input_dim(self, kernel) -> int:
        """Number of features ``D`` of the layer's inputs ``X`` ``[..., B, D]`` under ``kernel`` (an ``int``). By
        default ``Z``'s last dimension (inducing inputs in the data space); inter-domain kinds override it."""
        return self.Z.shape[-1]


class InducingPoints(InducingVariables):
    """Inducing inputs in the data space, ``u = f(Z)`` (Titsias 2009): ``Z`` ``[M, D]`` or ``[L, M, D]``. With a
    :class:`~pyro_sparsegp.kernels.ConvKernel` they are images and the covariances are the full ``k_f``."""

    def input_dim(self, kernel):
        """``D``, the last dimension of ``Z`` ``[..., M, D]`` (inputs ``X`` ``[..., B, D]``)."""
        return self.Z.shape[-1]


class InducingPatches(InducingVariables):
    """Inter-domain inducing patches ``u_m = g(z_m)`` of a convolutional kernel (van der Wilk et al. 2017, section 3.1):
    ``Z`` ``[M, d]`` or ``[L, M, d]`` with ``d = kernel.patch_dim``. Initialise from image patches, e.g.
    :func:`pyro_sparsegp.inducing.init_patches`."""

    def input_dim(self, kernel):
        """``kernel.input_dim``: the flattened image size ``D`` of the inputs ``X`` ``[..., B, D]``."""
        return kernel.input_dim


class IndexedInducingPatches(InducingPatches):
    """Inducing patches with locations for :class:`~pyro_sparsegp.kernels.TICK` (Dutordoir et al. 2020, sec.
    3.2): ``u_m = g(z_m, tau_m)``; ``Z`` ``[(L,) M, d]`` and ``locations`` ``[(L,) M, 2]`` (output-grid units), both
    ``PyroParam`` s. ``locations=None`` draws them uniformly in ``[0, H_out] x [0, W_out]`` (Shi et al. 2020, appendix
    G.2) when the grid is given as ``grid=(H_out, W_out)``."""

    def __init__(self, Z: torch.Tensor, locations: torch.Tensor | None = None, grid=None):
        super().__init__(Z)
        if locations is None:
            if grid is None:
                raise ValueError("give the inducing locations, or the output grid (H_out, W_out) to draw them")
            locations = torch.rand(Z.shape[:-1] + (2,), dtype=Z.dtype, device=Z.device)
            locations = locations * torch.tensor([float(grid[0]), float(grid[1])], dtype=Z.dtype, device=Z.device)
        if locations.shape != Z.shape[:-1] + (2,):
            raise ValueError(f"locations must be [..., M, 2] matching Z {tuple(Z.shape)}, got {tuple(locations.shape)}")
        _check_finite("locations", locations)
        self.locations = PyroParam(locations.detach().clone(), constraints.real)


class InducingSum(InducingVariables):
    """The inducing variables of a sum of independent GPs (:class:`~pyro_sparsegp.kernels.SumKernel`):
    ``u = (u_1, ..., u_K)``, part ``k`` an inducing variable of ``f_k`` alone (van der Wilk et al. 2017, "wconv +
    RBF": inducing patches for the convolutional part, inducing images for the RBF part, one full ``q(u)``).

    :param parts: one :class:`InducingVariables` (or tensor: inducing points) per kernel of the sum, in the sum's
        order, all with the same ``batch_shape`` (``()`` shared, or ``(L,)`` one set per output).

    ``M = sum_k M_k``; ``Kuu`` ``[..., M, M]`` is block-diagonal and ``Kuf`` ``[..., M, B]`` the parts' stacked
    (:mod:`pyro_sparsegp.covariances.sums`: the :math:`K_{mm}`, :math:`K_{mn}` of Hensman, Matthews, Ghahramani
    2015, eq. 19). There is no single ``Z``: read ``parts[k].Z``."""

    def __init__(self, *parts):
        PyroModule.__init__(self)
        if len(parts) < 2:
            raise ValueError(f"InducingSum needs one inducing variable per kernel of the sum (two or more), got "
                             f"{len(parts)}")
        parts = [as_inducing(p) for p in parts]
        if any(isinstance(p, InducingSum) for p in parts):
            raise ValueError("the parts of an InducingSum must not be sums themselves; flatten the sum")
        if len({tuple(p.batch_shape) for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
            raise ValueError(f"the parts must share batch shape and dtype; got "
                             f"{[(tuple(p.batch_shape), p.dtype) for p in parts]}")
        self.parts = PyroModule[torch.nn.ModuleList](parts)

    @property
    def Z(self):
        """There is no single ``Z`` ``[..., M, d]``: ``TypeError`` (read ``parts[k].Z``)."""
        raise TypeError("an InducingSum has no single Z: read inducing.parts[k].Z (one per kernel of the sum)")

    @property
    def num_inducing(self) -> int:
        """``M = sum_k M_k`` (parts' ``Z`` ``[..., M_k, d_k]``)."""
        return sum(p.num_inducing for p in self.parts)

    @property
    def batch_shape(self) -> torch.Size:
        """The parts' common ``batch_shape``: ``()`` or ``(L,)``."""
        return self.parts[0].batch_shape

    @property
    def dtype(self) -> torch.dtype:
        """The parts' common dtype; no shape."""
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        """The device of the first part; no shape."""
        return self.parts[0].device

    def input_dim(self, kernel) -> int:
        """``D``: the features every kernel of the sum reads (inputs ``X`` ``[..., B, D]``)."""
        return kernel.input_dim

    def check_like(self, other) -> None:
        """``ValueError`` unless ``other`` is an :class:`InducingSum` of as many parts, each like this one's (parts'
        ``Z`` ``[..., M_k, d_k]`` and ``[..., M2_k, d_k]``)."""
        if not isinstance(other, InducingSum) or len(other.parts) != len(self.parts):
            raise ValueError(f"O must be an InducingSum of {len(self.parts)} parts like Z, got {type(other).__name__}")
        for p, o in zip(self.parts, other.parts, strict=True):
            p.check_like(o)


def as_inducing(Z) -> InducingVariables:
    """``Z`` itself if it is an :class:`InducingVariables`, else :class:`InducingPoints` ``(Z)`` (``Z`` ``[M, D]``
    or ``[L, M, D]``). A constructor helper: implements no paper equation."""
    return Z if isinstance(Z, InducingVariables) else InducingPoints(Z)
