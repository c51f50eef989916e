r"""The sites of EP and SEP for multi-class GP classification (Villacampa-Calvo and Hernández-Lobato 2017; the
method, shapes and notation are in :mod:`pyro_sparsegp.infer.ep`): the FITC statistics of the module, the whitened
Gaussian and its projections, the cavities and tilted moments of one factor (:func:`ep_refine`, appendix D), the
tied sites' change of whitening, the evidence of eq. 9 (appendix F) from the sites, writing q(u), and the refinement
steps of batch EP, minibatch EP (brief sec. 7) and SEP (sec. 2.3.1).
"""

from __future__ import annotations

import math

import torch

from ... import covariances as cov
from ...likelihoods import RobustMax
from ...linalg import KUU_INVERSE_ADVICE, cholesky, project_chol

__all__ = ["ep_refine"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


# -- FITC statistics -------------------------------------------------------------------------------------------
def _check_module(module):
    lik = module.likelihood
    if not isinstance(lik, RobustMax):
        raise ValueError(f"EP needs SVGP(..., RobustMax(K), num_outputs=K); the likelihood is {type(lik).__name__}")
    if module.num_outputs != lik.num_classes:
        raise ValueError(f"num_outputs ({module.num_outputs}) must equal the number of classes ({lik.num_classes})")
    return lik.num_classes


def _fitc_stats(module, X):
    """``(L [K, M, M], W [K, M, N], d [K, N])``: Cholesky factor of ``Kuu`` as the module computes it (same
    jitter), ``W = L^{-1} Kuf``, and the FITC diagonal ``d = k(x, x) - |w|^2`` (clamped at 0 against round-off).
    The covariances are those of the module's (inducing variable, kernel) pair
    (:func:`~pyro_sparsegp.covariances.Kuu`, :func:`~pyro_sparsegp.covariances.Kuf`), so inducing patches of a
    convolutional kernel work as inducing points do."""
    K = module.num_outputs
    Kuu = cov.Kuu(module.inducing, module.kernel)  # [M, M] shared or [K, M, M] per class
    L = cholesky(Kuu, module.jitter, warn_singular=KUU_INVERSE_ADVICE, symmetrize=True)
    (W,) = project_chol(Kuu, L, cov.Kuf(module.inducing, module.kernel, X.unsqueeze(-3)))  # [1|K, M, N]
    M, N = W.shape[-2:]
    L, W = L.expand(K, M, M), W.expand(K, M, N)
    d = (cov.Kdiag(module.kernel, X) - W.pow(2).sum(-2)).clamp(min=0.0)
    return L, W, d


def _gauss(Lam, eta):
    """Whitened posterior with precision ``I + Lam`` and natural mean ``eta``: ``(chol(I + Lam), mean)``."""
    eye = torch.eye(Lam.shape[-1], dtype=Lam.dtype, device=Lam.device)
    Lb = cholesky(eye + Lam, symmetrize=True)
    mu = torch.cholesky_solve(eta.unsqueeze(-1), Lb).squeeze(-1)
    return Lb, mu


def _log_norm(Lb, eta):
    """``A(q) - A(N(0, I))`` for ``q`` with precision ``Lb Lb^T`` and natural mean ``eta``, ``[K]``."""
    a = torch.linalg.solve_triangular(Lb, eta.unsqueeze(-1), upper=False).squeeze(-1)
    return -Lb.diagonal(dim1=-2, dim2=-1).log().sum(-1) + 0.5 * a.pow(2).sum(-1)


def _proj(Lb, mu, T):
    """Projections of ``N(mu, (Lb Lb^T)^{-1})`` onto the columns of ``T`` ``[K, M, N]``: ``(var, mean, Lb^{-1} T)``."""
    V = torch.linalg.solve_triangular(Lb, T, upper=False)
    return V.pow(2).sum(-2), (mu.unsqueeze(-1) * T).sum(-2), V


def _side_cavity(tv, tw, tm, v, m, C1, C2):
    """Cavity projections onto a direction ``t`` after removing a site ``exp(-C1/2 (w^T u)^2 + C2 w^T u)`` from q
    (brief sec. 2, eqs. 28-32), given ``tv = t^T S t``, ``tw = t^T S w``, ``tm = t^T mu``, ``v = w^T S w``,
    ``m = w^T mu`` of q. Returns ``(mean, var, 1 - C1 v)``; the cavity is proper iff the last is positive."""
    den = 1.0 - C1 * v
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return tm + tw * (C1 * m - C2) / safe, tv + tw.pow(2) * C1 / safe, den


def ep_refine(mu_a, v_a, mu_k, v_k, d_a, d_k):
    r"""New site parameters of the factors ``Phi((f^a - f^k) / sqrt(d_a + d_k))`` from their cavity projections
    (appendix D, eqs. 33-55; brief sec. 3). All arguments broadcast; ``a`` is the observed class.

    ``s = d_a + d_k + v_a + v_k``, ``beta = (mu_a - mu_k) / sqrt(s)``, ``alpha = N(beta) / Phi(beta)``,
    ``g = alpha (alpha + beta) / s``; ``C1y = g / (1 - g v_a)``, ``C2y = alpha / sqrt(s) (1 + C1y v_a) + C1y mu_a``,
    ``C1c = g / (1 - g v_k)``, ``C2c = -alpha / sqrt(s) (1 + C1c v_k) + C1c mu_k``.

    :returns: ``((C1y, C2y, C1c, C2c), ok, log Phi(beta))``; ``ok`` is False where the update is invalid
        (``s <= 0``, ``g`` outside ``(0, 1/s)``, non-finite values); there the returned values are meaningless.
    """
    s = d_a + d_k + v_a + v_k
    ok = s > 0
    s = torch.where(ok, s, torch.ones_like(s))
    rs = s.sqrt()
    beta = (mu_a - mu_k) / rs
    logcdf = torch.special.log_ndtr(beta)
    alpha = torch.exp(-0.5 * beta.pow(2) - _HALF_LOG_2PI - logcdf)
    g = alpha * (alpha + beta) / s
    C1y = g / (1.0 - g * v_a)
    C1c = g / (1.0 - g * v_k)
    C2y = alpha / rs * (1.0 + C1y * v_a) + C1y * mu_a
    C2c = -alpha / rs * (1.0 + C1c * v_k) + C1c * mu_k
    ok = ok & (g > 0) & (g * s < 1) & (C1y > 0) & (C1c > 0)
    for t in (C1y, C2y, C1c, C2c, logcdf):
        ok = ok & torch.isfinite(t)
    return (C1y, C2y, C1c, C2c), ok, logcdf


def _transform(state, L0):
    """Move the tied sites to the whitening of ``L0`` (keep the factors as functions of ``u``)."""
    if state.L_ref is not None and state.Lam is not None and not torch.equal(state.L_ref, L0):
        R = torch.linalg.solve_triangular(state.L_ref, L0, upper=False)
        state.Lam = R.mT @ state.Lam @ R
        state.eta = (R.mT @ state.eta.unsqueeze(-1)).squeeze(-1)
    state.L_ref = L0


def _aggregate(a, b, own):
    """Per-class site coefficient of each point ``[K, N]``: ``sum_j a[i, j]`` on its own class, ``b[i, k]`` else."""
    return torch.where(own, a.sum(-1, keepdim=True), b).T


def _factor_counts(y, K):
    n = torch.bincount(y, minlength=K).to(torch.get_default_dtype())
    return (y.numel() - n) + (K - 1) * n  # factors that touch class k


# -- evidence ------------------------------------------------------------------------------------------------------
def _ep_terms(W, d, sites, y, own):
    """q, projections and per-factor cavities of batch EP (sites on the current directions)."""
    C1y, C2y, C1c, C2c = sites
    c1, c2 = _aggregate(C1y, C1c, own), _aggregate(C2y, C2c, own)
    Lam = (W * c1.unsqueeze(-2)) @ W.mT
    eta = (W * c2.unsqueeze(-2)).sum(-1)
    Lq, mu = _gauss(Lam, eta)
    v, m, _ = _proj(Lq, mu, W)
    g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731
    cav_a = _side_cavity(g(v), g(v), g(m), g(v), g(m), C1y, C2y)
    cav_k = _side_cavity(v.T, v.T, m.T, v.T, m.T, C1c, C2c)
    return Lam, eta, Lq, mu, v, m, cav_a, cav_k


def _delta(v, m, C1, C2, den):
    """``A(cavity) - A(q)`` projected on one side (appendix F)."""
    return -0.5 * den.log() + 0.5 * (C1 * m.pow(2) - 2 * C2 * m + C2.pow(2) * v) / den


def _ep_evidence(W, d, sites, y, own):
    C1y, C2y, C1c, C2c = sites
    Lam, eta, Lq, mu, v, m, (ma, va, dena), (mk, vk, denk) = _ep_terms(W, d, sites, y, own)
    dT = d.T
    s = dT.gather(-1, y[:, None]) + dT + va + vk
    beta = (ma - mk) / s.sqrt()
    g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731
    per = (torch.special.log_ndtr(beta) + _delta(g(v), g(m), C1y, C2y, dena) + _delta(v.T, m.T, C1c, C2c, denk))
    return per.masked_fill(own, 0.0).sum() + _log_norm(Lq, eta).sum()


def _sep_evidence(W, d, Lam, eta, y, own, F, scale=1.0, counts=None):
    Lq, mu = _gauss(Lam, eta)
    r = ((F - 1) / F)[:, None]
    Lc, muc = _gauss(r[..., None] * Lam, r * eta)
    tv, tm, _ = _proj(Lc, muc, W)
    dT = d.T
    s = dT.gather(-1, y[:, None]) + dT + tv.T.gather(-1, y[:, None]) + tv.T
    beta = (tm.T.gather(-1, y[:, None]) - tm.T) / s.sqrt()
    Bk = F if counts is None else counts
    cav_minus_q = _log_norm(Lc, r * eta) - _log_norm(Lq, eta)
    data = torch.special.log_ndtr(beta).masked_fill(own, 0.0).sum() + (Bk * cav_minus_q).sum()
    return scale * data + _log_norm(Lq, eta).sum()


# -- writing q(u) ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def _write_q(module, L, Lam, eta):
    Lq, mu = _gauss(Lam, eta)
    eye = torch.eye(Lq.shape[-1], dtype=Lq.dtype, device=Lq.device)
    S_tril = torch.linalg.solve_triangular(Lq.mT, eye.expand_as(Lq), upper=True)  # Lq^{-T}: S = Lq^{-T} Lq^{-1}
    S = S_tril @ S_tril.mT
    St = cholesky(S, symmetrize=True)
    if module.whiten:
        module.q_u.set(mu, St)
    else:
        module.q_u.set((L @ mu.unsqueeze(-1)).squeeze(-1), L @ St)


def _damp(old, new, ok, delta):
    return torch.where(ok, delta * new + (1 - delta) * old, old)


@torch.no_grad()
def _ep_batch(state, W, d, y, own, delta):
    sites = state.sites
    C1y, C2y, C1c, C2c = sites
    Lam, eta, Lq, mu, v, m, (ma, va, dena), (mk, vk, denk) = _ep_terms(W, d, sites, y, own)
    dT = d.T
    g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731
    new, ok, logcdf = ep_refine(ma, va, mk, vk, g(d), dT)
    ok = ok & (dena > 0) & (denk > 0) & ~own
    tiny = torch.finfo(d.dtype).tiny  # improper cavities (skipped factors) give -inf here, never NaN
    per = logcdf + _delta(g(v), g(m), C1y, C2y, dena.clamp(min=tiny)) + _delta(v.T, m.T, C1c, C2c, denk.clamp(min=tiny))
    logz = per.masked_fill(own, 0.0).sum() + _log_norm(Lq, eta).sum()

    def apply():
        state.sites = tuple(_damp(o, n, ok, delta).masked_fill(own, 0.0) for o, n in zip(sites, new, strict=True))

    return apply, ok, (Lq, mu, Lam, eta, (W, C1y, C2y, C1c, C2c)), logz


@torch.no_grad()
def _ep_minibatch(state, L0, W, d, y, own, idx):
    """Minibatch EP (brief sec. 7): cavities from q and the batch's old sites (old directions), refinement on the
    new directions (``delta = 1``), then q <- q - old contributions + new ones."""
    _transform(state, L0)
    Lq, mu = _gauss(state.Lam, state.eta)
    C1y, C2y, C1c, C2c = (s[idx] for s in state.sites)
    Wold = L0.mT @ state.ups[:, idx].mT  # [K, M, B] old directions, whitened at L0
    tv, tm, Vt = _proj(Lq, mu, W)
    v, m, Vw = _proj(Lq, mu, Wold)
    tw = (Vt * Vw).sum(-2)
    g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731
    ma, va, dena = _side_cavity(g(tv), g(tw), g(tm), g(v), g(m), C1y, C2y)
    mk, vk, denk = _side_cavity(tv.T, tw.T, tm.T, v.T, m.T, C1c, C2c)
    new, ok, _ = ep_refine(ma, va, mk, vk, g(d), d.T)
    # a point moves only if all its K - 1 factors can (its sites are summed on one direction per class)
    ok = ((ok & (dena > 0) & (denk > 0)) | own).all(-1, keepdim=True) & ~own
    old = (C1y, C2y, C1c, C2c)
    sur = (Lq, mu, state.Lam.clone(), state.eta.clone(), (Wold, *old))

    def apply():
        # old sites on old directions out, new (or kept) sites on the new directions in
        kept = tuple(torch.where(ok, n, o).masked_fill(own, 0.0) for o, n in zip(old, new, strict=True))
        c1o, c2o = _aggregate(old[0], old[2], own), _aggregate(old[1], old[3], own)
        # a skipped point keeps its old sites, on their old directions
        W_in = torch.where(ok.any(-1)[None, None, :], W, Wold)
        c1n, c2n = _aggregate(kept[0], kept[2], own), _aggregate(kept[1], kept[3], own)
        state.Lam = (state.Lam - (Wold * c1o.unsqueeze(-2)) @ Wold.mT + (W_in * c1n.unsqueeze(-2)) @ W_in.mT)
        state.eta = state.eta - (Wold * c2o.unsqueeze(-2)).sum(-1) + (W_in * c2n.unsqueeze(-2)).sum(-1)
        for s, k in zip(state.sites, kept, strict=True):
            s[idx] = k
        ups_new = torch.linalg.solve_triangular(L0.mT, W_in, upper=True)  # L0^{-T} w = K^{-1} k(Z, x)
        state.ups[:, idx] = ups_new.mT

    return apply, ok, sur


@torch.no_grad()
def _sep_step(state, L0, W, d, y, own, F, scale, delta):
    """SEP (sec. 2.3.1; brief sec. 6): every factor of the batch from its class's shared cavity, then
    ``Lambda <- delta Lambda_new + (1 - delta) (B/F) Lambda + (1 - B/F) Lambda`` (and eta)."""
    _transform(state, L0)
    K = F.shape[0]
    r = ((F - 1) / F)[:, None]
    Lc, muc = _gauss(r[..., None] * state.Lam, r * state.eta)
    tv, tm, _ = _proj(Lc, muc, W)
    g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731
    new, ok, logcdf = ep_refine(g(tm), g(tv), tm.T, tv.T, g(d), d.T)
    ok = ok & ~own
    n = torch.bincount(y, minlength=K).to(W.dtype)
    Bk_all = (len(y) - n) + (K - 1) * n
    Lq, mu = _gauss(state.Lam, state.eta)
    cav_minus_q = _log_norm(Lc, r * state.eta) - _log_norm(Lq, state.eta)
    logz = scale * (logcdf.masked_fill(own, 0.0).sum() + (Bk_all * cav_minus_q).sum()) + _log_norm(Lq, state.eta).sum()
    sur = (Lc, muc, state.Lam.clone(), state.eta.clone(), None)

    def apply():
        C1y, C2y, C1c, C2c = (t.masked_fill(~ok, 0.0) for t in new)
        c1, c2 = _aggregate(C1y, C1c, own), _aggregate(C2y, C2c, own)
        okc = _aggregate(ok.to(W.dtype), ok.to(W.dtype), own)  # [K, B]: valid factors per class and point
        Bk = okc.sum(-1)
        Lam_new = (W * c1.unsqueeze(-2)) @ W.mT
        eta_new = (W * c2.unsqueeze(-2)).sum(-1)
        keep = (1 - delta * Bk / F)  # remove B_k average factors, damped
        state.Lam = delta * Lam_new + keep[:, None, None] * state.Lam
        state.eta = delta * eta_new + keep[:, None] * state.eta

    return apply, ok, sur, logz
