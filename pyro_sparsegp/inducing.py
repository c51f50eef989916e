r"""Inducing variables: what ``u`` is, and hence what ``Kuu`` and ``Kuf`` are.

* :class:`InducingPoints`: ``u_m = f(z_m)``, ``Z [.., M, D]``; ``Kuu = k(Z, Z)``, ``Kuf = k(Z, X)``.
* :class:`InducingPatches`: ``u_m = g(z_m)``, ``Z [.., M, d]``; ``Kuu = k_g(Z, Z)``,
  ``Kuf = c sum_p w_p k_g(z_m, x_n[p])``.
* :class:`IndexedInducingPatches`: ``u_m = g(z_m, tau_m)``, plus locations ``T [.., M, 2]``;
  ``Kuu = k_g(Z, Z) k_t(T, T)``, ``Kuf = c sum_p w_p k_g(z_m, x_n[p]) k_t(tau_m, t_p)``.
* :class:`InducingSum`: one inducing variable per part of a :class:`~pyro_sparsegp.kernels_sum.SumKernel`
  (e.g. patches for a convolutional part, images for an RBF part); ``Kuu`` block-diagonal, ``Kuf`` stacked.

Inducing patches are inter-domain inducing variables (Lázaro-Gredilla and Figueiras-Vidal 2009) of the
convolutional kernels of :mod:`pyro_sparsegp.kernels_conv` (van der Wilk et al. 2017, eqs. 12-13; TICK: Dutordoir et
al. 2020, sec. 3). The layers (:class:`~pyro_sparsegp.SVGP`, :class:`~pyro_sparsegp.SOLVEGP`, the convolutional
layers) compute their covariances only through :func:`Kuu`, :func:`Kuf` and :func:`Kff_diag`, which dispatch on the
pair (inducing variable, kernel): every layer takes every kind of inducing variable without special cases. Each kind
is a :class:`~pyro.nn.PyroModule` whose tensors are ``PyroParam`` s (trained by SVI).

Leading dimensions: ``Z`` may be ``[L, M, d]`` (one set per output) and ``X`` carries any batch dimensions
(particles, plates); they broadcast as in :func:`pyro_sparsegp.kernels.kernel_matrix`.
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from .inputs import as_tensor
from .kernels import kernel_matrix, required_features
from .kernels_conv import TICK, ConvKernel
from .kernels_sum import SumKernel, part_diag

__all__ = [
    "InducingVariables",
    "InducingPoints",
    "InducingPatches",
    "IndexedInducingPatches",
    "InducingSum",
    "as_inducing",
    "Kuu",
    "Kuf",
    "Kff_diag",
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
            Z = as_tensor(Z, "Z")  # numpy, lists, pandas: in the default dtype (pyro_sparsegp.inputs)
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
        """The dtype of ``Z`` (and of every tensor of this inducing variable)."""
        return self.Z.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``Z``."""
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
        """Number of features ``D`` of the layer's inputs ``X`` ``[..., B, D]`` under ``kernel`` (an ``int``)."""
        raise NotImplementedError

    def check(self, kernel) -> None:
        """``ValueError`` when this inducing variable cannot be used with ``kernel`` (e.g. ``Z``'s last dimension
        ``d`` does not match the features the kernel reads: ``Z`` ``[..., M, d]``)."""
        raise NotImplementedError

    def Kuu(self, kernel, other: InducingVariables | None = None) -> torch.Tensor:
        """``Cov(u, u')`` ``[..., M, M']`` (``other=None``: ``u' = u``; ``other`` of the same kind: e.g. SOLVE-GP's
        ``Kuv``), without jitter (:func:`pyro_sparsegp.linalg.cholesky` adds it)."""
        raise NotImplementedError

    def Kuf(self, kernel, X: torch.Tensor) -> torch.Tensor:
        """``Cov(u, f(X))`` ``[..., M, B]`` for inputs ``X`` ``[..., B, D]``."""
        raise NotImplementedError

    def _same_kind(self, other):
        if other is not None and type(other) is not type(self):
            raise ValueError(f"cross-covariance between {type(self).__name__} and {type(other).__name__}")
        return other


