r"""Sums of independent GPs: ``f = f_1 + ... + f_K`` with ``f_k ~ GP(0, k_k)`` independent, so
``k_f = k_1 + ... + k_K``.

The reason for a class of its own (rather than :class:`pyro.contrib.gp.kernels.Sum`) is the inducing variables. A
sum of a convolutional kernel and an RBF on the images (the "wconv + RBF" model of van der Wilk et al. 2017,
their best on MNIST) takes inducing patches for the convolutional part and inducing images for the RBF part:
``u = (u_1, ..., u_K)`` with ``u_k`` inducing variables of ``f_k`` alone
(:class:`~pyro_sparsegp.inducing.InducingSum`; their covariances: :mod:`pyro_sparsegp.covariances.sums`). Since the
``f_k`` are independent, ``Kuu = blockdiag(K_{u_1 u_1}, ..., K_{u_K u_K})`` and
``Kuf = [K_{u_1 f_1}; ...; K_{u_K f_K}]`` (``Cov(u_k, f) = Cov(u_k, f_k)``); ``q(u)`` is one full
Gaussian over all of them, as in van der Wilk et al.

Shapes: ``X`` ``[..., N, D]`` (every part reads the same ``D`` features: flattened images for a convolutional part).
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule

from .batched import kernel_diag, kernel_matrix

__all__ = ["SumKernel"]


def _part_diag(kernel, X: torch.Tensor) -> torch.Tensor:
    """``k(x_n, x_n)`` ``[..., N]`` of one kernel of the sum: its own ``Kdiag`` (convolutional kernels, sums: batch
    dimensions kept) or :func:`~pyro_sparsegp.kernels.batched.kernel_diag`. The layers read the diagonal through
    :func:`pyro_sparsegp.covariances.Kdiag`; this serves the kernel's own ``forward(X, diag=True)``."""
    Kdiag = getattr(kernel, "Kdiag", None)
    return Kdiag(X) if Kdiag is not None else kernel_diag(kernel, X)


class SumKernel(PyroModule):
    """``k_f = sum_k k_k``: the kernel of a sum of independent GPs (module docstring; van der Wilk et al. 2017's
    "wconv + RBF" model is one).

    :param kernels: two or more kernels on the same ``D`` input features (Pyro kernels, convolutional kernels).

    Called like a Pyro kernel: ``kernel(X, Z=None, diag=False)`` returns ``[N, M]`` or ``[N]``; ``Kdiag(X)`` takes
    ``X`` ``[..., N, D]``. ``kernels`` is a ``ModuleList`` (hyperparameters ``kernels.0.*``, ``kernels.1.*``, ...).
    """

    def __init__(self, *kernels):
        super().__init__()
        if len(kernels) < 2:
            raise ValueError(f"SumKernel needs at least two kernels, got {len(kernels)}")
        dims = {int(k.input_dim) for k in kernels}
        if len(dims) != 1:
            raise ValueError(f"the kernels of a sum must read the same features; their input_dim are "
                             f"{[int(k.input_dim) for k in kernels]}")
        self.kernels = PyroModule[torch.nn.ModuleList](kernels)
        self.input_dim = dims.pop()
        self.active_dims = None  # every feature: pyro_sparsegp.kernels.expected_input_dim reads input_dim

    def Kdiag(self, X: torch.Tensor) -> torch.Tensor:
        """``sum_k k_k(x_n, x_n)`` ``[..., N]`` for ``X`` ``[..., N, D]``."""
        return sum(_part_diag(k, X) for k in self.kernels)

    def forward(self, X, Z=None, diag=False):
        """Pyro-kernel interface: ``sum_k k_k(X, Z)`` ``[N, M]``, or the diagonal ``[N]`` with ``diag=True``."""
        if diag:
            return self.Kdiag(X)
        return sum(kernel_matrix(k, X, Z) for k in self.kernels)
