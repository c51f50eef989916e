r"""Inducing points under a :class:`~pyro_sparsegp.kernels.Separate` kernel: one independent GP per part,
``g_q ~ GP(0, k_q)``, with its own inducing values ``u_q = g_q(Z_q)`` (the latent functions of the linear model of
coregionalisation, Álvarez, Rosasco, Lawrence 2012, section 4.2). The parts are independent, so the covariances are
a batch over them:

.. math:: K_{u_q u_q} = k_q(Z_q, Z_q), \qquad K_{u_q f_q} = k_q(Z_q, X), \qquad \operatorname{diag} K_{f_q f_q},

``Kuu`` ``[Q, M, M']``, ``Kuf`` ``[..., Q, M, B]`` and the diagonal ``[..., Q, B]``, with ``Z`` ``[M, D]`` (shared
by the parts) or ``[Q, M, D]`` (one set each) and ``X`` ``[..., K, B, D]``, ``K`` in ``{1, Q}``.
"""

from __future__ import annotations

import torch

from ..inducing.variables import InducingPoints
from ..kernels import Separate
from .dispatch import Rule, lookup, register, register_diag

__all__ = ["SeparateRule", "separate_diag"]


@register(InducingPoints, Separate)
class SeparateRule(Rule):
    """Inducing points ``Z`` ``[(Q,) M, D]`` under :class:`~pyro_sparsegp.kernels.Separate` ``([k_1, ..., k_Q])``:
    ``Kuu = [k_q(Z_q, Z_q)]_q`` ``[Q, M, M]`` and ``Kuf = [k_q(Z_q, X)]_q`` ``[..., Q, M, B]`` (module docstring;
    per part the :math:`K_{mm}`, :math:`K_{mn}` of Hensman, Matthews, Ghahramani 2015, eq. 19)."""

    @staticmethod
    def check(inducing, kernel) -> None:
        """``ValueError`` unless ``Z`` ``[(Q,) M, D]`` has one set per part (or one shared set) and each part's own
        rule accepts the points (e.g. the features it reads)."""
        Z = inducing.Z
        if Z.dim() == 3 and Z.shape[0] != len(kernel):
            raise ValueError(f"Z has {Z.shape[0]} sets of inducing inputs but the Separate kernel has {len(kernel)} "
                             f"parts: give Z [M, D] (shared) or [{len(kernel)}, M, D] (one set per part)")
        for k in kernel.kernels:
            lookup(type(inducing), type(k)).check(inducing, k)

    @staticmethod
    def Kuu(inducing, kernel, other=None) -> torch.Tensor:
        """``[k_q(Z_q, Z'_q)]_q`` ``[Q, M, M']`` (``Z' = Z`` without ``other``)."""
        return kernel.batched_matrix(inducing.Z, None if other is None else other.Z)

    @staticmethod
    def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
        """``[k_q(Z_q, X_q)]_q`` ``[..., Q, M, B]`` for ``X`` ``[..., K, B, D]`` (``K`` in ``{1, Q}``)."""
        return kernel.batched_matrix(inducing.Z, X)


@register_diag(Separate)
def separate_diag(kernel: Separate, X: torch.Tensor) -> torch.Tensor:
    """``[k_q(x_n, x_n)]_q`` ``[..., Q, B]`` for ``X`` ``[..., K, B, D]``: the diagonal of :math:`K_{nn}` (Hensman,
    Matthews, Ghahramani 2015, eq. 19) of every part."""
    return kernel.batched_diag(X)
