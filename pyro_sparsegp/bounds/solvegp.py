r"""Closed-form bounds of SOLVE-GP (Shi, Titsias, Mnih 2020, "Sparse orthogonal variational inference for Gaussian
processes", AISTATS), equation by equation, on explicit dense matrices (un-whitened parameters).

Notation: inducing inputs ``Z`` (``M``) and orthogonal inducing inputs ``O`` (``M2``); ``Kuu [M, M]``,
``Kuv [M, M2]``, ``Kvv [M2, M2]``, ``Kuf [M, N]``, ``Kvf [M2, N]``, ``kff_diag [N]``;
:math:`Q_{ff} = K_{fu}K_{uu}^{-1}K_{uf}`, :math:`C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}`,
:math:`C_{fv} = K_{fv} - K_{fu}K_{uu}^{-1}K_{uv}`; :math:`q(u) = N(m_u, L_uL_u^T)`,
:math:`q(v_\perp) = N(m_v, L_vL_v^T)`.
"""
from __future__ import annotations

import math

import torch

from ..linalg import cholesky, solve_lower

__all__ = [
    "solvegp_marginals",
    "solvegp_kl",
    "solvegp_bound",
    "solvegp_collapsed_bound",
    "odvgp_bound",
    "tight_collapsed_bound",
    "count_cubic_operations",
]


def _kl(m, L, Lp):
    """KL[N(m, L L^T) || N(0, Lp Lp^T)] (algorithm 1, ``Compute KL``)."""
    P = solve_lower(Lp, L)
    a = solve_lower(Lp, m.unsqueeze(-1)).squeeze(-1)
    logdet = Lp.diagonal(dim1=-2, dim2=-1).log().sum(-1) - L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return logdet + 0.5 * (P.pow(2).sum((-2, -1)) + a.pow(2).sum(-1) - m.shape[-1])


def _factors(Kuu, Kuv, Kvv, Kuf, Kvf):
    """Algorithm 1, lines 2 and 4: ``Lu``, ``Lv`` (Choleskys of Kuu and Cvv only), ``B = Lu^{-1} Kuf``,
    ``D = Lv^{-1} Cvf`` and ``A = Lu^{-1} Kuv``."""
    Lu = cholesky(Kuu)
    A = solve_lower(Lu, Kuv)  # [M, M2]
    Lv = cholesky(Kvv - A.mT @ A)  # chol(Cvv)
    B = solve_lower(Lu, Kuf)  # [M, N]
    D = solve_lower(Lv, Kvf - A.mT @ B)  # Lv^{-1} Cvf  [M2, N]
    return Lu, Lv, A, B, D


def solvegp_marginals(Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_u, L_u, m_v, L_v):
    r"""Marginals of :math:`q(f_n)` (eqs. 32-34; algorithm 1 lines 5-7):

    .. math:: \mu = K_{fu}K_{uu}^{-1}m_u + C_{fv}C_{vv}^{-1}m_v,\quad
              \sigma^2 = k_{nn} + \|L_u^TE\|^2 - \|B\|^2 + \|L_v^TG\|^2 - \|D\|^2

    with :math:`E = L_u^{-T}B`, :math:`G = L_v^{-T}D`."""
    Lu, Lv, _, B, D = _factors(Kuu, Kuv, Kvv, Kuf, Kvf)
    E = solve_lower(Lu, B, transpose=True)
    G = solve_lower(Lv, D, transpose=True)
    mu = (E * m_u.unsqueeze(-1)).sum(-2) + (G * m_v.unsqueeze(-1)).sum(-2)
    var = kff_diag + (L_u.mT @ E).pow(2).sum(-2) - B.pow(2).sum(-2) + (L_v.mT @ G).pow(2).sum(-2) - D.pow(2).sum(-2)
    return mu, var


def solvegp_kl(Kuu, Kuv, Kvv, m_u, L_u, m_v, L_v):
    """KL[q(u) || p(u)] + KL[q(v⊥) || p⊥(v⊥)] (eqs. 35-36)."""
    Lu = cholesky(Kuu)
    A = solve_lower(Lu, Kuv)
    Lv = cholesky(Kvv - A.mT @ A)
    return _kl(m_u, L_u, Lu) + _kl(m_v, L_v, Lv)


def solvegp_bound(y, expected_log_prob, Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_u, L_u, m_v, L_v):
    r"""The SOLVE-GP lower bound, eq. 8, for any likelihood (algorithm 1):

    .. math:: \sum_n \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)] - \mathrm{KL}[q(u)\|p(u)]
              - \mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)]

    ``expected_log_prob(y, f_loc, f_var) -> [N]`` (closed form or Gauss-Hermite)."""
    mu, var = solvegp_marginals(Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_u, L_u, m_v, L_v)
    return expected_log_prob(y, mu, var).sum(-1) - solvegp_kl(Kuu, Kuv, Kvv, m_u, L_u, m_v, L_v)


def _log_normal_lowrank(r, noise_var, B):
    """log N(r; 0, B^T B + s I) for ``B [M, N]`` by the matrix determinant and inversion lemmas."""
    N, M = r.shape[-1], B.shape[-2]
    s = noise_var
    LB = torch.linalg.cholesky(torch.eye(M, dtype=B.dtype, device=B.device) + (B @ B.mT) / s)
    c = solve_lower(LB, (B @ r.unsqueeze(-1))).squeeze(-1) / s
    quad = r.pow(2).sum(-1) / s - c.pow(2).sum(-1)
    logdet = N * math.log(s) + 2 * LB.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * (N * math.log(2 * math.pi) + logdet + quad)


