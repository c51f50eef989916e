r"""Kernel-vector products ``k(X, Z) @ a`` without the ``[N, M]`` matrix in memory.

ODVGP's mean (Salimbeni et al. 2018; Shi, Titsias, Mnih 2020, section 6.3) is ``K_fv a`` with ``M2`` columns, and
its column-subsampled KL is ``a_S^T K_{S,:} a``: products of kernel matrices ``[rows, M2]`` with a vector, where
``M2`` (8 times ``M`` in the paper) makes the matrix the largest object of a training step. Formed by
:func:`~pyro_sparsegp.kernels.kernel_matrix` and differentiated by autograd, each such matrix is written and read
some thirty times per step (the distances, the square root, the exponential and their saved intermediates, each way),
at memory speed.

:func:`kernel_matvec` computes the product and its gradients in blocks of rows that stay in cache, from closed-form
derivatives of the stationary kernels in the squared scaled distance ``r2 = |x - z|^2 / l^2``:

* RBF: :math:`g = e^{-r^2/2}`, :math:`\partial g/\partial r^2 = -g/2`;
* Matérn-3/2: :math:`g = (1 + s)e^{-s}`, :math:`s = \sqrt{3 r^2}`, :math:`\partial g/\partial r^2 = -\tfrac32 e^{-s}`;
* Matérn-5/2: :math:`g = (1 + s + s^2/3)e^{-s}`, :math:`s = \sqrt{5 r^2}`,
  :math:`\partial g/\partial r^2 = -\tfrac56(1 + s)e^{-s}`

(all smooth at ``r = 0``), with ``k = var * g``. For an upstream gradient ``c`` ``[N]`` and
:math:`W_{nm} = c_n\,\mathrm{var}\,\partial g_{nm}/\partial r^2\,a_m`:
:math:`\nabla_a = \mathrm{var}\,G^Tc`, :math:`\nabla_{\mathrm{var}} = c^T G a`,
:math:`\nabla_{x_n} = 2(x_n\sum_m W_{nm} - [W z]_n)`, :math:`\nabla_{z_m} = 2(z_m\sum_n W_{nm} - [W^T x]_m)` on the
scaled inputs (the lengthscale and the centring are differentiated by autograd outside). The distances use the
product form under the same exactness test as :func:`~pyro_sparsegp.kernels.kernel_matrix` (module
:mod:`~pyro_sparsegp.kernels.batched`); where it fails, and for other kernels, batched inputs or hyperparameters
with batch dimensions, the product is ``kernel_matrix(kernel, X, Z) @ a``. The gradient is first order only (no
double backward).
"""

from __future__ import annotations

import torch
from pyro.contrib.gp import kernels as pk

from .batched import _centred, _check, _gemm_is_exact, _hyper, _rbf_gemm_is_exact, _slice, kernel_matrix

__all__ = ["kernel_matvec"]

BLOCK_ELEMENTS = 1 << 17  # elements of a [rows, M] block (1 MiB in float64: a few of them stay in a 2 MiB cache)
DEVICE_BLOCK_ELEMENTS = 1 << 24  # on a GPU (128 MiB in float64): few blocks, since each costs kernel launches; an H100
# took 150 ms for ODVGP's M2 part at M = 1024, M2 = 16384 in cache-sized blocks (1,000+ of them per step)


def block_elements(device: torch.device) -> int:
    """Elements of one ``[rows, M]`` block on ``device``: :data:`BLOCK_ELEMENTS` on the CPU (cache-sized),
    :data:`DEVICE_BLOCK_ELEMENTS` elsewhere. Takes a device, so shapes do not apply."""
    return BLOCK_ELEMENTS if device.type == "cpu" else DEVICE_BLOCK_ELEMENTS

# kind: (kappa, h): the inputs are scaled by sqrt(kappa) so that one product gives q = kappa r2, and
# dg/dq = -h P with P the block the gradients multiply (module docstring)
_FORMS = {"rbf": (0.5, 1.0), "matern32": (3.0, 0.5), "matern52": (5.0, 1.0 / 6.0)}


