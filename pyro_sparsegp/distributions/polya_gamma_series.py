r"""The series and the exact sampler behind :class:`~pyro_sparsegp.distributions.PolyaGamma` (Polson, Scott and
Windle 2013): the density of :math:`\mathrm{PG}(b, 0)` by two exact series, and Devroye's sampler of
:math:`J^*(1, z) = 4\,\mathrm{PG}(1, 2z)`.

**Sampling** (:meth:`PolyaGamma.sample`) is exact: Devroye's alternating-series rejection sampler for
:math:`J^*(1, z) = 4\,\mathrm{PG}(1, 2z)` as set out by Polson, Scott and Windle (2013, section 4 and their
algorithm 1, truncation point :math:`t = 0.64`), run vectorised (every pending draw proposes and is tested at
once; only the rejected ones propose again), and :math:`\mathrm{PG}(b, c)` for integer ``b`` as the sum of ``b``
independent :math:`\mathrm{PG}(1, c)` draws.

**Density** (:meth:`PolyaGamma.log_prob`), computed in float64 in log space. Two exact series for
:math:`p(x | b, 0)` are available:

* the *left* series (Polson, Scott and Windle 2013, section 2), valid for every real :math:`b > 0`,

  .. math:: p(x | b, 0) = \frac{2^{b-1}}{\Gamma(b)} \sum_{n \ge 0} (-1)^n \frac{\Gamma(n+b)}{\Gamma(n+1)}
      \frac{2n+b}{\sqrt{2\pi x^3}} e^{-(2n+b)^2/(8x)} =: \sum_{n \ge 0} (-1)^n T_n(x);

  the ratio :math:`\rho_n = T_{n+1}/T_n = \frac{(n+b)(2n+b+2)}{(n+1)(2n+b)} e^{-(2n+b+1)/(2x)}` is
  nonincreasing in ``n`` for every ``b > 0``, so as soon as :math:`\rho_N \le 1`, i.e.
  :math:`x \le (2N+b+1) / \big(2\log\frac{(N+b)(2N+b+2)}{(N+1)(2N+b)}\big)` (for ``N = 200``:
  :math:`x \le 4.0\cdot10^4` at ``b = 1``, :math:`8.2\cdot10^3` at ``b = 5``), the terms decrease from ``N`` on and
  **stopping after the terms** :math:`n < N` **errs by at most the first omitted term** :math:`T_N(x)` (alternating
  series with decreasing terms), which is below :math:`e^{-(2N+b)^2/(8x)}` times a polynomial in ``N`` -- e.g.
  :math:`e^{-2000}` relative for ``N = 200``, ``x <= 10``. The code checks :math:`\rho_N \le 1` for the ``N`` it
  uses and adds :math:`T_N` to its error estimate. The series converges fast for small ``x`` (the ``n = 0`` term
  dominates; it is the density to a relative :math:`(b+2)e^{-(b+1)/(2x)}`) but for large ``x`` the alternating sum
  cancels: its rounding error is about :math:`\epsilon \sum_n T_n / p`, e.g. ``1e-8`` relative at ``x = 4.25`` for
  ``b = 1``, and it is useless beyond ``x ~ 8``.

* the *right* series, for integer ``b``: the residues of :math:`e^{sx}\cosh^{-b}(\sqrt{s/2})` at its poles
  :math:`s_k = -2\beta_k^2`, :math:`\beta_k = \pi(k + 1/2)`, give

  .. math:: p(x | b, 0) = \sum_{k \ge 0} (-1)^{kb}\, 4 e^{-2\beta_k^2 x}\, [\eta^{b-1}]
      \Big\{(\beta_k - \eta)\, e^{4x\beta_k\eta - 2x\eta^2} \big(\tfrac{\eta}{\sin\eta}\big)^b\Big\}

  (for ``b = 1``: :math:`\sum_k (-1)^k 2\pi(2k+1) e^{-(2k+1)^2\pi^2 x/2}`); by Cauchy's estimate on
  :math:`|\eta| = 1` the ``k``-th term is at most :math:`4(\beta_k + 1)(\sin 1)^{-b} e^{-2x(\beta_k^2 - 2\beta_k - 1)}`,
  which bounds the truncation error (times 2 once consecutive bounds shrink by half). It is well conditioned for
  large ``x`` and cancels for small ``x``.

The left series is summed for every ``x`` with at most ``num_terms`` terms (terms that cannot reach the float64 sum
are skipped); where it cancels and ``b`` is an integer (``b <= 256``) the right series is summed too, and the one
with the smaller error estimate -- rounding, :math:`\epsilon \sum_t |t|(1 + |\log|t||) / |\text{sum}|`, plus the
truncation bound above -- is returned. Measured against 100-digit mpmath for ``x`` from ``0.002`` to
``mean + 14 sd``: relative error of the density below ``1e-14`` for ``b <= 3``, ``4e-14`` for ``b = 5``, ``3e-13`` for
``b = 10``, ``1.3e-12`` for ``b = 20`` (the largest where the density is astronomically small: an error of
``eps |log p|``), but ``5e-8`` for ``b = 50`` near the mode, where both series cancel (large ``b`` would need a
saddle-point method, not implemented). For non-integer ``b`` only the left series exists: for ``b <= 5.5`` the
relative error is below ``1e-12`` up to the mean + 3 sd and below ``1e-9`` up to the mean + 7 sd, and grows like
:math:`\epsilon e^{\pi^2 x/2}` beyond, in the far right tail (e.g. ``b = 3.7``: ``1e-6`` at the mean + 12 sd,
useless by the mean + 16 sd, where the density is ~``1e-13``).
"""

