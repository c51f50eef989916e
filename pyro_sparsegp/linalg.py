"""Dense linear algebra shared by every bound: a Cholesky factorisation with documented jitter escalation,
projections ``chol(K)^{-1} R`` with a fused backward pass, and Gauss-Hermite quadrature nodes.

Jitter policy (one place, used everywhere):

* ``cholesky(A)`` first factorises ``A + base_jitter * I`` with ``base_jitter = 1e-6`` in float32 and ``1e-10``
  in float64, times the mean of ``diag(A)`` so that it is scale-free.
* If that fails it retries with the jitter multiplied by 10, at most ``max_tries`` times, and emits a
  :class:`CholeskyJitterWarning` saying which jitter succeeded.
* If every try fails it raises :class:`torch.linalg.LinAlgError` naming the largest jitter tried. It never returns
  NaN silently.
* A factorisation that succeeds can still be numerically singular: when a pivot :math:`L_{ii}^2` is less than four times
  the jitter that was added, the jitter (not the matrix) made it positive definite, so the matrix is singular to
  working precision (duplicate or near-duplicate inducing inputs are the usual cause; a rank-one ``Kuu`` from
  all-equal inputs factorises with a ``1e-10`` jitter in float64). Quantities built from its inverse (the
  un-whitened KL, ``Kuu^{-1}``) are then dominated by the jitter. :func:`cholesky` emits
  :class:`IllConditionedWarning` naming the number of such pivots and the fix that its caller knows to be true
  (:data:`KUU_ADVICE`, :data:`KUU_INVERSE_ADVICE`), or nothing where the jitter is harmless (a whitened ``Kuu``).

Each warning is emitted **once per cause** per process (cause: the kind, the matrix size, the dtype and the jitter
reached), not at every step; :func:`reset_warnings` forgets what was reported.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .checks.matrices import _check_factorisable
from .context import deferred
from .context.reporting import _REPORTED, _RESET_HOOKS, _warn_once

__all__ = ["CholeskyJitterWarning", "IllConditionedWarning", "reset_warnings", "cholesky", "default_jitter",
           "gauss_hermite", "solve_lower", "add_diag", "project_chol", "whitened_marginals", "gram"]


class CholeskyJitterWarning(UserWarning):
    """Emitted when :func:`cholesky` had to raise the jitter above its base value to factorise a matrix."""


class IllConditionedWarning(UserWarning):
    """Emitted when :func:`cholesky` succeeded only because of the jitter: the matrix is numerically singular."""


def reset_warnings() -> None:
    """Forget which causes the package has reported (here, in :mod:`pyro_sparsegp.checks.validation` and wherever
    :mod:`pyro_sparsegp.context.reporting` warned once), so that each warns again (once). Takes and returns no
    tensor, so shapes do not apply."""
    _REPORTED.clear()
    for hook in _RESET_HOOKS:
        hook()


#: The advice of :class:`IllConditionedWarning` for the inducing inputs' kernel matrix of an un-whitened layer.
KUU_ADVICE = ("For the inducing inputs' kernel matrix Kuu this means duplicate or near-duplicate inducing inputs (or "
              "a lengthscale much larger than their spread), and the un-whitened bound uses its inverse, which the "
              "jitter then dominates: use whiten=True (the layers' default, which never inverts it), or remove "
              "duplicate inducing inputs / use fewer of them.")
#: The advice for ``Kuu`` where the method itself needs its inverse (EP, SEP, MFSp): whitening is not an option.
KUU_INVERSE_ADVICE = (
    "This is the inducing inputs' kernel matrix Kuu, whose inverse this method uses (the jitter then dominates it): "
    "its inputs are redundant, as duplicate or near-duplicate inducing inputs (duplicate rows of X taken as Z) or "
    "more of them than the lengthscale can tell apart make them. Remove the duplicates or use fewer of them."
)


def _check_conditioning(A, L, eps, scale, advice):
    """Warn (once per cause) when some pivot ``L_ii^2`` is below four times the jitter ``eps * scale`` ``[...]``."""
    if eps <= 0:
        return
    added = eps * scale
    piv = L.detach().diagonal(dim1=-2, dim2=-1).pow(2)  # [..., M]
    dominated = piv < 4 * added.unsqueeze(-1)
    if not bool(dominated.any()):
        return
    count = int(dominated.sum(-1).max())
    M = A.shape[-1]
    _warn_once(
        ("ill", M, A.dtype, advice),
        f"cholesky: a {M} x {M} matrix is numerically singular: {count} of its {M} pivots come from the jitter "
        f"(relative {eps:.1e}), not from the matrix. {advice}",
        IllConditionedWarning,
    )


def default_jitter(dtype: torch.dtype) -> float:
    """Base relative jitter: ``1e-6`` for float32 (and lower precisions), ``1e-10`` for float64."""
    return 1e-10 if dtype == torch.float64 else 1e-6


def add_diag(A: torch.Tensor, value) -> torch.Tensor:
    """Return ``A + value * I`` without modifying ``A`` (``value`` broadcasts against ``A.shape[:-2]``)."""
    if isinstance(value, torch.Tensor):
        value = value.unsqueeze(-1)  # [..., 1] against the diagonal [..., M]
        A = A.expand(torch.broadcast_shapes(A.shape[:-2], value.shape[:-1]) + A.shape[-2:])
    out = A.clone()  # one pass over A (an eye would cost three); autograd sees clone + diagonal add
    out.diagonal(dim1=-2, dim2=-1).add_(value)
    return out


def cholesky(
    A: torch.Tensor,
    jitter: float | None = None,
    max_tries: int = 6,
    warn_singular: bool | str = True,
    warn_jitter: bool = True,
    symmetrize: bool = False,
) -> torch.Tensor:
    """Lower Cholesky factor of a batch of symmetric positive-definite matrices with jitter escalation.

    :param A: ``[..., M, M]`` symmetric matrices.
    :param jitter: base relative jitter (default :func:`default_jitter`), scaled by the mean diagonal of ``A``;
        ``0`` tries the exact matrix first and then escalates from :func:`default_jitter`.
    :param max_tries: how many tenfold escalations to try after the first attempt.
    :param warn_singular: emit :class:`IllConditionedWarning` for a numerically singular matrix, with this advice
        (a string: what the matrix is and what to do; ``True``: a generic sentence). Callers pass ``False`` where
        the jitter is harmless and no advice would be true: a whitened ``Kuu`` (and SOLVE-GP's ``Cvv``), whose
        inverse no term of the whitened bound uses (the jitter adds a negligible independent variance to ``u``),
        and the full posterior covariance of many test points, low-rank by nature.
    :param warn_jitter: emit :class:`CholeskyJitterWarning` when the jitter had to be raised; ``False`` where that
        is expected and harmless (the posterior covariance of many test points in float32).
    :param symmetrize: ``True`` for a matrix the package built, symmetric up to round-off (every call inside it):
        ``0.5 (A + A^T)`` is factorised unchecked, since round-off can pass the check's tolerance (float32 SOLVE-GP
        with ``O = Z``: ``Cvv`` is near zero). ``False`` (default; a user's matrix): the symmetry check runs.
    :returns: ``L`` ``[..., M, M]`` with ``L @ L.mT = A + jitter * mean(diag A) * I``.
    :raises torch.linalg.LinAlgError: if the matrix is not positive definite even with the largest jitter.
    :raises ValueError: if ``A`` is not ``[..., M, M]`` or not symmetric (``sqrt(eps)``;
        :mod:`pyro_sparsegp.checks.matrices`).

    Warns :class:`CholeskyJitterWarning` when the jitter had to be raised and :class:`IllConditionedWarning` when
    the matrix is numerically singular (the module docstring gives the escalation), each once per cause. Inside
    :func:`~pyro_sparsegp.context.deferred.deferred_checks` (``fit`` on a GPU) it factorises once with the run's jitter
    and flags a failure on the device; ``fit`` escalates at its next sync point (:mod:`pyro_sparsegp.context.deferred`).
    """
    checks = deferred.active()  # None outside fit's deferred steps (which read nothing back)
    traced = deferred.tracing()  # a compiler traces: one factorisation, nothing read back (context/deferred.py)
    if symmetrize:  # built by the package: symmetric up to round-off, which the check's tolerance may not cover
        A = 0.5 * (A + A.mT)
    elif checks is None and not traced:  # shape, symmetry (checks.matrices)
        _check_factorisable(A)
    if jitter is None:
        jitter = default_jitter(A.dtype)
    scale = A.diagonal(dim1=-2, dim2=-1).mean(-1).detach().abs().clamp(min=torch.finfo(A.dtype).tiny)
    if checks is not None:  # one factorisation with the run's jitter; a failure is flagged, not read (context.deferred)
        eps = (jitter if jitter > 0 else default_jitter(A.dtype)) * checks.jitter_scale
        L, info = torch.linalg.cholesky_ex(add_diag(A, eps * scale))
        checks.record(checks.CHOLESKY, info > 0)
        return L
    if traced:
        return torch.linalg.cholesky_ex(add_diag(A, (jitter if jitter > 0 else default_jitter(A.dtype)) * scale))[0]
    if not torch.isfinite(scale).all():
        raise ValueError("cholesky: the matrix contains NaN or inf entries")
    eps = jitter
    for attempt in range(max_tries + 1):
        L, info = torch.linalg.cholesky_ex(add_diag(A, eps * scale))
        if not bool((info > 0).any()):
            if attempt > 0 and warn_jitter:
                _warn_once(
                    ("jitter", A.shape[-1], A.dtype, eps),
                    f"cholesky: matrix of size {A.shape[-1]} was not numerically positive definite; "
                    f"succeeded with relative jitter {eps:.1e} (base {jitter:.1e}); reported once per size and "
                    "jitter (duplicate inducing inputs, or float32 with many of them, are the usual cause)",
                    CholeskyJitterWarning,
                )
            if warn_singular:
                advice = warn_singular if isinstance(warn_singular, str) else (
                    "Quantities built from its inverse are then dominated by the jitter.")
                _check_conditioning(A, L, eps, scale, advice)
            return L
        eps = max(eps * 10.0, default_jitter(A.dtype) if attempt == 0 and eps == 0 else 0.0)  # jitter=0: then base
    raise torch.linalg.LinAlgError(
        f"cholesky: matrix of size {A.shape[-1]} is not positive definite even with relative jitter "
        f"{eps / 10:.1e}; check the inputs (duplicate points, NaN) and the kernel hyperparameters"
    )


def solve_lower(L: torch.Tensor, B: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``L^{-1} B`` (or ``L^{-T} B`` when ``transpose``) for lower-triangular ``L`` ``[..., M, M]`` and
    ``B`` ``[..., M, K]``.

    A row-major ``B`` (the layout of every kernel matrix here) is solved from the right, ``X^T L^T = B^T``: LAPACK's
    ``trsm`` reads ``B^T`` column-major without copying it and the result comes back row-major. The left-sided call
    would transpose ``B`` into a copy first and return a column-major ``X`` that slows the products after it (1.2-2.4x
    on a 128 x 10,240 right-hand side on CPU)."""
    if B.stride(-1) == 1 and (deferred.tracing() or B.shape[-1] > 1):  # (a traced size is a tensor)
        if transpose:
            return torch.linalg.solve_triangular(L, B.mT, upper=False, left=False).mT
        return torch.linalg.solve_triangular(L.mT, B.mT, upper=True, left=False).mT
    if transpose:
        return torch.linalg.solve_triangular(L.mT, B, upper=True)
    return torch.linalg.solve_triangular(L, B, upper=False)


class _ProjectChol(torch.autograd.Function):
    """``W_i = L^{-1} R_i`` with ``L = chol(K)`` given; the backward pass returns the gradient with respect to ``K``
    through the Cholesky factor without forming the gradient of ``L`` (see :func:`project_chol`)."""

    @staticmethod
    def forward(ctx, K, L, *Rs):
        Ws = tuple(solve_lower(L, R) for R in Rs)
        ctx.save_for_backward(L, *Ws)
        ctx.k_shape = K.shape
        return Ws

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *gWs):
        L, *Ws = ctx.saved_tensors
        gRs, Y = [], None
        for gW, W in zip(gWs, Ws, strict=True):
            if gW is None:
                gRs.append(None)
                continue
            gRs.append(solve_lower(L, gW, transpose=True))  # L^{-T} gW  [..., M, B]
            y = _sum_to(gW @ W.mT, L.shape)  # [..., M, M]
            Y = y if Y is None else Y + y
        gK = _chol_grad(L, Y, ctx.k_shape) if Y is not None and ctx.needs_input_grad[0] else None
        return (gK, None, *gRs)


