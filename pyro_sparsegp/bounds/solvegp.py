r"""Bounds of SOLVE-GP (Shi, Titsias, Mnih 2020, "Sparse orthogonal variational inference for Gaussian processes",
AISTATS), equation by equation, as pure functions of explicit dense tensors (no Pyro runtime).

Model (section 3.2). With inducing inputs ``Z`` (``M`` of them, ``u = f(Z)``) the prior splits into two independent
processes, :math:`f = K_{fu}K_{uu}^{-1}u + f_\perp` (eqs. 4-5, 21-22); the orthogonal inducing inputs ``O`` (``M2``)
summarise :math:`f_\perp` by :math:`v_\perp = f_\perp(O) = v - K_{vu}K_{uu}^{-1}u`, with :math:`v = f(O)`:

.. math::
    p(u) = N(0, K_{uu}),\qquad p_\perp(v_\perp) = N(0, C_{vv}),\qquad
    p_\perp(f_\perp | v_\perp) = N(C_{fv}C_{vv}^{-1}v_\perp,\ C_{ff} - C_{fv}C_{vv}^{-1}C_{vf}),

:math:`C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}`, :math:`C_{fv} = K_{fv} - K_{fu}K_{uu}^{-1}K_{uv}`,
:math:`C_{ff} = K_{ff} - Q_{ff}`, :math:`Q_{ff} = K_{fu}K_{uu}^{-1}K_{uf}`. The variational family (section 3.3) is
:math:`q(u)\,q(v_\perp)\,p_\perp(f_\perp|v_\perp)` with :math:`q(u) = N(m_u, S_u)`, :math:`q(v_\perp) = N(m_v, S_v)`.

Arguments and shapes (every matrix may carry leading batch dimensions ``[...]``, broadcast as usual; float32 and
float64 both work, the result has the inputs' dtype):

* ``Kuu [..., M, M]``, ``Kuv [..., M, M2]``, ``Kvv [..., M2, M2]``: prior covariances of ``u = f(Z)``, ``v = f(O)``;
* ``Kuf [..., M, N]``, ``Kvf [..., M2, N]``, ``kff_diag [..., N]`` (``Kff [..., N, N]`` for eq. 14 only);
* ``y [..., N]``, ``noise_var``: a float or a tensor ``[...]``;
* variational parameters ``m_u [..., M]``, ``L_u [..., M, M]``, ``m_v [..., M2]``, ``L_v [..., M2, M2]``: means and
  **lower-triangular scale factors** (``S = L L^T``, as algorithm 1 of appendix D parameterises them; only
  ``L L^T`` matters, the log-determinant uses ``|diag L|``).

Whitening (appendix F). With ``whiten=False`` (the paper's default, algorithm 1) the parameters are those of
``q(u) = N(m_u, L_u L_u^T)`` and ``q(v⊥) = N(m_v, L_v L_v^T)`` directly. With ``whiten=True`` they are those of the
whitened variables

.. math:: u' = L_{uu}^{-1}u,\quad v_\perp' = L_{cc}^{-1}v_\perp,\qquad
          q(u') = N(m_u, L_uL_u^T),\quad q(v_\perp') = N(m_v, L_vL_v^T),\quad p(u') = p(v_\perp') = N(0, I),

with :math:`L_{uu} = \mathrm{chol}(K_{uu})`, :math:`L_{cc} = \mathrm{chol}(C_{vv})` (lower Cholesky factors). The
un-whitened parameters are therefore :math:`(L_{uu}m_u,\ L_{uu}L_u,\ L_{cc}m_v,\ L_{cc}L_v)` (still lower-triangular
scale factors; :func:`unwhiten_params`), and every bound takes the same value at corresponding parameters. This is the
convention of :class:`pyro_sparsegp.SOLVEGP`.

``jitter`` (every function): the base relative jitter of every Cholesky factorisation the function performs,
passed to :func:`pyro_sparsegp.linalg.cholesky` (``None``: its default, ``1e-10`` float64 / ``1e-6`` float32, times
the mean diagonal, escalated tenfold with a warning on failure; ``0.0``: factorise the matrices as given).

Cost: only ``Kuu`` and ``Cvv`` are factorised (plus, for the collapsed Gaussian bounds, ``M``- and ``M2``-sized
capacitance matrices), never the ``(M + M2)``-square joint covariance of ``(u, v)``; see
:func:`count_cubic_operations` (table 4).

Equation numbers are those of the arXiv version (v4) of the paper, which the appendix letters also follow.
"""

