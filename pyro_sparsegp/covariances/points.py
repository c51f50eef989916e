r"""Inducing points ``u = f(Z)`` (Titsias 2009) under any kernel evaluated like a Pyro kernel: ``Kuu = k(Z, Z')``
``[(L,) M, M']`` and ``Kuf = k(Z, X)`` ``[..., (L|1,) M, B]`` (Hensman, Matthews, Ghahramani 2015, eq. 19), through
:func:`~pyro_sparsegp.kernels.kernel_matrix` (leading batch dimensions broadcast). With a convolutional kernel or a
sum the points are images and the covariances the full ``k_f``. Also the diagonal ``k(x_n, x_n)`` ``[..., B]`` of
Pyro's kernels.
"""

from __future__ import annotations

import torch
from pyro.contrib.gp.kernels import Kernel

from ..inducing.variables import InducingPoints
from ..kernels import ConvKernel, SumKernel, kernel_diag, kernel_matrix, required_features
from .dispatch import Rule, register, register_diag

__all__ = ["PointsRule", "pyro_kernel_diag"]


@register(InducingPoints, Kernel)
@register(InducingPoints, ConvKernel)
@register(InducingPoints, SumKernel)
class PointsRule(Rule):
    """Inducing points ``Z`` ``[(L,) M, D]`` under a Pyro kernel, a convolutional kernel (image-space points) or a
    sum: ``Kuu = k(Z, Z')`` and ``Kuf = k(Z, X)`` (Titsias 2009; Hensman, Matthews, Ghahramani 2015, eq. 19)."""

    @staticmethod
    def check(inducing, kernel) -> None:
        """``ValueError`` when ``Z`` ``[..., M, D]`` has fewer features than the kernel reads (its ``active_dims``)."""
        need = required_features(kernel)
        if inducing.Z.shape[-1] < need:
            raise ValueError(f"Z has {inducing.Z.shape[-1]} features but the kernel reads features up to index "
                             f"{need - 1}")

    @staticmethod
    def Kuu(inducing, kernel, other=None) -> torch.Tensor:
        """``k(Z, Z')`` ``[(L,) M, M']`` (``Z' = Z`` without ``other``)."""
        return kernel_matrix(kernel, inducing.Z, None if other is None else other.Z)

    @staticmethod
    def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
        """``k(Z, X)`` ``[..., (L|1,) M, B]`` for ``X`` ``[..., (L|1,) B, D]``."""
        return kernel_matrix(kernel, inducing.Z, X)


@register_diag(Kernel)
def pyro_kernel_diag(kernel, X: torch.Tensor) -> torch.Tensor:
    """``k(x_n, x_n)`` ``[..., B]`` of a Pyro kernel for ``X`` ``[..., B, D]``
    (:func:`~pyro_sparsegp.kernels.kernel_diag`): the diagonal of :math:`K_{nn}` (Hensman et al. 2015, eq. 19)."""
    return kernel_diag(kernel, X)
