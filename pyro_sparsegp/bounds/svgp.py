r"""Closed-form bounds of Hensman, Fusi, Lawrence (2013) and Hensman, Matthews, Ghahramani (2015), equation by
equation, on explicit dense matrices. They are oracles for the sample-site path and for tests; they are written for
clarity (``O(M^3 + N M^2)``), with leading batch dimensions allowed on every argument.

Notation: ``Kuu [M, M]``, ``Kuf [M, N]``, ``kff_diag [N]``, ``q(u) = N(m, S)`` with ``S = L L^T``, noise variance
:math:`\sigma^2 = \beta^{-1}`.
"""

from __future__ import annotations

import math

import torch

from ..linalg import cholesky, solve_lower

__all__ = [
    "gauss_kl",
    "titsias_bound",
    "l3_bound",
    "kl_sparse_bound",
    "optimal_qu",
    "exact_log_marginal",
    "qf_dense",
]


def gauss_kl(m: torch.Tensor, L: torch.Tensor, Kuu: torch.Tensor | None = None) -> torch.Tensor:
    r""":math:`\mathrm{KL}[N(m, LL^T) \| N(0, K_{uu})]` (``Kuu=None``: :math:`N(0, I)`, the whitened prior).

    .. math:: \tfrac12\big[\mathrm{tr}(K^{-1}S) + m^T K^{-1} m - M + \log|K| - \log|S|\big]

    (the KL term of Hensman 2013 eq. 4 and Hensman 2015 eq. 21). ``m [..., M]``, ``L [..., M, M]`` -> ``[...]``.
    """
    M = m.shape[-1]
    logdet_S = 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    if Kuu is None:
        return 0.5 * (L.pow(2).sum((-2, -1)) + m.pow(2).sum(-1) - M - logdet_S)
    Lk = cholesky(Kuu, symmetrize=True)
    A = solve_lower(Lk, L)  # Lk^{-1} L
    a = solve_lower(Lk, m.unsqueeze(-1)).squeeze(-1)
    logdet_K = 2 * Lk.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return 0.5 * (A.pow(2).sum((-2, -1)) + a.pow(2).sum(-1) - M + logdet_K - logdet_S)


def _log_normal(y, loc, var):
    return -0.5 * (math.log(2 * math.pi) + var.log() + (y - loc).pow(2) / var)


def exact_log_marginal(y: torch.Tensor, noise_var, Kff: torch.Tensor) -> torch.Tensor:
    r""":math:`\log N(y; 0, K_{ff} + \sigma^2 I)` computed densely (``O(N^3)``): the exact GP log marginal
    likelihood, which the bounds reach when ``Z = X`` (the limit of Hensman 2013, section 2, and of Titsias 2009).
    ``y [..., N]``, ``Kff [..., N, N]``, ``noise_var`` a scalar or ``[...]`` -> ``[...]``."""
    N = y.shape[-1]
    s = torch.as_tensor(noise_var, dtype=Kff.dtype, device=Kff.device)  # a scalar or [...]
    C = Kff + s[..., None, None] * torch.eye(N, dtype=Kff.dtype, device=Kff.device)
    Lc = torch.linalg.cholesky(C)
    a = solve_lower(Lc, y.unsqueeze(-1)).squeeze(-1)
    return -0.5 * (N * math.log(2 * math.pi) + a.pow(2).sum(-1)) - Lc.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def titsias_bound(y, noise_var, Kuu, Kuf, kff_diag) -> torch.Tensor:
    r"""Collapsed bound :math:`\mathcal{L}_2` (Hensman 2013, section 2; Hensman 2015 eq. 6; Titsias 2009):

    .. math:: \log N(y; 0, Q_{ff} + \sigma^2 I) - \frac{1}{2\sigma^2}\mathrm{tr}(K_{ff} - Q_{ff}),
              \quad Q_{ff} = K_{fu} K_{uu}^{-1} K_{uf}

    evaluated with the matrix determinant lemma at cost ``O(N M^2)``. ``y [..., N]``, ``Kuu [..., M, M]``,
    ``Kuf [..., M, N]``, ``kff_diag [..., N]``, ``noise_var`` a scalar or ``[...]`` -> ``[...]``.
    """
    N = y.shape[-1]
    M = Kuu.shape[-1]
    Luu = cholesky(Kuu, symmetrize=True)
    W = solve_lower(Luu, Kuf)  # [M, N]
    s = noise_var if torch.is_tensor(noise_var) else torch.tensor(noise_var, dtype=Kuu.dtype)
    Bm = torch.eye(M, dtype=Kuu.dtype, device=Kuu.device) + (W @ W.mT) / s[..., None, None]
    LB = torch.linalg.cholesky(Bm)
    c = solve_lower(LB, (W @ y.unsqueeze(-1))).squeeze(-1) / s[..., None]  # LB^{-1} W y / s
    quad = y.pow(2).sum(-1) / s - c.pow(2).sum(-1)  # y^T (Qff + s I)^{-1} y
    logdet = N * s.log() + 2 * LB.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    trace = (kff_diag - W.pow(2).sum(-2)).sum(-1)
    return -0.5 * (N * math.log(2 * math.pi) + logdet + quad) - 0.5 * trace / s