from __future__ import annotations

import math

import torch

from ..conditionals import clamp_var
from ..linalg import cholesky, solve_lower
from .solvegp_cost import count_cubic_operations, cubic_cost

__all__ = [
    "prior_factors",
    "unwhiten_params",
    "whiten_params",
    "solvegp_marginals",
    "kl_terms",
    "solvegp_elbo",
    "solvegp_collapsed_bound",
    "odvgp_bound",
    "solvegp_optimal_q_v",
    "solvegp_tight_bound",
    "structured_svgp_params",
    "count_cubic_operations",
    "cubic_cost",
]


# -- factorisations (algorithm 1, lines 2 and 4) ------------------------------------------------------------------
def prior_factors(Kuu, Kuv, Kvv, jitter=None):
    r"""Algorithm 1, line 2: ``(Luu, A, Lcc)`` with :math:`L_{uu} = \mathrm{chol}(K_{uu})`,
    :math:`A = L_{uu}^{-1}K_{uv}` and :math:`L_{cc} = \mathrm{chol}(C_{vv})`, :math:`C_{vv} = K_{vv} - A^TA`
    (section 3.2, the covariance of :math:`v_\perp = f_\perp(O)`, eq. 22 at ``O``).

    Two Choleskys, of sizes ``M`` and ``M2`` (with :func:`pyro_sparsegp.linalg.cholesky`'s jitter policy; ``jitter``
    is its base relative jitter).

    :returns: ``Luu [..., M, M]``, ``A [..., M, M2]``, ``Lcc [..., M2, M2]``.
    """
    Luu = cholesky(Kuu, jitter, symmetrize=True)  # [..., M, M]       Cholesky O(M^3)
    A = solve_lower(Luu, Kuv)  # [..., M, M2]         trisolve O(M^2 M2)
    Cvv = Kvv - A.mT @ A  # [..., M2, M2]            matmul O(M M2^2)
    Lcc = cholesky(Cvv, jitter, symmetrize=True)  # [..., M2, M2]     Cholesky O(M2^3)
    return Luu, A, Lcc


def _data_factors(Luu, A, Lcc, Kuf, Kvf):
    """Algorithm 1, line 4: ``B = Luu^{-1} Kuf``, ``D = Lcc^{-1} Cvf`` with ``Cvf = Kvf - A^T B``."""
    B = solve_lower(Luu, Kuf)  # [..., M, N]          trisolve O(N M^2)
    Cvf = Kvf - A.mT @ B  # [..., M2, N]             matmul O(N M M2)
    D = solve_lower(Lcc, Cvf)  # [..., M2, N]         trisolve O(N M2^2)
    return B, D


def _matvec(M, v):
    return (M @ v.unsqueeze(-1)).squeeze(-1)


def unwhiten_params(Kuu, Kuv, Kvv, m_u, L_u, m_v, L_v, jitter=None):
    r"""Appendix F: map whitened parameters to un-whitened ones,
    :math:`(m_u, L_u, m_v, L_v) \mapsto (L_{uu}m_u,\ L_{uu}L_u,\ L_{cc}m_v,\ L_{cc}L_v)`.

    ``m_u [..., M]``, ``L_u [..., M, M]``, ``m_v [..., M2]``, ``L_v [..., M2, M2]`` -> the same shapes."""
    Luu, _, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    return _matvec(Luu, m_u), Luu @ L_u, _matvec(Lcc, m_v), Lcc @ L_v


def whiten_params(Kuu, Kuv, Kvv, m_u, L_u, m_v, L_v, jitter=None):
    r"""Appendix F, the inverse of :func:`unwhiten_params`:
    :math:`(m_u, L_u, m_v, L_v) \mapsto (L_{uu}^{-1}m_u,\ L_{uu}^{-1}L_u,\ L_{cc}^{-1}m_v,\ L_{cc}^{-1}L_v)`.

    ``m_u [..., M]``, ``L_u [..., M, M]``, ``m_v [..., M2]``, ``L_v [..., M2, M2]`` -> the same shapes."""
    Luu, _, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    return (
        solve_lower(Luu, m_u.unsqueeze(-1)).squeeze(-1),
        solve_lower(Luu, L_u),
        solve_lower(Lcc, m_v.unsqueeze(-1)).squeeze(-1),
        solve_lower(Lcc, L_v),
    )