def solvegp_collapsed_bound(y, noise_var, Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_v, L_v):
    r"""The collapsed SOLVE-GP bound for regression, eq. 9 (q(u) optimal given q(v⊥); appendix C):

    .. math:: \log N(y\,|\,C_{fv}C_{vv}^{-1}m_v,\ Q_{ff} + \sigma^2 I) - \frac{1}{2\sigma^2}\mathrm{tr}(S_{f_\perp})
              - \mathrm{KL}[N(m_v, S_v)\|N(0, C_{vv})],

    :math:`S_{f_\perp} = C_{ff} - C_{fv}C_{vv}^{-1}C_{vf} + C_{fv}C_{vv}^{-1}S_vC_{vv}^{-1}C_{vf}`, the covariance of
    :math:`q_\perp(f_\perp)`. With :math:`q(v_\perp) = p_\perp(v_\perp)` it is Titsias' bound (eq. 3)."""
    s = float(noise_var)
    Lu, Lv, _, B, D = _factors(Kuu, Kuv, Kvv, Kuf, Kvf)
    G = solve_lower(Lv, D, transpose=True)  # Cvv^{-1} Cvf
    mean = (G * m_v.unsqueeze(-1)).sum(-2)
    tr_S = (kff_diag - B.pow(2).sum(-2) - D.pow(2).sum(-2) + (L_v.mT @ G).pow(2).sum(-2)).sum(-1)
    return _log_normal_lowrank(y - mean, s, B) - 0.5 * tr_S / s - _kl(m_v, L_v, Lv)


def odvgp_bound(y, noise_var, Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_v):
    r"""The ODVGP special case, eq. 10 (:math:`S_v = C_{vv}`, Salimbeni et al. 2018):

    .. math:: \log N(y\,|\,C_{fv}C_{vv}^{-1}m_v,\ Q_{ff} + \sigma^2 I) - \frac{1}{2\sigma^2}\mathrm{tr}(K_{ff} - Q_{ff})
              - \tfrac12 m_v^T C_{vv}^{-1} m_v."""
    s = float(noise_var)
    Lu, Lv, _, B, D = _factors(Kuu, Kuv, Kvv, Kuf, Kvf)
    G = solve_lower(Lv, D, transpose=True)
    mean = (G * m_v.unsqueeze(-1)).sum(-2)
    a = solve_lower(Lv, m_v.unsqueeze(-1)).squeeze(-1)
    tr = (kff_diag - B.pow(2).sum(-2)).sum(-1)
    return _log_normal_lowrank(y - mean, s, B) - 0.5 * tr / s - 0.5 * a.pow(2).sum(-1)


def tight_collapsed_bound(y, noise_var, Kuu, Kuf, Kff):
    r"""The tighter collapsed bound of appendix A, eq. 14 (q(u) = p(u | f⊥, y), for medium N):

    .. math:: \log N(y\,|\,0, Q_{ff} + \sigma^2 I) - \tfrac12\mathrm{tr}\big[(Q_{ff} + \sigma^2 I)^{-1}(K_{ff} - Q_{ff})\big]

    It needs the full ``Kff [N, N]``; the trace uses the inversion lemma,
    :math:`(Q+\sigma^2I)^{-1} = \sigma^{-2}(I - B^T(\sigma^2 I + BB^T)^{-1}B)`, at cost ``O(N^2 M)``.
    It is at least Titsias' bound (eq. 3), since :math:`(Q+\sigma^2I)^{-1} \preceq \sigma^{-2}I`."""
    s = float(noise_var)
    M = Kuu.shape[-1]
    Lu = cholesky(Kuu)
    B = solve_lower(Lu, Kuf)  # [M, N]
    C = Kff - B.mT @ B  # Kff - Qff
    Lm = torch.linalg.cholesky(s * torch.eye(M, dtype=B.dtype, device=B.device) + B @ B.mT)
    R = solve_lower(Lm, B)  # Lm^{-1} B
    tr = (C.diagonal(dim1=-2, dim2=-1).sum(-1) - (R * (R @ C)).sum((-2, -1))) / s
    return _log_normal_lowrank(y, s, B) - 0.5 * tr


def count_cubic_operations(method: str) -> dict:
    """Cubic-cost operations per bound evaluation, table 4 of the paper (following algorithm 1): a dict from
    operation kind to a list of ``(cost, count)``; ``N`` is the batch size, ``M2`` the orthogonal inducing points."""
    if method == "svgp":
        return {
            "matmul": [("N M^2", 1)],
            "cholesky": [("M^3", 1)],
            "trisolve": [("M^3", 1), ("N M^2", 2)],
        }
    if method == "solvegp":
        return {
            "matmul": [("N M^2", 1), ("N M2^2", 1), ("N M M2", 1), ("M M2^2", 1)],
            "cholesky": [("M^3", 1), ("M2^3", 1)],
            "trisolve": [("M^3", 1), ("M2^3", 1), ("N M^2", 2), ("N M2^2", 2), ("M^2 M2", 1)],
        }
    raise ValueError(f"method must be 'svgp' or 'solvegp', got {method!r}")

