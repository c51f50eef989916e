r"""The Pólya-Gamma distribution :math:`\mathrm{PG}(b, c)` (Polson, Scott, Windle 2013, "Bayesian inference for
logistic models using Pólya-Gamma latent variables", JASA 108(504)), as used by Wenzel et al. (2019).

:math:`\omega \sim \mathrm{PG}(b, c)` is the infinite convolution
:math:`\omega = \frac{1}{2\pi^2}\sum_{k\ge1} \frac{g_k}{(k-1/2)^2 + c^2/(4\pi^2)}`, :math:`g_k \sim \mathrm{Gamma}(b, 1)`,
with density :math:`p(\omega|b,c) = \cosh^b(c/2)\, e^{-c^2\omega/2}\, p(\omega|b,0)`.

Sampling (exact): for ``b = 1`` the alternating-series rejection sampler of Devroye as specialised by Polson,
Scott and Windle (2013, section 4, algorithm 1, truncation point ``t = 0.64``), on :math:`J^*(1, z) = 4\,\mathrm{PG}(1,
2z)`; integer ``b`` by summing ``b`` independent ``PG(1, c)`` draws. Everything is vectorised: every pending draw
proposes and is tested at once, and only the rejected ones propose again.

Density: for ``b = 1`` the two alternating series of the paper (eq. for :math:`a_n(x)`: the left one for
:math:`x \le t`, the right one for :math:`x > t`, on the :math:`J^*` scale), each converging fast on its side; for
other ``b`` the series :math:`p(\omega|b,0) = \frac{2^{b-1}}{\Gamma(b)}\sum_{n\ge0}(-1)^n
\frac{\Gamma(n+b)}{\Gamma(n+1)}\frac{2n+b}{\sqrt{2\pi\omega^3}}e^{-(2n+b)^2/(8\omega)}`. Truncation: for ``b = 1`` 24 terms of whichever series applies leave a first omitted term below
:math:`e^{-1800}` relative to the density (both series alternate with decreasing terms on their side of ``t``),
so the density is exact to rounding everywhere. For other ``b`` the terms alternate and decrease beyond the largest
one, so stopping after ``num_terms = N`` terms errs by at most the first omitted term,
:math:`\propto e^{-(2N+b)^2/(8\omega)}`, negligible for :math:`\omega \lesssim N^2/200`; but in the right tail
the alternating sum cancels: where the density is :math:`10^{-k}` times the largest term only about ``16 - k``
significant digits remain (e.g. ``b = 5``: relative error ~1e-7 at :math:`\omega = 6`, density ~1e-10).
"""
from __future__ import annotations

import math

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import broadcast_all

__all__ = ["PolyaGamma"]

_T = 0.64  # truncation point of Polson, Scott and Windle (2013), on the J* scale


def _log_cosh_half(c):
    a = (c / 2).abs()
    return a + torch.log1p(torch.exp(-2 * a)) - math.log(2)


def _pg_mean(b, c):
    c = c.abs()
    small = c < 1e-4
    safe = torch.where(small, torch.ones_like(c), c)
    return b * torch.where(small, 0.25 - c.pow(2) / 48, torch.tanh(safe / 2) / (2 * safe))


def _pg_variance(b, c):
    # b / (4 c^3) (sinh c - c) sech^2(c/2); series b/24 - b c^2 / 240 + ... near 0
    c = c.abs()
    small = c < 1e-2
    safe = torch.where(small, torch.ones_like(c), c)
    big = b * (torch.sinh(safe) - safe) / (4 * safe.pow(3) * torch.cosh(safe / 2).pow(2))
    # for large c, sinh c / cosh^2(c/2) -> 2, use the stable form 2 tanh(c/2) / cosh... avoid overflow
    large = safe > 50
    big = torch.where(large, b * (1 - 2 * safe * torch.exp(-safe)) / (2 * safe.pow(3)), big)
    return torch.where(small, b / 24 - b * c.pow(2) / 240, big)


def _normal_log_cdf(x):
    return torch.special.log_ndtr(x)


def _a_n(n, x):
    """Coefficients :math:`a_n(x)` of the J*(1) density series (Polson, Scott, Windle 2013, eq. 15-16)."""
    k = n + 0.5
    left = math.pi * k * (2 / (math.pi * x)).pow(1.5) * torch.exp(-2 * k * k / x)
    right = math.pi * k * torch.exp(-k * k * math.pi**2 * x / 2)
    return torch.where(x <= _T, left, right)