# -- q(f) marginals (eqs. 32-34 = diagonal of eqs. 37-38; algorithm 1, lines 5-7) ----------------------------------
def _marginals(Luu, Lcc, B, D, kff_diag, m_u, L_u, m_v, L_v, whiten):
    if whiten:
        E, G = B, D  # the whitened variables enter through Luu^{-1} Kuf and Lcc^{-1} Cvf directly
    else:
        E = solve_lower(Luu, B, transpose=True)  # [..., M, N]   Kuu^{-1} Kuf       trisolve O(N M^2)
        G = solve_lower(Lcc, D, transpose=True)  # [..., M2, N]  Cvv^{-1} Cvf       trisolve O(N M2^2)
    F = L_u.mT @ E  # [..., M, N]                                               matmul O(N M^2)
    H = L_v.mT @ G  # [..., M2, N]                                              matmul O(N M2^2)
    f_loc = (E * m_u.unsqueeze(-1)).sum(-2) + (G * m_v.unsqueeze(-1)).sum(-2)  # [..., N]
    f_var = kff_diag + F.pow(2).sum(-2) - B.pow(2).sum(-2) + H.pow(2).sum(-2) - D.pow(2).sum(-2)  # [..., N]
    return f_loc, clamp_var(f_var)


def solvegp_marginals(Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_u, L_u, m_v, L_v, whiten=False, jitter=None):
    r"""Marginals of :math:`q(f_n) = N(\mu_n, \sigma_n^2)`, eqs. 32-34 of appendix D.1 (the diagonal of the
    predictive eqs. 37-38 of D.2), computed as in algorithm 1, lines 1-7:

    .. math::
        \mu_n &= k_{nu}K_{uu}^{-1}m_u + c_{nv}C_{vv}^{-1}m_v, \\
        \sigma_n^2 &= k_{nu}K_{uu}^{-1}S_uK_{uu}^{-1}k_{un} + c_{nn}
                     + c_{nv}C_{vv}^{-1}(S_v - C_{vv})C_{vv}^{-1}c_{vn},

    :math:`c_{nn} = k_{nn} - k_{nu}K_{uu}^{-1}k_{un}`, :math:`c_{nv}` a row of :math:`C_{fv}`; i.e.
    ``sigma^2 = kff + |L_u^T E|^2 - |B|^2 + |L_v^T G|^2 - |D|^2`` with ``B = Luu^{-1} Kuf``, ``D = Lcc^{-1} Cvf``,
    ``E = Luu^{-T} B``, ``G = Lcc^{-T} D`` (whitened: ``E = B``, ``G = D``). Only ``Kuu`` and ``Cvv`` are factorised.
    Variances are clamped at ``tiny ** 0.5`` against round-off (as :class:`pyro_sparsegp.SOLVEGP` does).

    :returns: ``(f_loc [..., N], f_var [..., N])``.
    """
    Luu, A, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    B, D = _data_factors(Luu, A, Lcc, Kuf, Kvf)
    return _marginals(Luu, Lcc, B, D, kff_diag, m_u, L_u, m_v, L_v, whiten)


# -- KL terms (eqs. 35-36; algorithm 1, lines 9-13) ----------------------------------------------------------------
def _gauss_kl(m, L, Lp):
    r""":math:`\mathrm{KL}[N(m, LL^T)\,\|\,N(0, L_pL_p^T)]` (``Lp=None``: ``N(0, I)``); algorithm 1, ``Compute KL``.

    ``m [..., K]``, ``L [..., K, K]`` -> ``[...]``; one trisolve against ``Lp`` for ``[L, m]`` together."""
    K = m.shape[-1]
    logdet_q = L.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)  # [...]  log|L|
    if Lp is None:
        return 0.5 * (L.pow(2).sum((-2, -1)) + m.pow(2).sum(-1) - K) - logdet_q
    batch = torch.broadcast_shapes(L.shape[:-2], m.shape[:-1], Lp.shape[:-2])
    Lm = torch.cat([L.expand(batch + L.shape[-2:]), m.expand(batch + m.shape[-1:]).unsqueeze(-1)], -1)  # [..., K, K+1]
    P = solve_lower(Lp, Lm)  # [..., K, K+1]   [Lp^{-1} L, Lp^{-1} m]    trisolve O(K^3)
    logdet_p = Lp.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return logdet_p - logdet_q + 0.5 * (P.pow(2).sum((-2, -1)) - K)