class InducingPoints(InducingVariables):
    """Inducing inputs in the data space, ``u = f(Z)`` (Titsias 2009): ``Z`` ``[M, D]`` or ``[L, M, D]``. With a
    :class:`~pyro_sparsegp.kernels_conv.ConvKernel` they are images and the covariances are the full ``k_f``."""

    def input_dim(self, kernel):
        """``D``, the last dimension of ``Z`` ``[..., M, D]`` (inputs ``X`` ``[..., B, D]``)."""
        return self.Z.shape[-1]

    def check(self, kernel):
        """``ValueError`` when ``Z`` ``[..., M, D]`` has fewer features than ``kernel`` reads."""
        need = required_features(kernel)
        if self.Z.shape[-1] < need:
            raise ValueError(f"Z has {self.Z.shape[-1]} features but the kernel reads features up to index {need - 1}")

    def Kuu(self, kernel, other=None):
        other = self._same_kind(other)
        return kernel_matrix(kernel, self.Z, None if other is None else other.Z)

    def Kuf(self, kernel, X):
        return kernel_matrix(kernel, self.Z, X)


class InducingPatches(InducingVariables):
    """Inter-domain inducing patches ``u_m = g(z_m)`` of a convolutional kernel (van der Wilk et al. 2017, section 3.1):
    ``Z`` ``[M, d]`` or ``[L, M, d]`` with ``d = kernel.patch_dim``. Initialise from image patches, e.g.
    :func:`pyro_sparsegp.conv.init_patches`."""

    def input_dim(self, kernel):
        """``kernel.input_dim``: the flattened image size ``D`` of the inputs ``X`` ``[..., B, D]``."""
        return kernel.input_dim

    def check(self, kernel):
        """``ValueError`` unless ``kernel`` is a non-TICK convolutional kernel whose patches have ``Z``'s width
        ``d`` (``Z`` ``[..., M, d]``)."""
        if not isinstance(kernel, ConvKernel):
            raise ValueError(
                f"inducing patches need a convolutional kernel (pyro_sparsegp.kernels_conv.ConvKernel), got "
                f"{type(kernel).__name__}; use InducingPoints (or a tensor Z) for other kernels"
            )
        if isinstance(kernel, TICK):
            raise ValueError("a TICK kernel needs patches with locations: use IndexedInducingPatches")
        if self.Z.shape[-1] != kernel.patch_dim:
            raise ValueError(f"inducing patches have {self.Z.shape[-1]} features, the kernel's patches "
                             f"{kernel.patch_dim}")

    def Kuu(self, kernel, other=None):
        other = self._same_kind(other)
        return kernel.Kzz(self.Z, None if other is None else other.Z)

    def Kuf(self, kernel, X):
        return kernel.Kzf(self.Z, X)


