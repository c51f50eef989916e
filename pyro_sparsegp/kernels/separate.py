r"""One kernel per latent GP: :class:`Separate` ``([k_1, ..., k_Q])`` is the kernel of ``Q`` independent GPs
``g_q ~ GP(0, k_q)``, the latent functions of the linear model of coregionalisation (Álvarez, Rosasco, Lawrence
2012, "Kernels for vector-valued functions: a review", section 4.2, where each latent function has its own
covariance), or of ``L`` independent outputs with a kernel each.

It stands where a layer's kernel stands (``SVGP([k_1, ..., k_Q], Z, ..., num_latents=Q)`` wraps a list in it). Its
covariances are batched over the parts, at the dimension of the layer's latents (dim -3 of a matrix, -2 of a
diagonal): ``Kuu`` ``[Q, M, M]``, ``Kuf`` ``[..., Q, M, B]``, ``diag Kff`` ``[..., Q, B]`` (the rules are in
:mod:`pyro_sparsegp.covariances.separate`). Inputs laid out against ``g`` ``[..., Q, B]``: ``X`` ``[..., K, B, D]``
with ``K`` in ``{1, Q}`` (``1``: every part reads the same inputs), or ``[B, D]``; inducing inputs ``Z`` ``[M, D]``
(shared) or ``[Q, M, D]`` (one set per part).
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule

from .batched import kernel_diag, kernel_matrix, required_features

__all__ = ["Separate"]


def _part(T: torch.Tensor | None, q: int, Q: int) -> torch.Tensor | None:
    """Part ``q``'s slice of ``T`` ``[..., K, N, D]`` (``K`` in ``{1, Q}``; a 2-D ``T`` is shared)."""
    if T is None or T.dim() < 3:
        return T
    if T.shape[-3] == Q:
        return T[..., q, :, :]
    if T.shape[-3] == 1:
        return T[..., 0, :, :]
    raise ValueError(f"inputs of shape {tuple(T.shape)} for a Separate kernel of {Q} parts: dim -3 stands at the "
                     f"latents' dimension and must be 1 (shared) or {Q} (one set per part)")


class Separate(PyroModule):
    """``Q`` kernels, one per latent GP (or per output) of a layer (module docstring; Álvarez, Rosasco, Lawrence
    2012, section 4.2).

    :param kernels: a list of ``Q >= 1`` kernels (Pyro kernels, or any kernel a layer takes), on the same input
        features; a part may be a PyroModule with ``PyroSample`` hyperparameters.

    ``kernels`` is a ``ModuleList`` (hyperparameters ``kernels.0.*``, ``kernels.1.*``, ...). Covariances are batched
    over the parts: :meth:`batched_matrix` ``[..., Q, N, M]``, :meth:`batched_diag` ``[..., Q, N]``.
    """

    def __init__(self, kernels):
        super().__init__()
        if isinstance(kernels, torch.nn.Module) or not hasattr(kernels, "__len__"):
            raise TypeError(f"Separate takes a list of kernels, one per latent GP, got {type(kernels).__name__}")
        kernels = list(kernels)
        if not kernels or not all(isinstance(k, torch.nn.Module) for k in kernels):
            raise TypeError("Separate takes a non-empty list of kernels (e.g. [RBF(D), Matern32(D)]), got "
                            f"{[type(k).__name__ for k in kernels]}")
        self.kernels = PyroModule[torch.nn.ModuleList](kernels)
        self.input_dim = max(required_features(k) for k in kernels)  # the features the widest part reads
        self.active_dims = None  # every feature: pyro_sparsegp.kernels.expected_input_dim reads input_dim

    def __len__(self) -> int:
        """``Q``, the number of parts (no tensors, so shapes do not apply)."""
        return len(self.kernels)

    def batched_matrix(self, X: torch.Tensor, Z: torch.Tensor | None = None) -> torch.Tensor:
        """``k_q(X_q, Z_q)`` for every part, ``[..., Q, N, M]``, from ``X`` ``[..., K, N, D]`` or ``[N, D]`` and
        ``Z`` ``[..., K', M, D]``, ``[M, D]`` or ``None`` (``Z = X``), ``K``, ``K'`` in ``{1, Q}``.
        :func:`~pyro_sparsegp.kernels.kernel_matrix` calls it for this kernel."""
        Q = len(self.kernels)
        return torch.stack([kernel_matrix(k, _part(X, q, Q), _part(Z, q, Q)) for q, k in enumerate(self.kernels)],
                           -3)

    def batched_diag(self, X: torch.Tensor) -> torch.Tensor:
        """``k_q(x_n, x_n)`` for every part, ``[..., Q, N]``, from ``X`` ``[..., K, N, D]`` or ``[N, D]``."""
        Q = len(self.kernels)
        parts = []
        for q, k in enumerate(self.kernels):
            Xq = _part(X, q, Q)
            own = getattr(k, "Kdiag", None)  # convolutional kernels, sums: their own diagonal
            parts.append(own(Xq) if own is not None else kernel_diag(k, Xq))
        return torch.stack(torch.broadcast_tensors(*parts), -2)

    def forward(self, X, Z=None, diag=False):
        """Pyro-kernel interface on ``X`` ``[N, D]`` (and ``Z`` ``[M, D]``): ``[Q, N, M]``, or ``[Q, N]`` with
        ``diag=True``; a batch over the parts, not one matrix."""
        return self.batched_diag(X) if diag else self.batched_matrix(X, Z)
