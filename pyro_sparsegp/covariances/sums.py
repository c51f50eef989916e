r"""Sums of independent GPs, ``f = f_1 + ... + f_K``, with one inducing variable per part, ``u = (u_1, ..., u_K)``
(van der Wilk et al. 2017, "wconv + RBF"). The ``f_k`` are independent, so ``Cov(u_k, u_j) = 0`` for ``k != j`` and
``Cov(u_k, f) = Cov(u_k, f_k)``:

.. math::

    K_{uu} = \operatorname{blockdiag}(K_{u_1 u_1}, \dots, K_{u_K u_K}), \qquad
    K_{uf} = [K_{u_1 f_1}; \dots; K_{u_K f_K}],

each block that of the part's own (inducing type, kernel type) rule. Shapes: ``Kuu`` ``[(L,) M, M']`` with
``M = sum_k M_k``, ``Kuf`` ``[..., (L|1,) M, B]``, the diagonal ``sum_k k_k(x_n, x_n)`` ``[..., B]``.
"""

from __future__ import annotations

import torch

from ..inducing.variables import InducingSum
from ..kernels import SumKernel
from .dispatch import Rule, hint, register, register_diag
from .functions import Kdiag, Kuf, Kuu, check

__all__ = ["SumRule", "block_diagonal", "sum_kernel_diag"]


def block_diagonal(blocks) -> torch.Tensor:
    """``blockdiag(K_1, ..., K_K)`` ``[..., sum M_k, sum M'_k]`` of blocks ``K_k`` ``[..., M_k, M'_k]`` whose leading
    dimensions broadcast (``torch.block_diag`` takes 2-D blocks only): the ``Kuu`` of independent parts (Hensman,
    Matthews, Ghahramani 2015, eq. 19 per part)."""
    lead = torch.broadcast_shapes(*(b.shape[:-2] for b in blocks))
    K = blocks[0].new_zeros(lead + (sum(b.shape[-2] for b in blocks), sum(b.shape[-1] for b in blocks)))
    r = c = 0
    for b in blocks:
        K[..., r : r + b.shape[-2], c : c + b.shape[-1]] = b
        r, c = r + b.shape[-2], c + b.shape[-1]
    return K


@register(InducingSum, SumKernel)
class SumRule(Rule):
    """An :class:`~pyro_sparsegp.inducing.InducingSum` under a :class:`~pyro_sparsegp.kernels.SumKernel` (one part
    per kernel, in order): ``Kuu`` ``[(L,) M, M']`` block-diagonal, ``Kuf`` ``[..., (L|1,) M, B]`` stacked (module
    docstring): the :math:`K_{mm}`, :math:`K_{mn}` of Hensman, Matthews, Ghahramani 2015, eq. 19 for
    ``u = (u_1, ..., u_K)``."""

    @staticmethod
    def check(inducing, kernel) -> None:
        """``ValueError`` unless the sum has one kernel per part and each part goes with its kernel (its own rule's
        checks: e.g. patches ``Z`` ``[..., M, d]`` of the kernel's width)."""
        if len(kernel.kernels) != len(inducing.parts):
            raise ValueError(f"an InducingSum of {len(inducing.parts)} parts needs a SumKernel of as many kernels, got "
                             f"{len(kernel.kernels)}")
        for p, k in zip(inducing.parts, kernel.kernels, strict=True):
            check(p, k)

    @staticmethod
    def Kuu(inducing, kernel, other=None) -> torch.Tensor:
        """``blockdiag(K_{u_k u'_k})`` ``[(L,) M, M']``."""
        others = [None] * len(inducing.parts) if other is None else list(other.parts)
        return block_diagonal([Kuu(p, k, o) for p, k, o in zip(inducing.parts, kernel.kernels, others, strict=True)])

    @staticmethod
    def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
        """``[K_{u_1 f_1}; ...; K_{u_K f_K}]`` ``[..., (L|1,) M, B]`` for ``X`` ``[..., (L|1,) B, D]``."""
        blocks = [Kuf(p, k, X) for p, k in zip(inducing.parts, kernel.kernels, strict=True)]
        lead = torch.broadcast_shapes(*(b.shape[:-2] for b in blocks))
        return torch.cat([b.expand(lead + b.shape[-2:]) for b in blocks], -2)


hint(InducingSum, "an InducingSum needs a SumKernel (pyro_sparsegp.kernels.SumKernel) with one kernel per part")


@register_diag(SumKernel)
def sum_kernel_diag(kernel: SumKernel, X: torch.Tensor) -> torch.Tensor:
    """``sum_k k_k(x_n, x_n)`` ``[..., B]`` for ``X`` ``[..., B, D]``, each part's diagonal by its own rule: the
    diagonal of :math:`K_{nn}` (Hensman, Matthews, Ghahramani 2015, eq. 19) of ``k_f = sum_k k_k``."""
    return sum(Kdiag(k, X) for k in kernel.kernels)