def _kl_terms(Luu, Lcc, m_u, L_u, m_v, L_v, whiten):
    if whiten:
        return _gauss_kl(m_u, L_u, None) + _gauss_kl(m_v, L_v, None)
    return _gauss_kl(m_u, L_u, Luu) + _gauss_kl(m_v, L_v, Lcc)


def kl_terms(Kuu, Kuv, Kvv, m_u, L_u, m_v, L_v, whiten=False, jitter=None):
    r""":math:`\mathrm{KL}[q(u)\|p(u)] + \mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)]`, eqs. 35 and 36 (appendix D.1):

    .. math:: \tfrac12\big[\log|K_{uu}| - \log|S_u| - M + \mathrm{tr}(K_{uu}^{-1}S_u) + m_u^TK_{uu}^{-1}m_u\big]
              + \tfrac12\big[\log|C_{vv}| - \log|S_v| - M_2 + \mathrm{tr}(C_{vv}^{-1}S_v) + m_v^TC_{vv}^{-1}m_v\big]

    (whitened: both priors are ``N(0, I)``; the value is the same at corresponding parameters). This sum equals
    :math:`\mathrm{KL}[q(u, v)\|p(u, v)]` over the joint ``(u, v)`` of section 3.3, since
    :math:`(u, v_\perp) \mapsto (u, v)` is linear with unit Jacobian and maps :math:`p(u)p_\perp(v_\perp)` to
    ``p(u, v)``.

    :returns: ``[...]``.
    """
    Luu, _, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    return _kl_terms(Luu, Lcc, m_u, L_u, m_v, L_v, whiten)


# -- eq. 8 ----------------------------------------------------------------------------------------------------------
def solvegp_elbo(
    y,
    expected_log_prob,
    Kuu,
    Kuv,
    Kvv,
    Kuf,
    Kvf,
    kff_diag,
    m_u,
    L_u,
    m_v,
    L_v,
    whiten=False,
    num_data=None,
    jitter=None,
):
    r"""The SOLVE-GP lower bound, eq. 8 (written as eq. 31 of appendix D.1), for any factorising likelihood:

    .. math:: \sum_{n=1}^N \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)] - \mathrm{KL}[q(u)\|p(u)]
              - \mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)]

    with :math:`q(f_n)` of eqs. 32-34 (:func:`solvegp_marginals`), computed as algorithm 1 (two Choleskys, of
    ``Kuu`` and ``Cvv``, shared by the data term and the KLs).

    :param expected_log_prob: ``(y, f_loc, f_var) -> [..., N]``, :math:`\mathbb{E}_{N(f; \mu, \sigma^2)}\log p(y|f)`
        (closed form, e.g. ``pyro_sparsegp.Gaussian(noise).expected_log_prob``, or Gauss-Hermite).
    :param num_data: if given, ``y`` is a minibatch of a data set of this size and the data term is scaled by
        ``num_data / N`` (the unbiased estimate of appendix D.1).
    :returns: ``[...]``.
    """
    Luu, A, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    B, D = _data_factors(Luu, A, Lcc, Kuf, Kvf)
    f_loc, f_var = _marginals(Luu, Lcc, B, D, kff_diag, m_u, L_u, m_v, L_v, whiten)
    lld = expected_log_prob(y, f_loc, f_var).sum(-1)  # [...]
    if num_data is not None:
        lld = lld * (num_data / y.shape[-1])
    return lld - _kl_terms(Luu, Lcc, m_u, L_u, m_v, L_v, whiten)


# -- collapsed Gaussian-likelihood bounds ---------------------------------------------------------------------------
def _noise(noise_var, like):
    return torch.as_tensor(noise_var, dtype=like.dtype, device=like.device)