def _augmented(Xq, Zq):
    """``([x, |x|^2, 1], [-2 z, 1, |z|^2])`` ``[N, D + 2]``, ``[M, D + 2]``: one product of a block of the first with
    the second gives ``|x - z|^2`` (the GEMM form, no separate pass to add the norms)."""
    x2, z2 = (Xq * Xq).sum(-1, keepdim=True), (Zq * Zq).sum(-1, keepdim=True)
    return torch.cat([Xq, x2, torch.ones_like(x2)], -1), torch.cat([-2.0 * Zq, torch.ones_like(z2), z2], -1)


def _buffers(kind: str, rows: int, Za):
    """Scratch blocks ``[rows, M]`` for :func:`_blocks`, allocated once per pass over the rows (a fresh block per
    step of the loop would cost the allocator's page faults)."""
    return tuple(Za.new_empty(rows, Za.shape[0]) for _ in range({"rbf": 1, "matern32": 2, "matern52": 3}[kind]))


def _blocks(kind: str, Xa, Za, bufs):
    """``(G, P)`` ``[rows, M]`` for a block of rows ``Xa`` of :func:`_augmented`: ``G = g(q)`` and the slope's
    block ``P`` (``dg/dq = -h P``) at ``q = |x - z|^2`` of the inputs scaled by ``sqrt(kappa)`` (clamped at zero),
    written into the leading rows of the scratch blocks ``bufs`` of :func:`_buffers` (views of them)."""
    n = Xa.shape[0]
    q = torch.mm(Xa, Za.mT, out=bufs[0][:n]).clamp_(min=0.0)
    if kind == "rbf":  # g = exp(-q), dg/dq = -g
        g = q.neg_().exp_()
        return g, g
    s = q.sqrt_()
    e = torch.neg(s, out=bufs[1][:n]).exp_()
    if kind == "matern32":  # g = (1 + s) e, dg/dq = -e / 2
        return torch.addcmul(e, e, s, out=s), e
    p = torch.addcmul(e, e, s, out=bufs[2][:n])  # matern52: g = (1 + s + s^2 / 3) e, dg/dq = -(1 + s) e / 6
    return torch.addcmul(p, s.mul_(s), e, value=1.0 / 3.0, out=s), p