def qf_dense(Kuu, Kuf, kff_diag, m, L) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Marginals of q(f) (Hensman 2015 eq. 19, diagonal) by explicit inverses: :math:`a_n = K_{uu}^{-1}k_{un}`,
    :math:`\mu_n = a_n^T m`, :math:`\sigma^2_n = k_{nn} - a_n^T (K_{uu} - S) a_n`. ``Kuu [..., M, M]``,
    ``Kuf [..., M, N]``, ``kff_diag [..., N]``, ``m [..., M]``, ``L [..., M, M]`` -> ``(mu, var)`` each ``[..., N]``."""
    A = torch.linalg.solve(Kuu, Kuf)  # [M, N]
    S = L @ L.mT
    mu = (A * m.unsqueeze(-1)).sum(-2)
    var = kff_diag - (A * ((Kuu - S) @ A)).sum(-2)
    return mu, var


def l3_bound(y, noise_var, Kuu, Kuf, kff_diag, m, L) -> torch.Tensor:
    r"""Uncollapsed bound :math:`\mathcal{L}_3` (Hensman 2013 eq. 4; Hensman 2015 eq. 7):

    .. math:: \sum_n \Big[\log N(y_n; k_n^T K_{uu}^{-1} m, \beta^{-1}) - \tfrac{\beta}{2}\tilde k_{nn}
              - \tfrac{\beta}{2}\mathrm{tr}(S\Lambda_n)\Big] - \mathrm{KL}[q(u)\|p(u)]

    with :math:`\Lambda_n = K_{uu}^{-1}k_n k_n^T K_{uu}^{-1}` and :math:`\tilde k_{nn} = k_{nn} - k_n^T K_{uu}^{-1}k_n`.
    ``y [..., N]``, ``Kuu [..., M, M]``, ``Kuf [..., M, N]``, ``kff_diag [..., N]``, ``m [..., M]``,
    ``L [..., M, M]`` (``q(u) = N(m, LL^T)``) -> ``[...]``.
    """
    s = noise_var if torch.is_tensor(noise_var) else torch.tensor(noise_var, dtype=Kuu.dtype)
    A = torch.linalg.solve(Kuu, Kuf)  # [M, N], columns K^{-1} k_n
    S = L @ L.mT
    mu = (A * m.unsqueeze(-1)).sum(-2)
    ktilde = kff_diag - (Kuf * A).sum(-2)
    trSLam = (A * (S @ A)).sum(-2)
    per_point = _log_normal(y, mu, s[..., None]) - 0.5 * ktilde / s[..., None] - 0.5 * trSLam / s[..., None]
    return per_point.sum(-1) - gauss_kl(m, L, Kuu)


def kl_sparse_bound(y, expected_log_prob, Kuu, Kuf, kff_diag, m, L, whiten: bool = False) -> torch.Tensor:
    r"""The KL-sparse bound (Hensman 2015 eq. 21), for any likelihood:

    .. math:: \sum_n \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)] - \mathrm{KL}[q(u)\|p(u)]

    with :math:`q(f_n)` of eq. 19. ``expected_log_prob(y, f_loc, f_var) -> [..., N]`` (analytic or Gauss-Hermite).
    Shapes as in :func:`l3_bound`; returns ``[...]``.
    With ``whiten=True``, ``(m, L)`` parameterise q(v) for ``u = Luu v`` and the prior is ``N(0, I)``.
    """
    if whiten:
        Luu = cholesky(Kuu, symmetrize=True)
        m_u = (Luu @ m.unsqueeze(-1)).squeeze(-1)
        L_u = Luu @ L
        mu, var = qf_dense(Kuu, Kuf, kff_diag, m_u, L_u)
        kl = gauss_kl(m, L, None)
    else:
        mu, var = qf_dense(Kuu, Kuf, kff_diag, m, L)
        kl = gauss_kl(m, L, Kuu)
    return expected_log_prob(y, mu, var).sum(-1) - kl


def optimal_qu(y, noise_var, Kuu, Kuf) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The optimal Gaussian q(u) for a Gaussian likelihood (Hensman 2013, section 2):

    .. math:: \Lambda = \beta K_{uu}^{-1}K_{uf}K_{fu}K_{uu}^{-1} + K_{uu}^{-1},\quad S = \Lambda^{-1},
              \quad m = \beta \Lambda^{-1} K_{uu}^{-1} K_{uf} y

    computed densely. ``y [..., N]``, ``Kuu [..., M, M]``, ``Kuf [..., M, N]``; returns ``(m [..., M],
    chol(S) [..., M, M])``.
    """
    s = noise_var if torch.is_tensor(noise_var) else torch.tensor(noise_var, dtype=Kuu.dtype)
    Kinv = torch.linalg.inv(Kuu)
    Lam = Kinv @ Kuf @ Kuf.mT @ Kinv / s[..., None, None] + Kinv
    S = torch.linalg.inv(Lam)
    S = 0.5 * (S + S.mT)
    m = (S @ Kinv @ Kuf @ y.unsqueeze(-1)).squeeze(-1) / s[..., None]
    return m, torch.linalg.cholesky(S)