def _settle(out, pending, idx, x, accepted):
    """Write the accepted proposals ``x`` of the pending draws ``idx`` into ``out``; return the new pending mask."""
    out[idx] = torch.where(accepted, x, out[idx])
    pending = pending.clone()
    pending[idx] = ~accepted
    return pending


def _truncated_ig(z, shape_like):
    """Inverse-Gaussian(mu = 1/z, lambda = 1) truncated to (0, t), vectorised (PSW 2013, algorithms 2-3)."""
    out = torch.empty_like(shape_like)
    pending = torch.ones_like(shape_like, dtype=torch.bool)
    mu = 1 / z.clamp(min=1e-300)
    big_mu = mu > _T
    while pending.any():
        idx = pending.nonzero(as_tuple=True)
        zz, mm, bm = z[idx], mu[idx], big_mu[idx]
        # branch 1 (mu > t): X = t / (1 + t E)^2 with E^2 <= 2 E' / t, accepted with prob exp(-z^2 X / 2)
        e = torch.empty_like(zz).exponential_()
        e2 = torch.empty_like(zz).exponential_()
        x1 = _T / (1 + _T * e).pow(2)
        ok1 = (e.pow(2) <= 2 * e2 / _T) & (torch.rand_like(zz) <= torch.exp(-0.5 * zz.pow(2) * x1))
        # branch 2 (mu <= t): an IG(mu, 1) draw, accepted if below t
        y = torch.randn_like(zz).pow(2)
        x2 = mm + 0.5 * mm.pow(2) * y - 0.5 * mm * (4 * mm * y + (mm * y).pow(2)).sqrt()
        x2 = torch.where(torch.rand_like(zz) > mm / (mm + x2), mm.pow(2) / x2, x2)
        ok2 = x2 < _T
        pending = _settle(out, pending, idx, torch.where(bm, x1, x2), torch.where(bm, ok1, ok2))
    return out


def _sample_j1(z, max_terms: int = 64):
    """Exact draws of J*(1, z) for a flat tensor ``z >= 0`` (PSW 2013 algorithm 1)."""
    z = z.abs()
    K = math.pi**2 / 8 + z.pow(2) / 2
    # mixture weights of the proposal: p (exponential tail beyond t) and q (truncated inverse Gaussian below t)
    log_p = math.log(math.pi / 2) - K.log() - K * _T
    sq = math.sqrt(_T)
    log_ig_cdf = torch.logaddexp(
        _normal_log_cdf((_T * z - 1) / sq), 2 * z + _normal_log_cdf(-(_T * z + 1) / sq)
    )
    log_q = math.log(2) - z + log_ig_cdf
    prob_exp = torch.sigmoid(log_p - log_q)
    out = torch.empty_like(z)
    pending = torch.ones_like(z, dtype=torch.bool)
    while pending.any():
        idx = pending.nonzero(as_tuple=True)
        zz, KK, pe = z[idx], K[idx], prob_exp[idx]
        use_exp = torch.rand_like(zz) < pe
        x_exp = _T + torch.empty_like(zz).exponential_() / KK
        x_ig = _truncated_ig(zz, zz)
        x = torch.where(use_exp, x_exp, x_ig)
        # alternating-series acceptance test
        s = _a_n(0, x)
        u = torch.rand_like(zz) * s
        decided = torch.zeros_like(zz, dtype=torch.bool)
        accept = torch.zeros_like(zz, dtype=torch.bool)
        for n in range(1, max_terms):
            a = _a_n(n, x)
            if n % 2 == 1:
                s = s - a
                now = (~decided) & (u <= s)
                accept |= now
            else:
                s = s + a
                now = (~decided) & (u > s)
            decided |= now
            if bool(decided.all()):
                break
        pending = _settle(out, pending, idx, x, accept)
    return out