def _log_normal_lowrank(r, s, B, jitter=None):
    r""":math:`\log N(r; 0, B^TB + sI)` for ``r [..., N]``, ``s [...]``, ``B [..., M, N]``, by the matrix inversion
    and determinant lemmas: one Cholesky of the ``M``-sized capacitance :math:`I + BB^T/s`."""
    N, M = r.shape[-1], B.shape[-2]
    s1, s2 = s[..., None], s[..., None, None]
    eye = torch.eye(M, dtype=B.dtype, device=B.device)
    LB = cholesky(eye + (B @ B.mT) / s2, jitter, symmetrize=True)  # [..., M, M]
    c = solve_lower(LB, _matvec(B, r).unsqueeze(-1)).squeeze(-1) / s1  # [..., M]   LB^{-1} B r / s
    quad = r.pow(2).sum(-1) / s - c.pow(2).sum(-1)  # r^T (B^T B + s I)^{-1} r
    logdet = N * s.log() + 2 * LB.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * (N * math.log(2 * math.pi) + logdet + quad)


def solvegp_collapsed_bound(y, noise_var, Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_v, L_v, whiten=False, jitter=None):
    r"""The collapsed SOLVE-GP bound for regression, eq. 9 (derived in appendix C as eq. 27): eq. 8 with the
    Gaussian likelihood :math:`N(y|f, \sigma^2 I)` maximised in closed form over ``q(u)`` for the given
    ``q(v⊥) = N(m_v, L_vL_v^T)``:

    .. math:: \log N(y\,|\,C_{fv}C_{vv}^{-1}m_v,\ Q_{ff} + \sigma^2 I) - \frac{1}{2\sigma^2}\mathrm{tr}(S_{f_\perp})
              - \mathrm{KL}[N(m_v, S_v)\,\|\,N(0, C_{vv})],

    :math:`S_{f_\perp} = C_{ff} + C_{fv}C_{vv}^{-1}(S_v - C_{vv})C_{vv}^{-1}C_{vf}` (the covariance of
    :math:`q_\perp(f_\perp)`, whose diagonal alone is needed). With :math:`m_v = 0, S_v = C_{vv}` it is Titsias'
    bound, eq. 3. Cost ``O(N (M + M2)^2 + M^3 + M2^3)``.

    :returns: ``[...]``.
    """
    s = _noise(noise_var, Kuf)
    Luu, A, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    B, D = _data_factors(Luu, A, Lcc, Kuf, Kvf)
    G = D if whiten else solve_lower(Lcc, D, transpose=True)  # [..., M2, N]  Cvv^{-1} Cvf (un-whitened)
    mean = (G * m_v.unsqueeze(-1)).sum(-2)  # [..., N]   C_fv C_vv^{-1} m_v
    tr_S = (kff_diag - B.pow(2).sum(-2) - D.pow(2).sum(-2) + (L_v.mT @ G).pow(2).sum(-2)).sum(-1)  # [...]
    kl_v = _gauss_kl(m_v, L_v, None if whiten else Lcc)
    return _log_normal_lowrank(y - mean, s, B, jitter) - 0.5 * tr_S / s - kl_v


def odvgp_bound(y, noise_var, Kuu, Kuv, Kvv, Kuf, Kvf, kff_diag, m_v, whiten=False, jitter=None):
    r"""The ODVGP special case of eq. 9, eq. 10 (``S_v = C_vv``, the orthogonally decoupled bound of Salimbeni et al.
    2018 with :math:`\beta = Z`, :math:`\gamma = O`; section 5):

    .. math:: \log N(y\,|\,C_{fv}C_{vv}^{-1}m_v,\ Q_{ff} + \sigma^2 I) - \frac{1}{2\sigma^2}\mathrm{tr}(K_{ff} - Q_{ff})
              - \tfrac12 m_v^TC_{vv}^{-1}m_v.

    Whitened, ``m_v`` is the mean of :math:`q(v_\perp') = N(m_v, I)` (so :math:`S_v = C_{vv}` again) and the last
    term is :math:`\tfrac12 m_v^Tm_v`.

    :returns: ``[...]``.
    """
    s = _noise(noise_var, Kuf)
    Luu, A, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    B, D = _data_factors(Luu, A, Lcc, Kuf, Kvf)
    if whiten:
        mean, a = (D * m_v.unsqueeze(-1)).sum(-2), m_v
    else:
        G = solve_lower(Lcc, D, transpose=True)  # [..., M2, N]
        mean, a = (G * m_v.unsqueeze(-1)).sum(-2), solve_lower(Lcc, m_v.unsqueeze(-1)).squeeze(-1)
    tr = (kff_diag - B.pow(2).sum(-2)).sum(-1)  # tr(Kff - Qff)
    return _log_normal_lowrank(y - mean, s, B, jitter) - 0.5 * tr / s - 0.5 * a.pow(2).sum(-1)


