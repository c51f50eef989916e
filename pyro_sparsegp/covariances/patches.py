r"""Inducing patches of the convolutional kernels: inter-domain inducing variables ``u_m = g(z_m)`` of the
patch-response GP ``g`` (van der Wilk, Rasmussen, Hensman 2017, section 3.1; Lázaro-Gredilla and Figueiras-Vidal
2009), and, for TICK, ``u_m = g(z_m, tau_m)`` with a location ``tau_m`` (Dutordoir et al. 2020, section 3).

.. math::

    [K_{uu}]_{mm'} = k_g(z_m, z_{m'})\, [k_t(\tau_m, \tau_{m'})], \qquad
    [K_{uf}]_{mn} = c \sum_p w_p\, k_g(z_m, x_n^{[p]})\, [k_t(\tau_m, t_p)]

(van der Wilk et al. 2017, eqs. 13 and 12; the bracketed factor for TICK only). ``Z`` ``[(L,) M, d]``, locations
``[(L,) M, 2]``, images ``X`` ``[..., B, H*W*C]``: ``Kuu`` ``[(L,) M, M']``, ``Kuf`` ``[..., (L|1,) M, B]``.

**Cost and memory.** ``Kuf`` takes ``O(M B P d)`` and sums over patches in chunks of at most
``kernel.chunk_elements`` kernel entries, each recomputed in the backward pass when chunked (activation
checkpointing): the ``[M, B, P]`` tensor is never materialised when it would not fit.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..inducing.variables import IndexedInducingPatches, InducingPatches
from ..kernels import TICK, ConvKernel, kernel_matrix
from .dispatch import Rule, hint, refuse, register, register_diag

__all__ = ["PatchesRule", "IndexedPatchesRule", "patch_sum", "conv_kernel_diag"]


def patch_sum(kernel: ConvKernel, Z: torch.Tensor, X: torch.Tensor, T: torch.Tensor | None = None) -> torch.Tensor:
    """``[Kuf]_{mn} = c sum_p w_p k_g(z_m, x_n[p]) [k_t(tau_m, t_p)]`` (van der Wilk et al. 2017, eq. 12): ``Z``
    ``[..., M, d]``, ``X`` ``[..., B, H*W*C]``, locations ``T`` ``[..., M, 2]`` (TICK) or ``None`` ->
    ``[..., M, B]``. Sums over patches in chunks of at most ``kernel.chunk_elements`` entries (module docstring)."""
    Xp = kernel.extract(X)  # [..., B, P, d]
    w = kernel.effective_weights()  # [P]
    P = Xp.shape[-2]
    kt = kernel.location_factor(T, kernel.locations(Z.dtype, Z.device))  # [..., M, P] or None
    lead = torch.broadcast_shapes(Z.shape[:-2], Xp.shape[:-3])
    M, B = Z.shape[-2], Xp.shape[-3]
    step = max(1, min(P, kernel.chunk_elements // max(1, math.prod(lead) * M * B)))

    def part(Zc, Xc, wc, ktc):
        Bc, Pc, d = Xc.shape[-3:]
        K = kernel_matrix(kernel.base_kernel, Zc, Xc.reshape(Xc.shape[:-3] + (Bc * Pc, d)))
        K = K.reshape(K.shape[:-1] + (Bc, Pc))  # [..., M, B, Pc]
        if ktc is not None:
            K = K * ktc.unsqueeze(-2)
        return K @ wc  # [..., M, B]

    out = None
    for s in range(0, P, step):
        sl = slice(s, min(P, s + step))
        args = (Z, Xp[..., sl, :], w[sl], None if kt is None else kt[..., sl])
        chunked = step < P and torch.is_grad_enabled()
        r = checkpoint(part, *args, use_reentrant=False) if chunked else part(*args)
        out = r if out is None else out + r
    return out


def _check_width(inducing, kernel) -> None:
    if inducing.Z.shape[-1] != kernel.patch_dim:
        raise ValueError(f"inducing patches have {inducing.Z.shape[-1]} features, the kernel's patches "
                         f"{kernel.patch_dim}")


@register(InducingPatches, ConvKernel)
class PatchesRule(Rule):
    """Inducing patches ``Z`` ``[(L,) M, d]`` of a (weighted) convolutional kernel (van der Wilk et al. 2017,
    eqs. 12-13): ``Kuu = k_g(Z, Z')``, ``Kuf`` the weighted sum over each image's patches."""

    @staticmethod
    def check(inducing, kernel) -> None:
        """``ValueError`` unless the patches ``Z`` ``[..., M, d]`` have the kernel's patch width ``d``."""
        _check_width(inducing, kernel)

    @staticmethod
    def Kuu(inducing, kernel, other=None) -> torch.Tensor:
        """``k_g(Z, Z')`` ``[(L,) M, M']`` (van der Wilk et al. 2017, eq. 13)."""
        return kernel_matrix(kernel.base_kernel, inducing.Z, None if other is None else other.Z)

    @staticmethod
    def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
        """``c sum_p w_p k_g(z_m, x_n[p])`` ``[..., (L|1,) M, B]`` for images ``X`` ``[..., (L|1,) B, H*W*C]``
        (eq. 12; :func:`patch_sum`)."""
        return patch_sum(kernel, inducing.Z, X)


@register(IndexedInducingPatches, TICK)
class IndexedPatchesRule(Rule):
    """Inducing patches with locations, ``Z`` ``[(L,) M, d]`` and ``T`` ``[(L,) M, 2]``, of TICK (Dutordoir et al.
    2020, section 3.2): the patch kernel times the Matérn-3/2 location kernel ``k_t``."""

    @staticmethod
    def check(inducing, kernel) -> None:
        """``ValueError`` unless the patches ``Z`` ``[..., M, d]`` have the kernel's patch width ``d``."""
        _check_width(inducing, kernel)

    @staticmethod
    def Kuu(inducing, kernel, other=None) -> torch.Tensor:
        """``k_g(Z, Z') k_t(T, T')`` ``[(L,) M, M']`` (Dutordoir et al. 2020, section 3.2)."""
        other = inducing if other is None else other
        K = kernel_matrix(kernel.base_kernel, inducing.Z, None if other is inducing else other.Z)
        return K * kernel.location_factor(inducing.locations, other.locations)

    @staticmethod
    def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
        """``c sum_p w_p k_g(z_m, x_n[p]) k_t(tau_m, t_p)`` ``[..., (L|1,) M, B]`` for images ``X``
        ``[..., (L|1,) B, H*W*C]`` (:func:`patch_sum`)."""
        return patch_sum(kernel, inducing.Z, X, inducing.locations)


refuse(InducingPatches, TICK, "a TICK kernel needs patches with locations: use IndexedInducingPatches")
refuse(IndexedInducingPatches, ConvKernel, "inducing patches with locations need a TICK kernel; use InducingPatches "
       "for the translation-invariant convolutional kernel")
hint(InducingPatches, "inducing patches need a convolutional kernel (pyro_sparsegp.kernels.ConvKernel); use "
     "InducingPoints (or a tensor Z) for other kernels")


@register_diag(ConvKernel)
def conv_kernel_diag(kernel: ConvKernel, X: torch.Tensor) -> torch.Tensor:
    """``k_f(x_n, x_n) = c^2 sum_{p,p'} w_p w_p' k_g(x_n[p], x_n[p']) [k_t(t_p, t_p')]`` ``[..., B]`` for images
    ``X`` ``[..., B, H*W*C]`` (van der Wilk et al. 2017, eq. 10): :meth:`~pyro_sparsegp.kernels.ConvKernel.Kdiag`."""
    return kernel.Kdiag(X)