class IndexedInducingPatches(InducingPatches):
    """Inducing patches with locations for :class:`~pyro_sparsegp.kernels_conv.TICK` (Dutordoir et al. 2020, sec.
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

    def check(self, kernel):
        """``ValueError`` unless ``kernel`` is a TICK kernel whose patches have ``Z``'s width ``d`` (``Z``
        ``[..., M, d]``)."""
        if not isinstance(kernel, TICK):
            raise ValueError(
                f"inducing patches with locations need a TICK kernel, got {type(kernel).__name__}; use "
                "InducingPatches for the translation-invariant convolutional kernel"
            )
        if self.Z.shape[-1] != kernel.patch_dim:
            raise ValueError(f"inducing patches have {self.Z.shape[-1]} features, the kernel's patches "
                             f"{kernel.patch_dim}")

    def Kuu(self, kernel, other=None):
        other = self._same_kind(other)
        if other is None:
            return kernel.Kzz(self.Z, None, self.locations, self.locations)
        return kernel.Kzz(self.Z, other.Z, self.locations, other.locations)

    def Kuf(self, kernel, X):
        return kernel.Kzf(self.Z, X, self.locations)


class InducingSum(InducingVariables):
    """The inducing variables of a sum of independent GPs (:class:`~pyro_sparsegp.kernels_sum.SumKernel`):
    ``u = (u_1, ..., u_K)``, part ``k`` an inducing variable of ``f_k`` alone (van der Wilk et al. 2017, "wconv +
    RBF": inducing patches for the convolutional part, inducing images for the RBF part, one full ``q(u)``).

    :param parts: one :class:`InducingVariables` (or tensor: inducing points) per kernel of the sum, in the sum's
        order, all with the same ``batch_shape`` (``()`` shared, or ``(L,)`` one set per output).

    ``Kuu = blockdiag(K_{u_k u_k})`` ``[..., M, M]`` with ``M = sum_k M_k``; ``Kuf = [K_{u_k f_k}]`` stacked along
    dimension ``-2``. There is no single ``Z``: read ``parts[k].Z``."""

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
        raise TypeError("an InducingSum has no single Z: read inducing.parts[k].Z (one per kernel of the sum)")

    @property
    def num_inducing(self) -> int:
        """``M = sum_k M_k``."""
        return sum(p.num_inducing for p in self.parts)

    @property
    def batch_shape(self) -> torch.Size:
        return self.parts[0].batch_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def input_dim(self, kernel) -> int:
        """``D``: the features every kernel of the sum reads."""
        return kernel.input_dim

    def check(self, kernel) -> None:
        """``ValueError`` unless ``kernel`` is a :class:`~pyro_sparsegp.kernels_sum.SumKernel` with one kernel per
        part, each part valid for its kernel."""
        if not isinstance(kernel, SumKernel) or len(kernel.kernels) != len(self.parts):
            raise ValueError(f"an InducingSum of {len(self.parts)} parts needs a SumKernel of as many kernels, got "
                             f"{type(kernel).__name__}")
        for p, k in zip(self.parts, kernel.kernels):
            p.check(k)

    def check_like(self, other) -> None:
        if not isinstance(other, InducingSum) or len(other.parts) != len(self.parts):
            raise ValueError(f"O must be an InducingSum of {len(self.parts)} parts like Z, got {type(other).__name__}")
        for p, o in zip(self.parts, other.parts):
            p.check_like(o)

    def Kuu(self, kernel, other=None):
        other = self._same_kind(other)
        others = [None] * len(self.parts) if other is None else other.parts
        blocks = [p.Kuu(k, o) for p, k, o in zip(self.parts, kernel.kernels, others)]
        lead = torch.broadcast_shapes(*(b.shape[:-2] for b in blocks))
        rows, cols = [b.shape[-2] for b in blocks], [b.shape[-1] for b in blocks]
        K = blocks[0].new_zeros(lead + (sum(rows), sum(cols)))
        r = c = 0
        for b in blocks:
            K[..., r : r + b.shape[-2], c : c + b.shape[-1]] = b
            r, c = r + b.shape[-2], c + b.shape[-1]
        return K

    def Kuf(self, kernel, X):
        blocks = [p.Kuf(k, X) for p, k in zip(self.parts, kernel.kernels)]
        lead = torch.broadcast_shapes(*(b.shape[:-2] for b in blocks))
        return torch.cat([b.expand(lead + b.shape[-2:]) for b in blocks], -2)


def as_inducing(Z) -> InducingVariables:
    """``Z`` itself if it is an :class:`InducingVariables`, else :class:`InducingPoints` ``(Z)`` (``Z`` ``[M, D]``
    or ``[L, M, D]``). A constructor helper: implements no paper equation."""
    return Z if isinstance(Z, InducingVariables) else InducingPoints(Z)


def Kuu(inducing: InducingVariables, kernel, other: InducingVariables | None = None, jitter: float = 0.0):
    """``Cov(u, u')`` ``[..., M, M']`` for the pair (inducing variable, kernel); ``jitter`` is added to the diagonal
    (only when ``other`` is ``None``). :math:`K_{mm}` of Hensman, Matthews, Ghahramani 2015, eq. 19
    (SOLVE-GP's :math:`K_{uv}` with ``other``: Shi, Titsias, Mnih 2020, algorithm 1)."""
    K = inducing.Kuu(kernel, other)
    if jitter and other is None:
        K = K + jitter * torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    return K


def Kuf(inducing: InducingVariables, kernel, X: torch.Tensor) -> torch.Tensor:
    """``Cov(u, f(X))`` ``[..., M, B]`` for inputs ``X`` ``[..., B, D]``: :math:`K_{mn}` of Hensman, Matthews,
    Ghahramani 2015, eq. 19."""
    return inducing.Kuf(kernel, X)


def Kff_diag(kernel, X: torch.Tensor) -> torch.Tensor:
    """Prior variances ``k(x_n, x_n)`` ``[..., B]`` (convolutional kernels: the ``O(B P^2 d)`` patch double sum,
    :meth:`~pyro_sparsegp.kernels_conv.ConvKernel.Kdiag`): the diagonal of :math:`K_{nn}` in Hensman, Matthews,
    Ghahramani 2015, eq. 19."""
    return part_diag(kernel, X)