def solvegp_optimal_q_v(y, noise_var, Kuu, Kuv, Kvv, Kuf, Kvf, whiten=False, jitter=None):
    r"""The maximiser of eq. 9 over ``q(v⊥)``, eqs. 28-29 (appendix C):

    .. math:: m_v^* = C_{vv}[C_{vv} + C_{vf}A^{-1}C_{fv}]^{-1}C_{vf}A^{-1}y,\qquad
              S_v^* = C_{vv}[C_{vv} + \sigma^{-2}C_{vf}C_{fv}]^{-1}C_{vv},\qquad A = Q_{ff} + \sigma^2 I,

    computed in whitened coordinates, :math:`S_v'^* = (I + DD^T/\sigma^2)^{-1}`,
    :math:`m_v'^* = (I + DA^{-1}D^T)^{-1}DA^{-1}y` with ``D = Lcc^{-1} Cvf``, and :math:`A^{-1}` by the inversion
    lemma (cost ``O(N (M + M2)^2 + M^3 + M2^3)``). Eq. 9 at this ``q(v⊥)`` is eq. 30.

    :returns: ``(m_v [..., M2], L_v [..., M2, M2])`` in the requested parameterisation (``L_v`` lower-triangular).
    """
    s = _noise(noise_var, Kuf)
    Luu, A, Lcc = prior_factors(Kuu, Kuv, Kvv, jitter)
    B, D = _data_factors(Luu, A, Lcc, Kuf, Kvf)
    N, M, M2 = B.shape[-1], B.shape[-2], D.shape[-2]
    eye_m = torch.eye(M, dtype=B.dtype, device=B.device)
    eye_m2 = torch.eye(M2, dtype=B.dtype, device=B.device)
    # A^{-1} X = (X - R^T R X) / s with R = chol(s I + B B^T)^{-1} B, for X = [D^T, y]
    batch = torch.broadcast_shapes(B.shape[:-2], D.shape[:-2], y.shape[:-1], s.shape)
    X = torch.cat([D.mT.expand(batch + (N, M2)), y.expand(batch + (N,)).unsqueeze(-1)], -1)  # [..., N, M2 + 1]
    Lm = cholesky(s[..., None, None] * eye_m + B @ B.mT, jitter, symmetrize=True)  # [..., M, M]
    R = solve_lower(Lm, B)  # [..., M, N]
    AinvX = (X - R.mT @ (R @ X)) / s[..., None, None]  # [..., N, M2 + 1]
    DAX = D @ AinvX  # [..., M2, M2 + 1]   [D A^{-1} D^T, D A^{-1} y]
    Lp = cholesky(eye_m2 + DAX[..., :M2], jitter, symmetrize=True)  # [..., M2, M2]
    m_w = torch.cholesky_solve(DAX[..., M2:], Lp).squeeze(-1)  # [..., M2]
    Ls = cholesky(eye_m2 + D @ D.mT / s[..., None, None], jitter, symmetrize=True)  # [..., M2, M2] prec. of q*(v⊥')
    S_w = torch.cholesky_inverse(Ls)
    L_w = cholesky(S_w, jitter, symmetrize=True)  # [..., M2, M2]
    if whiten:
        return m_w, L_w
    return _matvec(Lcc, m_w), Lcc @ L_w