class PolyaGamma(TorchDistribution):
    r"""Pólya-Gamma distribution :math:`\mathrm{PG}(b, c)`.

    :param b: shape, ``> 0`` (sampling needs integer ``b``).
    :param c: tilt, real.
    :param int num_terms: terms of the density series (module docstring states the truncation error).

    ``mean = b / (2c) tanh(c/2)`` (``b/4`` at ``c = 0``), ``variance = b / (4c^3) (sinh c - c) sech^2(c/2)``
    (``b/24`` at ``c = 0``), as in Polson, Scott, Windle (2013) and Wenzel et al. (2019).
    """

    arg_constraints = {"b": constraints.positive, "c": constraints.real}
    support = constraints.positive
    has_rsample = True

    def __init__(self, b, c, num_terms: int = 200, validate_args=None):
        self.b, self.c = broadcast_all(b, c)
        self.num_terms = num_terms
        super().__init__(self.b.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(PolyaGamma, _instance)
        batch_shape = torch.Size(batch_shape)
        new.b = self.b.expand(batch_shape)
        new.c = self.c.expand(batch_shape)
        new.num_terms = self.num_terms
        super(PolyaGamma, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self):
        return _pg_mean(self.b, self.c)

    @property
    def variance(self):
        return _pg_variance(self.b, self.c)

    @torch.no_grad()
    def sample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        b = self.b.expand(shape)
        if not bool((b == b.round()).all()):
            raise ValueError("PolyaGamma.sample needs integer b (the sum of b PG(1, c) draws)")
        bmax = int(b.max().item()) if b.numel() else 0
        z = (self.c.expand(shape).abs() / 2).reshape(-1)
        draws = _sample_j1(z.repeat(bmax)).reshape(bmax, -1)  # [bmax, n]
        keep = torch.arange(bmax, device=z.device).unsqueeze(-1) < b.reshape(1, -1)
        return ((draws * keep).sum(0) / 4).reshape(shape)

    def rsample(self, sample_shape=torch.Size()):
        """An exact draw whose gradient with respect to ``(b, c)`` is that of the mean:
        ``mean + (x - mean).detach()``. This pathwise gradient is exact for expectations of functions linear in
        omega -- which is how omega enters the augmented logistic likelihood -- and lets ``TraceMeanField_ELBO``
        (which needs reparameterised guides) use the closed-form PG KL; for nonlinear functions of omega with a
        learnt ``c`` it would be biased."""
        x = self.sample(sample_shape)
        mean = self.mean.expand(x.shape)
        return mean + (x - mean).detach()

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        b, c = self.b, self.c
        tilt = b * _log_cosh_half(c) - 0.5 * c.pow(2) * value
        return tilt + self._log_prob_untilted(value, b)

    def _log_prob_untilted(self, x, b):
        x, b = torch.broadcast_tensors(x, b)
        one = b == 1
        if bool(one.all()):
            return self._log_j1(x)
        out = torch.empty_like(x)
        out[one] = self._log_j1(x[one])
        out[~one] = self._log_series(x[~one], b[~one])
        return out

    @staticmethod
    def _log_j1(x):
        """log PG(x | 1, 0) = log 4 + log J*(4x | 1, 0) through the two series of PSW 2013 (their a_n)."""
        y = (4 * x).clamp(min=torch.finfo(x.dtype).tiny)
        n = torch.arange(24, dtype=x.dtype, device=x.device)
        terms = _a_n(n, y.unsqueeze(-1))  # [..., 24]: each side's series is below 1e-300 relative after 24 terms
        sign = 1 - 2 * (n % 2)
        dens = (terms * sign).sum(-1).clamp(min=torch.finfo(x.dtype).tiny)
        return math.log(4) + dens.log()

    def _log_series(self, x, b):
        x = x.clamp(min=torch.finfo(x.dtype).tiny)
        n = torch.arange(self.num_terms, dtype=x.dtype, device=x.device)
        xs, bs = x.unsqueeze(-1), b.unsqueeze(-1)
        k = 2 * n + bs
        log_terms = (
            torch.lgamma(n + bs) - torch.lgamma(n + 1) + k.log() - 0.5 * (2 * math.pi * xs.pow(3)).log()
            - k.pow(2) / (8 * xs)
        )
        sign = 1 - 2 * (n % 2)
        m = log_terms.max(-1, keepdim=True).values
        s = (sign * torch.exp(log_terms - m)).sum(-1).clamp(min=torch.finfo(x.dtype).tiny)
        return (b - 1) * math.log(2) - torch.lgamma(b) + m.squeeze(-1) + s.log()