from __future__ import annotations

import functools
import math

import torch

_TRUNC = 0.64  # Devroye's / PSW's truncation point t on the J* scale
_LOG_EPS64 = math.log(torch.finfo(torch.float64).eps)
_MAX_ROUNDS = 10_000  # rejection rounds; each accepts > 40% of the pending draws, so never reached in practice
_MAX_SERIES_STEPS = 100  # alternating-series steps in the acceptance test (1-3 are used in practice)
_MAX_RIGHT_B = 256  # the right series costs O(b^2) and no longer helps at large b (both series cancel there)


# ----------------------------------------------------------------------------------------------------------------
# density series


def _signed_logsumexp(log_abs, sign, dim=-1):
    """``(log|sum|, sign(sum), log sum|term|, log rounding)`` of ``sum(sign * exp(log_abs))`` along ``dim``, where
    ``rounding = sum |term| (1 + |log|term||)``: a term computed as ``exp`` of a log of magnitude ``L`` carries a
    relative error ``~ eps L``, so ``eps * rounding / |sum|`` estimates the relative rounding error of the sum."""
    m = log_abs.max(dim, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(log_abs - m)
    s = (sign * w).sum(dim)
    with torch.no_grad():
        a = w.sum(dim)
        aw = torch.where(w > 0, w * (1 + log_abs.abs()), torch.zeros_like(w)).sum(dim)
        md = m.detach().squeeze(dim)
    m = m.squeeze(dim)
    nonzero = s != 0  # an exactly cancelling sum: log 0 = -inf, with a finite (zero) gradient
    log_s = torch.where(nonzero, m + torch.where(nonzero, s, torch.ones_like(s)).abs().log(), -math.inf)
    return log_s, torch.sign(s), md + a.log(), md + aw.log()


def _log_pg0_left(x, b, num_terms: int = 200):
    r"""Left series of :math:`\log p(x | b, 0)` (any real ``b > 0``), float64 tensors of one shape ``[M]``.

    :returns: ``(log_density, log_error)``: ``log_error`` estimates the log relative error, rounding
        (``eps * sum|T_n| / |sum|``) plus the truncation bound :math:`T_N/|\text{sum}|` (``inf`` when the terms do
        not yet decrease at ``N``, or when the computed sum is not positive).
    """
    x_max = x.max().item() if x.numel() else 1.0
    # Terms with (2n + b)^2 / (8x) above 150 + (their polynomial growth) are below e^-150 times the first one and
    # are skipped: they could only matter where the sum cancels by > 60 digits, which the error estimate reports.
    b_max = b.max().item() if b.numel() else 1.0
    n_eff = int(math.ceil(0.5 * math.sqrt(8 * x_max * (150 + 2 * math.log(num_terms + 2) * (b_max + 1))))) + 2
    n_eff = max(2, min(num_terms, n_eff))
    n = torch.arange(n_eff + 1, dtype=x.dtype, device=x.device)  # the last one is the first omitted term
    xs, bs = x.unsqueeze(-1), b.unsqueeze(-1)
    k = 2 * n + bs
    # the b-dependent parts, once per distinct b: (b-1) log 2 - lgamma(b) + lgamma(n + b) - lgamma(n + 1) + log(2n+b)
    with torch.no_grad():
        b_unique, inverse = torch.unique(b, return_inverse=True)
    if b.requires_grad or len(b_unique) * 2 > len(b):
        coef = (bs - 1) * math.log(2) - torch.lgamma(bs) + torch.lgamma(n + bs) - torch.lgamma(n + 1) + k.log()
    else:
        bu = b_unique.unsqueeze(-1)
        coef = ((bu - 1) * math.log(2) - torch.lgamma(bu) + torch.lgamma(n + bu) - torch.lgamma(n + 1)
                + (2 * n + bu).log())[inverse]
    log_t = coef - 0.5 * math.log(2 * math.pi) - 1.5 * x.log().unsqueeze(-1) - k * k / (8 * xs)
    sign = 1 - 2 * torch.remainder(n, 2)
    log_s, sgn, _, log_a = _signed_logsumexp(log_t[..., :-1], sign[:-1])
    # truncation: rho_N <= 1 makes every omitted term decrease, so the error is at most T_N
    N = n_eff
    log_rho = torch.log((N + b) * (2 * N + b + 2) / ((N + 1) * (2 * N + b))) - (2 * N + b + 1) / (2 * x)
    log_trunc = torch.where(log_rho <= 0, log_t[..., -1], torch.full_like(x, math.inf))
    log_err = torch.logaddexp(_LOG_EPS64 + log_a, log_trunc) - log_s
    log_err = torch.where(sgn > 0, log_err, torch.full_like(x, math.inf))
    return log_s, log_err


@functools.lru_cache(maxsize=64)
def _right_coefficients(b: int, num_k: int):
    r"""``(log|c|, sign(c), log c_abs, log c_round)`` of shape ``[num_k, b]`` (CPU float64) with
    :math:`c_{k,d}` the coefficient of :math:`x^d` in :math:`[\eta^{b-1}]\{(\beta_k - \eta)\,
    e^{4x\beta_k\eta - 2x\eta^2}(\eta/\sin\eta)^b\}`, ``c_abs`` the sum of the magnitudes of its parts and
    ``c_round`` their rounding weight (see :func:`_signed_logsumexp`).

    :math:`(\eta/\sin\eta)^b = \exp\big(b \sum_{m\ge1} \zeta(2m)\,\eta^{2m}/(m\pi^{2m})\big)` has positive
    coefficients :math:`s_j`, computed by the power-series exponential recurrence; then
    :math:`c_{k,d} = \sum_{l} \frac{(4\beta_k)^{d-l}(-2)^l}{(d-l)!\,l!}\,(\beta_k s_j - s_{j-1})`,
    :math:`j = b - 1 - d - l`.
    """
    f64 = torch.float64
    L = torch.zeros(b + 1, dtype=f64)  # log(eta / sin eta) coefficients
    for m in range(1, b // 2 + 1):
        L[2 * m] = torch.special.zeta(torch.tensor(2.0 * m, dtype=f64), torch.tensor(1.0, dtype=f64)) / (
            m * math.pi ** (2 * m)
        )
    s = torch.zeros(b + 1, dtype=f64)
    s[0] = 1.0
    j = torch.arange(1, b + 1, dtype=f64)
    for i in range(1, b + 1):
        s[i] = b / i * (j[:i] * L[1 : i + 1] * s[:i].flip(0)).sum()
    beta = math.pi * (torch.arange(num_k, dtype=f64) + 0.5)  # [K]
    s_prev = torch.cat([torch.zeros(1, dtype=f64), s[:-1]])
    r = beta[:, None] * s[None, :b] - s_prev[None, :b]  # r_j, j = 0..b-1, [K, b]
    d = torch.arange(b, dtype=torch.long)[:, None]  # [b, 1]
    l = torch.arange((b + 1) // 2 + 1, dtype=torch.long)[None, :]  # [1, Lmax]
    p = d - l
    jj = b - 1 - d - l
    valid = (p >= 0) & (jj >= 0)
    p_, l_, jj_ = p.clamp(min=0).to(f64), l.to(f64).expand_as(p), jj.clamp(min=0)
    log_mag = p_ * torch.log(4 * beta)[:, None, None] + l_ * math.log(2) - torch.lgamma(p_ + 1) - torch.lgamma(l_ + 1)
    rj = r[:, jj_]  # [K, b, Lmax]
    log_t = torch.where(valid, log_mag + rj.abs().log(), torch.full_like(rj, -math.inf))
    sign = torch.where(valid, (1 - 2 * torch.remainder(l_, 2)) * torch.sign(rj), torch.zeros_like(rj))
    return _signed_logsumexp(log_t, sign)


def _log_pg0_right(x, b: int, num_terms: int = 200):
    r"""Right (residue) series of :math:`\log p(x | b, 0)` for one integer ``b``; ``x`` float64 ``[M]``.

    :returns: ``(log_density, log_error)`` as :func:`_log_pg0_left`.
    """
    x_min = max(x.min().item(), 1e-300) if x.numel() else 1.0
    log_cauchy = b * -math.log(math.sin(1.0))
    # first K whose Cauchy bound is e^-120 below the k = 0 scale at the smallest x (the post-check verifies)
    k_all = torch.arange(num_terms + 1, dtype=torch.float64)
    beta_all = math.pi * (k_all + 0.5)
    excess = 2 * x_min * (beta_all.pow(2) - 2 * beta_all - 1 - beta_all[0] ** 2) - torch.log(4 * (beta_all + 1))
    ok = (excess >= 120 + log_cauchy + 2 * b * math.log(1 + x_min)).nonzero()
    num_k = int(ok[0, 0].item()) + 1 if len(ok) else num_terms
    num_k = max(1, min(num_terms, num_k))
    c_log, c_sign, c_abs, c_round = (t.to(x.device) for t in _right_coefficients(b, num_k))  # [K, b]
    beta = math.pi * (torch.arange(num_k, dtype=x.dtype, device=x.device) + 0.5)
    d = torch.arange(b, dtype=x.dtype, device=x.device)
    xs = x[:, None, None]
    base = math.log(4) - 2 * xs * beta[:, None].pow(2) + d * x.log()[:, None, None]  # [M, K, b]
    k_sign = (1 - 2 * torch.remainder(torch.arange(num_k, device=x.device) * b, 2)).to(x.dtype)
    log_t = (base + c_log).flatten(1)
    sign = (k_sign[:, None] * c_sign).flatten().expand_as(log_t)
    log_s, sgn, _, _ = _signed_logsumexp(log_t, sign)
    with torch.no_grad():  # rounding: the coefficients' own (c_round) plus that of exp(base) (|base| c_abs)
        log_a = torch.logaddexp(base + c_round, base + base.abs().log() + c_abs).flatten(1).logsumexp(-1)
    # truncation: Cauchy bound of the first omitted term, doubled when the bounds at least halve from there on
    bK, bK1 = math.pi * (num_k + 0.5), math.pi * (num_k + 1.5)
    log_bnd = math.log(4 * (bK + 1)) + log_cauchy - 2 * x * (bK**2 - 2 * bK - 1)
    log_bnd1 = math.log(4 * (bK1 + 1)) + log_cauchy - 2 * x * (bK1**2 - 2 * bK1 - 1)
    log_trunc = torch.where(log_bnd1 - log_bnd <= -math.log(2), log_bnd + math.log(2), torch.full_like(x, math.inf))
    log_err = torch.logaddexp(_LOG_EPS64 + log_a, log_trunc) - log_s
    log_err = torch.where(sgn > 0, log_err, torch.full_like(x, math.inf))
    return log_s, log_err


def _log_pg0(x, b, num_terms: int = 200, chunk: int = 1 << 21):
    r""":math:`\log p(x | b, 0)` for float64 ``x, b`` of one shape: the better of the two series (module docstring).

    :returns: ``(log_density, log_error)``, the latter the estimated log relative error of the chosen series."""
    shape = x.shape
    x, b = x.reshape(-1), b.reshape(-1)
    if x.numel() > max(1, chunk // num_terms):  # bound the [M, terms] temporaries
        step = max(1, chunk // num_terms)
        parts = [_log_pg0(x[i : i + step], b[i : i + step], num_terms) for i in range(0, len(x), step)]
        return torch.cat([p[0] for p in parts]).reshape(shape), torch.cat([p[1] for p in parts]).reshape(shape)
    with torch.no_grad():
        x_safe = x.clamp(min=torch.finfo(x.dtype).tiny)
    x = torch.where(x > 0, x, x_safe)  # keeps the graph; log_prob is only defined on x > 0
    log_p, log_err = _log_pg0_left(x, b, num_terms)
    with torch.no_grad():
        integer = (b == b.round()) & (b <= _MAX_RIGHT_B)
        # the right series can only help where the left one cancels (error > 2x its no-cancellation level)
        level = torch.where(torch.isfinite(log_p), log_p.detach().abs(), torch.zeros_like(log_p))
        need = integer & (log_err > _LOG_EPS64 + math.log(2) + torch.log1p(level + 10))
        b_values = torch.unique(b[need]).tolist() if bool(need.any()) else []
    for bv in b_values:
        idx = (need & (b == bv)).nonzero().squeeze(-1)
        log_p_r, log_err_r = _log_pg0_right(x[idx], int(bv), num_terms)
        better = log_err_r < log_err[idx]
        chosen = torch.where(better, log_p_r, log_p[idx])
        log_p = log_p.index_put((idx,), chosen)
        log_err = log_err.index_put((idx,), torch.where(better, log_err_r, log_err[idx]).detach())
    return log_p.reshape(shape), log_err.detach().reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# exact sampler of J*(1, z) = 4 PG(1, 2z), Devroye / Polson-Scott-Windle (2013) algorithm 1


def _series_ratio(n: int, x):
    r""":math:`a_n(x)/a_0(x)` for the J*(1) density coefficients of PSW (2013, eq. (15)-(16)), piecewise at ``t``:
    :math:`(2n+1)e^{-2n(n+1)/x}` for ``x <= t``, :math:`(2n+1)e^{-\pi^2 n(n+1) x/2}` for ``x > t``."""
    left = torch.exp(-2.0 * n * (n + 1) / x)
    right = torch.exp(-0.5 * math.pi**2 * n * (n + 1) * x)
    return (2 * n + 1) * torch.where(x <= _TRUNC, left, right)


def _rejection_loop(propose, z):
    """One accepted draw per entry of ``z``: ``propose(z_pending) -> (x, accepted)`` runs for all pending entries at
    once, and only the rejected ones propose again."""
    out = torch.empty_like(z)
    pending = torch.arange(z.numel(), device=z.device)
    for _ in range(_MAX_ROUNDS):
        if pending.numel() == 0:
            return out
        x, ok = propose(z[pending])
        out[pending[ok]] = x[ok]
        pending = pending[~ok]
    raise RuntimeError("Polya-Gamma rejection sampler did not finish")  # pragma: no cover


def _propose_tilted_levy(z):
    """mu = 1/z > t: a 1/chi^2_1 draw restricted to (0, t) -- the normal tail beyond 1/sqrt(t) by Devroye's
    exponential rejection, X = t / (1 + t E)^2 kept if t E^2 <= 2 E' -- kept with probability exp(-z^2 X / 2)."""
    e1 = torch.empty_like(z).exponential_()
    e2 = torch.empty_like(z).exponential_()
    x = _TRUNC / (1 + _TRUNC * e1).pow(2)
    ok = (e1 * e1 * _TRUNC <= 2 * e2) & (torch.rand_like(z) <= torch.exp(-0.5 * z * z * x))
    return x, ok


def _propose_ig_below_t(z):
    """mu = 1/z <= t: an IG(mu, 1) draw (Michael, Schucany and Haas 1976) kept if below t. The root
    mu + mu^2 y/2 - mu/2 sqrt(4 mu y + mu^2 y^2) is computed as mu / (1 + w + sqrt(w (w + 2))), w = mu y / 2."""
    mu = 1 / z
    w = 0.5 * mu * torch.randn_like(z).pow(2)
    x = mu / (1 + w + torch.sqrt(w * (w + 2)))
    x = torch.where(torch.rand_like(z) * (mu + x) > mu, mu * mu / x, x)
    return x, x < _TRUNC


def _sample_truncated_ig(z):
    r"""Draws of :math:`\mathrm{IG}(\mu = 1/z, \lambda = 1)` truncated to ``(0, t)``, one per entry of ``z >= 0``
    (PSW 2013, section 4.1): :func:`_propose_tilted_levy` for :math:`\mu > t`, :func:`_propose_ig_below_t` otherwise;
    both accept more than 40% of the proposals."""
    out = torch.empty_like(z)
    far = z < 1 / _TRUNC
    for mask, propose in ((far, _propose_tilted_levy), (~far, _propose_ig_below_t)):
        idx = mask.nonzero().squeeze(-1)
        if idx.numel():
            out[idx] = _rejection_loop(propose, z[idx])
    return out


def _proposal_constants(z):
    r"""``(K, prob_tail)`` of the J*(1, z) proposal (see :func:`_sample_jstar1`), elementwise in ``z >= 0``."""
    K = math.pi**2 / 8 + 0.5 * z * z
    log_p = math.log(math.pi / 2) - K.log() - K * _TRUNC
    rt = math.sqrt(_TRUNC)
    log_ig_cdf = torch.logaddexp(
        torch.special.log_ndtr((_TRUNC * z - 1) / rt), 2 * z + torch.special.log_ndtr(-(_TRUNC * z + 1) / rt)
    )
    log_q = math.log(2) - z + log_ig_cdf
    return K, torch.sigmoid(log_p - log_q)


def _sample_jstar1(z, K=None, prob_tail=None):
    r"""Exact draws of :math:`J^*(1, z)` for a flat tensor ``z >= 0`` (PSW 2013, algorithm 1); ``K, prob_tail``:
    :func:`_proposal_constants` of ``z`` when already known.

    Proposal: with probability :math:`p/(p+q)` the exponential tail :math:`t + \mathrm{Exp}(K)`,
    :math:`K = \pi^2/8 + z^2/2`, :math:`p = \tfrac{\pi}{2K}e^{-Kt}`; otherwise the truncated inverse Gaussian,
    :math:`q = 2e^{-z}\,\Pr[\mathrm{IG}(1/z, 1) < t]`. Acceptance: :math:`U a_0(x) \le \sum_n (-1)^n a_n(x)`,
    decided by the alternating partial sums (exact since the :math:`a_n(x)` decrease in ``n`` on both sides of ``t``).
    """
    if K is None or prob_tail is None:
        K, prob_tail = _proposal_constants(z)
    out = torch.empty_like(z)
    pending = torch.arange(z.numel(), device=z.device)
    for _ in range(_MAX_ROUNDS):
        if pending.numel() == 0:
            return out
        zz, KK = z[pending], K[pending]
        tail = torch.rand_like(zz) < prob_tail[pending]
        x = _TRUNC + torch.empty_like(zz).exponential_() / KK
        head = (~tail).nonzero().squeeze(-1)
        x[head] = _sample_truncated_ig(zz[head])
        # alternating-series test of U <= 1 - r_1 + r_2 - ...,  r_n = a_n / a_0
        u = torch.rand_like(zz)
        s = torch.ones_like(zz)
        accept = torch.zeros_like(zz, dtype=torch.bool)
        decided = torch.zeros_like(zz, dtype=torch.bool)
        for n in range(1, _MAX_SERIES_STEPS):
            r = _series_ratio(n, x)
            if n % 2:
                s = s - r  # lower bound of the density ratio
                now = ~decided & (u <= s)
                accept |= now
            else:
                s = s + r  # upper bound
                now = ~decided & (u > s)
            decided |= now
            if bool(decided.all()):
                break
        # undecided after _MAX_SERIES_STEPS (u equal to the limit to rounding): rejected, proposes again
        out[pending[accept]] = x[accept]
        pending = pending[~accept]
    raise RuntimeError("Polya-Gamma sampler did not finish")  # pragma: no cover