def solvegp_tight_bound(y, noise_var, Kuu, Kuf, Kff, jitter=None):
    r"""The tighter collapsed bound of appendix A, eq. 14 (``q(u) = p(u | f⊥, y)`` exactly, ``f⊥ ~ p⊥``; eqs. 12-13):

    .. math:: \log N(y\,|\,0, Q_{ff} + \sigma^2 I)
              - \tfrac12\mathrm{tr}\big[(Q_{ff} + \sigma^2 I)^{-1}(K_{ff} - Q_{ff})\big].

    By eq. 15 it is Titsias' bound (eq. 3) plus
    :math:`\frac{1}{2\sigma^4}\mathrm{tr}[K_{fu}(K_{uu} + \sigma^{-2}K_{uf}K_{fu})^{-1}K_{uf}(K_{ff} - Q_{ff})] \ge 0`,
    and it is at most :math:`\log N(y|0, K_{ff} + \sigma^2 I)`. It needs the full ``Kff [..., N, N]``: ``O(N^2 M)``
    time and ``O(N^2)`` memory (medium ``N`` only). The trace uses
    :math:`(Q_{ff} + \sigma^2 I)^{-1} = \sigma^{-2}(I - B^T(\sigma^2 I + BB^T)^{-1}B)`, ``B = Luu^{-1} Kuf``.

    :returns: ``[...]``.
    """
    s = _noise(noise_var, Kuf)
    M = Kuu.shape[-1]
    Luu = cholesky(Kuu, jitter, symmetrize=True)
    B = solve_lower(Luu, Kuf)  # [..., M, N]
    C = Kff - B.mT @ B  # [..., N, N]   Kff - Qff
    eye_m = torch.eye(M, dtype=B.dtype, device=B.device)
    Lm = cholesky(s[..., None, None] * eye_m + B @ B.mT, jitter, symmetrize=True)  # [..., M, M]
    R = solve_lower(Lm, B)  # [..., M, N]
    tr = (C.diagonal(dim1=-2, dim2=-1).sum(-1) - (R * (R @ C)).sum((-2, -1))) / s
    return _log_normal_lowrank(y, s, B, jitter) - 0.5 * tr


# -- section 3.3: the structured-covariance view -------------------------------------------------------------------
def structured_svgp_params(Kuu, Kuv, m_u, L_u, m_v, L_v, return_scale_tril=False, jitter=None):
    r"""Section 3.3 ("Structured Covariance"): the Gaussian :math:`q(u, v) = N(m_{u,v}, S_{u,v})` over the union
    ``{Z, O}`` induced by :math:`q(u)q(v_\perp)` through :math:`v = v_\perp + K_{vu}K_{uu}^{-1}u`, written block by
    block as the paper prints it:

    .. math:: m_{u,v} = \begin{bmatrix} m_u \\ m_v + K_{vu}K_{uu}^{-1}m_u \end{bmatrix},\qquad
              S_{u,v} = \begin{bmatrix} S_u & S_uK_{uu}^{-1}K_{uv} \\
                        K_{vu}K_{uu}^{-1}S_u & S_v + K_{vu}K_{uu}^{-1}S_uK_{uu}^{-1}K_{uv}\end{bmatrix}.

    SVGP over ``{Z, O}`` with this ``q(u, v)`` has the same ``q(f)`` and the same KL as SOLVE-GP (so the same eq. 8).
    ODVGP's :math:`S'_{u,v}` (section 5) is the case :math:`S_v = C_{vv}`. Parameters are un-whitened (see
    :func:`unwhiten_params`). The oracle of :func:`pyro_sparsegp.variational.structured.structured_svgp_params`.
    ``return_scale_tril``: the factor :math:`[[L_u, 0], [K_{vu}K_{uu}^{-1}L_u, L_v]]` of :math:`S_{u,v}` instead.
    :returns: ``(m_uv [..., M + M2], S_uv or L_uv [..., M + M2, M + M2])``.
    """
    Luu = cholesky(Kuu, jitter, symmetrize=True)
    P = solve_lower(Luu, solve_lower(Luu, Kuv), transpose=True).mT  # [..., M2, M]   Kvu Kuu^{-1}
    mv = m_v + (P @ m_u.unsqueeze(-1)).squeeze(-1)  # [..., M2]
    mb = torch.broadcast_shapes(m_u.shape[:-1], mv.shape[:-1])
    m_uv = torch.cat([m_u.expand(mb + m_u.shape[-1:]), mv.expand(mb + mv.shape[-1:])], -1)  # [..., M + M2]
    if return_scale_tril:
        blocks = [[L_u, torch.zeros(L_u.shape[:-1] + L_v.shape[-1:], dtype=L_u.dtype, device=L_u.device)],
                  [P @ L_u, L_v]]
    else:
        S_u, S_v = L_u @ L_u.mT, L_v @ L_v.mT  # [..., M, M], [..., M2, M2]
        blocks = [[S_u, S_u @ P.mT], [P @ S_u, S_v + P @ S_u @ P.mT]]
    batch = torch.broadcast_shapes(*(b.shape[:-2] for row in blocks for b in row))
    rows = [torch.cat([b.expand(batch + b.shape[-2:]) for b in row], -1) for row in blocks]
    return m_uv, torch.cat(rows, -2)  # [..., M + M2, M + M2]