class _StationaryMatvec(torch.autograd.Function):
    """``var * g(Xq, Zq) @ a`` over blocks of rows; inputs ``Xq [N, D]``, ``Zq [M, D]`` centred and scaled by
    ``sqrt(kappa) / lengthscale``, ``var ()``, ``a [M]``; returns ``[N]``."""

    @staticmethod
    def forward(ctx, Xq, Zq, var, a, kind):
        Xa, Za = _augmented(Xq, Zq)
        rows = max(1, block_elements(Xq.device) // max(1, Zq.shape[0]))
        ga = Xq.new_zeros(Xq.shape[0])
        bufs = _buffers(kind, min(rows, Xq.shape[0]), Za)
        for i in range(0, Xq.shape[0], rows):
            torch.mv(_blocks(kind, Xa[i : i + rows], Za, bufs)[0], a, out=ga[i : i + rows])
        ctx.save_for_backward(Xq, Zq, var, a, ga)
        ctx.kind, ctx.rows = kind, rows
        return var * ga

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        Xq, Zq, var, a, ga = ctx.saved_tensors
        need_x, need_z, need_var, need_a = ctx.needs_input_grad[:4]
        h = _FORMS[ctx.kind][1]
        c = grad * var  # [N]
        Xa, Za = _augmented(Xq, Zq)
        aZt = torch.cat([a.unsqueeze(-1) * Zq, a.unsqueeze(-1)], -1).mT.contiguous()  # [D + 1, M]
        cX = torch.cat([c.unsqueeze(-1) * Xq, c.unsqueeze(-1)], -1)  # [N, D + 1]
        Bt = Zq.new_zeros(Zq.shape[1] + 1, Zq.shape[0])  # [c x, c]^T P
        gX = torch.zeros_like(Xq) if need_x else None
        gGa = torch.zeros_like(a) if need_a and ctx.kind != "rbf" else None  # G^T c
        bufs = _buffers(ctx.kind, min(ctx.rows, Xq.shape[0]), Za)
        for i in range(0, Xq.shape[0], ctx.rows):
            sl = slice(i, i + ctx.rows)
            G, P = _blocks(ctx.kind, Xa[sl], Za, bufs)
            if need_x:
                A = (aZt @ P.mT).mT  # [rows, D + 1]: P (a z) and P a (this order is the faster product)
                gX[sl] = (-2.0 * h) * c[sl].unsqueeze(-1) * (Xq[sl] * A[:, -1:] - A[:, :-1])
            if need_z or (need_a and gGa is None):
                Bt.addmm_(cX[sl].mT, P)
            if gGa is not None:
                gGa.addmv_(G.mT, c[sl])
        B = Bt.mT  # P^T [c x, c]
        gZ = (-2.0 * h) * a.unsqueeze(-1) * (Zq * B[:, -1:] - B[:, :-1]) if need_z else None
        ga_out = (B[:, -1] if gGa is None else gGa) if need_a else None
        gvar = (grad * ga).sum().reshape(var.shape) if need_var else None
        return gX, gZ, gvar, ga_out, None


def _by_matrix(kernel, X, Z, a):
    """``kernel_matrix(kernel, X, Z) @ a``, in blocks of rows of a 2-D ``X`` (:func:`block_elements` per block,
    each block's matrix kept for autograd) when ``Z`` is 2-D and ``a`` a vector (a batched ``Z`` would put the
    batch, not the rows, first in each block's product)."""
    block = block_elements(X.device)
    if X.dim() != 2 or Z.dim() != 2 or a.dim() != 1 or X.shape[0] * Z.shape[-2] <= block:
        return kernel_matrix(kernel, X, Z) @ a
    rows = max(1, block // Z.shape[-2])
    return torch.cat([kernel_matrix(kernel, X[i : i + rows], Z) @ a for i in range(0, X.shape[0], rows)])


_KINDS = {pk.RBF: "rbf", pk.Matern32: "matern32", pk.Matern52: "matern52"}


def kernel_matvec(kernel, X: torch.Tensor, Z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``k(X, Z) @ a`` ``[N]`` for ``X`` ``[N, D]``, ``Z`` ``[M, D]``, ``a`` ``[M]`` (ODVGP's ``K_fv a``; Shi, Titsias,
    Mnih 2020, section 6.3), differentiable in all of them and in the kernel's hyperparameters. RBF, Matérn-3/2 and
    Matérn-5/2 kernels with unbatched hyperparameters take the blocked path of the module docstring (memory
    ``O((N + M) D)`` besides one block); anything else is ``kernel_matrix(kernel, X, Z) @ a`` (in blocks of rows;
    autograd keeps every block).

    >>> from pyro.contrib.gp.kernels import Matern32
    >>> k = Matern32(2)
    >>> X, O, a = torch.randn(5, 2), torch.randn(7, 2), torch.randn(7)
    >>> torch.allclose(kernel_matvec(k, X, O, a), kernel_matrix(k, X, O) @ a)
    True
    """
    _check(kernel, X, Z)
    kind = _KINDS.get(type(kernel))
    if kind is None or X.dim() != 2 or Z.dim() != 2 or a.dim() != 1:
        return _by_matrix(kernel, X, Z, a)
    var, ls = _hyper(kernel, "variance"), _hyper(kernel, "lengthscale", 1)
    if var.dim() != 0 or ls.dim() > 1:
        return _by_matrix(kernel, X, Z, a)
    Xc, Zc = _centred(_slice(kernel, X), _slice(kernel, Z))
    Xs, Zs = Xc / ls, Zc / ls
    x2, z2 = (Xs * Xs).sum(-1, keepdim=True), (Zs * Zs).sum(-1, keepdim=True)
    exact = _rbf_gemm_is_exact(x2, z2) if kind == "rbf" else _gemm_is_exact(x2, z2)
    if not exact:
        return _by_matrix(kernel, X, Z, a)
    root = _FORMS[kind][0] ** 0.5
    return _StationaryMatvec.apply(Xs * root, Zs * root, var, a, kind)