def _chol_grad(L, Y, k_shape):
    """The gradient with respect to ``K = L L^T`` given ``Y = L^T g_L`` (here ``-sum g_W W^T``, which equals it):
    ``L^{-T} Phi(-Y) L^{-1}``, ``Phi`` = lower triangle with halved diagonal, symmetrised (the convention of torch's
    cholesky backward; Murray 2016)."""
    T = Y.tril().neg_()
    T = 0.5 * (T + T.tril(-1).mT)
    T = torch.linalg.solve_triangular(L.mT, T, upper=True)
    return _sum_to(torch.linalg.solve_triangular(L, T, upper=False, left=False), k_shape)


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum the leading dimensions of ``t`` that were broadcast against ``shape`` (autograd's reduction)."""
    if t.shape == shape:
        return t
    lead = t.dim() - len(shape)
    t = t.sum(tuple(range(lead))) if lead > 0 else t
    dims = tuple(i for i, (a, b) in enumerate(zip(t.shape, shape, strict=True)) if b == 1 and a != 1)
    return t.sum(dims, keepdim=True) if dims else t


def project_chol(K: torch.Tensor, L: torch.Tensor, *Rs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    r"""``(L^{-1} R_1, L^{-1} R_2, ...)`` where ``L = chol(K)`` (plus a constant jitter) is already computed.

    The value is that of ``solve_lower(L, R_i)``; the difference is the gradient. Autograd would differentiate the
    triangular solve with respect to ``L`` (``g_L = -tril(L^{-T} g_W W^T)``, a product) and then the Cholesky
    (``L^T g_L``, a second product, and two triangular solves), once per right-hand side. Because
    :math:`L^T g_L = -g_W W^T` exactly, this function goes to ``K`` directly,

    .. math:: \bar K = L^{-T}\,\Phi\Big(-\sum_i \bar W_i W_i^T\Big)\,L^{-1}, \qquad \bar R_i = L^{-T} \bar W_i,

    with :math:`\Phi` the lower triangle with halved diagonal, symmetrised (Murray 2016, "Differentiation of the
    Cholesky decomposition"): one product per right-hand side and one pair of ``M^3`` solves in all, which saves
    a third of the backward cost of a projection. The gradient reaches ``K`` only through this path; ``L`` is
    treated as a constant here, so uses of ``L`` elsewhere (a KL, a prior) keep their own autograd path and the two
    contributions add up. Not twice differentiable.

    :param K: ``[..., M, M]`` the factorised matrix (its gradient is returned).
    :param L: ``[..., M, M]`` its lower Cholesky factor (detached here).
    :param Rs: right-hand sides ``[..., M, B_i]`` (batch dimensions broadcast against ``L``'s).
    :returns: tuple of ``[..., M, B_i]``.
    """
    return _ProjectChol.apply(K, L.detach(), *Rs)


class _WhitenedMarginals(torch.autograd.Function):
    """See :func:`whitened_marginals`. Inputs ``(K, L, R, m, C)`` (``K`` given: ``W = L^{-1} R`` is formed here and
    the gradient goes to ``K`` and ``R``) or ``(None, None, W, m, C)``."""

    @staticmethod
    def forward(ctx, K, L, R, m, C):
        W = R if L is None else solve_lower(L, R)
        M = C.shape[-1]
        P = C @ C.mT - torch.eye(M, dtype=C.dtype, device=C.device)  # S - I  [(L,) M, M]
        T = P @ W  # [..., M, B]
        loc = (m.unsqueeze(-2) @ W).squeeze(-2)
        dvar = (W * T).sum(-2)
        # with L the backward pass needs no T (module docstring of whitened_marginals); without, g_W = 2 T diag(g)
        ctx.save_for_backward(L, W, T if L is None else None, m, C, P)
        ctx.k_shape = None if K is None else K.shape
        ctx.r_shape = R.shape
        return loc, dvar

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loc, g_dvar):
        L, W, T, m, C, P = ctx.saved_tensors
        M = W.shape[-2]
        batch = torch.broadcast_shapes(m.shape[:-1], C.shape[:-2], () if L is None else L.shape[:-2])
        # [W diag(g_dvar); g_loc^T] in one buffer: its top rows give W diag(g) W^T, all of it g_R (below)
        full = torch.broadcast_shapes(W.shape[:-2], g_dvar.shape[:-1], g_loc.shape[:-1])
        buf = W.new_empty(full + (M + 1, W.shape[-1]))
        Wd = torch.mul(W, g_dvar.unsqueeze(-2), out=buf[..., :M, :])
        buf[..., M, :] = g_loc
        gm_b = _sum_to(W @ g_loc.unsqueeze(-1), batch + (M, 1)).squeeze(-1)  # [batch, M]
        gP_b = _sum_to(Wd @ W.mT, batch + P.shape[-2:])  # W diag(g) W^T  [batch, M, M]
        gm, gC = _sum_to(gm_b, m.shape), _sum_to(2.0 * (gP_b @ C), C.shape)
        if L is None:  # g_W = 2 T diag(g_dvar) + m g_loc^T
            gW = _add_outer_(T * (2.0 * g_dvar.unsqueeze(-2)), m, g_loc)
            return None, None, _sum_to(gW, W.shape), gm, gC
        # g_R = L^{-T} g_W = [2 L^{-T} (S - I) | L^{-T} m] [W diag(g_dvar); g_loc^T]: one product, the M^3 solves
        # on the left (a reassociation of L^{-T} ((S - I) W diag(g)), no [M, B] solve and no pass over T)
        left = solve_lower(L, torch.cat([2.0 * P, m.unsqueeze(-1).expand(P.shape[:-1] + (1,))], -1), transpose=True)
        gR = _sum_to(left @ buf, ctx.r_shape)
        gK = None
        if ctx.needs_input_grad[0]:
            # sum g_W W^T = m (W g_loc)^T + 2 (S - I) W diag(g_dvar) W^T: M^3, no further [M, B] product
            Y = m.unsqueeze(-1) * gm_b.unsqueeze(-2) + 2.0 * (P @ gP_b)
            gK = _chol_grad(L, _sum_to(Y, L.shape), ctx.k_shape)
        return gK, None, gR, gm, gC


def _add_outer_(A, a, b):
    """``A += a b^T`` in place for a fresh contiguous ``A`` ``[..., M, B]``, ``a`` ``[..., M]``, ``b`` ``[..., B]``
    broadcasting against ``A``'s batch: a rank-one ``baddbmm_`` (one pass over ``A``, no ``[M, B]`` temporary)."""
    M, B = A.shape[-2:]
    batch = A.shape[:-2]
    A = A if A.is_contiguous() else A.contiguous()
    a = a.expand(batch + (M,)).reshape(-1, M, 1)
    b = b.expand(batch + (B,)).reshape(-1, 1, B)
    A.view(-1, M, B).baddbmm_(a, b)
    return A


def whitened_marginals(W_or_R: torch.Tensor, m: torch.Tensor, C: torch.Tensor, K: torch.Tensor | None = None,
                       L: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The terms of the marginals of ``q(f)`` for whitened ``q(v) = N(m, C C^T)``: ``loc = m^T W`` and
    ``dvar = sum(W * ((C C^T - I) W), -2)``, so that :math:`\sigma^2_n = k_{nn} + \mathrm{dvar}_n` (Hensman,
    Matthews, Ghahramani 2015, eq. 19, whitened: :math:`-a_n^T (I - S) a_n`).

    One fused autograd function. Its backward pass costs one ``[M, M] x [M, B]`` product for the gradient to ``C``
    (``W diag(g) W^T``) and one for the gradient to the right-hand side; autograd through ``C^T W`` and a projection
    costs four products and a solve. Given ``K`` and ``L = chol(K)``, the first argument is ``R = Kuf`` and
    ``W = L^{-1} R`` is formed here: the gradient to ``R`` is ``[2 L^{-T} (S - I) | L^{-T} m] [W diag(g); g_loc^T]``
    (``M^3`` solves on the left, no ``[M, B]`` solve), and the gradient to ``K`` uses ``sum g_W W^T = m (W g_loc)^T
    + 2 (S - I) W diag(g) W^T`` (an ``M^3`` product instead of an ``M^2 B`` one) and goes to ``K`` as in
    :func:`project_chol` (``L`` is treated as a constant). Not twice differentiable.

    :param W_or_R: ``W`` (or ``R`` with ``K``, ``L``) ``[..., M, B]``.
    :param m: ``[(L,) M]``; :param C: ``[(L,) M, M]`` (any square factor of ``S``).
    :returns: ``(loc, dvar)``, each ``[..., B]``.
    """
    if K is None:
        return _WhitenedMarginals.apply(None, None, W_or_R, m, C)
    return _WhitenedMarginals.apply(K, L.detach(), W_or_R, m, C)


class _Gram(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A):
        ctx.save_for_backward(A)
        return A.mT @ A

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (A,) = ctx.saved_tensors
        return A @ (g + g.mT)


def gram(A: torch.Tensor) -> torch.Tensor:
    """``A^T A`` ``[..., K, K]`` for ``A`` ``[..., M, K]``, with a backward pass of one product, ``A (g + g^T)``
    (autograd would differentiate the two factors separately: two products)."""
    return _Gram.apply(A)


@functools.lru_cache(maxsize=64)
def _gh_numpy(n: int):
    x, w = np.polynomial.hermite_e.hermegauss(n)  # probabilists' Hermite: weight exp(-x^2 / 2)
    return x, w / math.sqrt(2 * math.pi)


def gauss_hermite(n: int, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights for :math:`\\mathbb{E}_{z\\sim N(0,1)}[g(z)] \\approx \\sum_i w_i g(x_i)`.

    Hensman, Matthews, Ghahramani (2015), section 4: one-dimensional Gauss-Hermite quadrature of the expected
    log-likelihood under each marginal :math:`q(f_n) = N(\\mu_n, \\sigma_n^2)`, with ``f = mu + sigma * x``.

    :returns: ``(x, w)``, each ``[n]``; the weights sum to one.
    """
    if n < 1:
        raise ValueError(f"gauss_hermite: need at least one node, got {n}")
    x, w = _gh_numpy(int(n))
    dtype = dtype or torch.get_default_dtype()
    return torch.as_tensor(x, dtype=dtype, device=device), torch.as_tensor(w, dtype=dtype, device=device)
