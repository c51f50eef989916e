r"""The Pólya-Gamma distribution :math:`\mathrm{PG}(b, c)`, :math:`b > 0`, :math:`c \in \mathbb{R}`.

Definition (Polson, Scott and Windle 2013, "Bayesian inference for logistic models using Pólya-Gamma latent
variables", JASA 108(504), 1339-1349, definition 1): :math:`\omega \sim \mathrm{PG}(b, c)` is the infinite
convolution

.. math:: \omega \overset{d}{=} \frac{1}{2\pi^2} \sum_{k \ge 1} \frac{g_k}{(k - 1/2)^2 + c^2 / (4\pi^2)},
    \qquad g_k \sim \mathrm{Gamma}(b, 1) \text{ i.i.d.},

with Laplace transform :math:`\mathbb{E}[e^{-s\omega}] = \cosh^b(c/2) / \cosh^b(\sqrt{(c^2/2 + s)/2})` and density
:math:`p(\omega | b, c) = \cosh^b(c/2)\, e^{-c^2\omega/2}\, p(\omega | b, 0)`. Wenzel et al. (2019, "Efficient
Gaussian process classification using Pólya-Gamma data augmentation", AAAI) use its moments
:attr:`PolyaGamma.mean`, :attr:`PolyaGamma.variance` and the KL of :mod:`pyro_sparsegp.distributions.kl`.

**Sampling** (:meth:`PolyaGamma.sample`, exact) and **density** (:meth:`PolyaGamma.log_prob`, two exact series in
float64, with their truncation and rounding errors) are set out in
:mod:`pyro_sparsegp.distributions.polya_gamma_series`.
"""

from __future__ import annotations

import math
import numbers

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import broadcast_all

from .polya_gamma_series import _log_pg0, _proposal_constants, _sample_jstar1

__all__ = ["PolyaGamma", "pg_mean", "log_cosh_half"]

_LOG_DENSITY_TOL = math.log(1e-6)  # log_prob refuses points whose estimated error exceeds this times 1 / sd ...
_BULK_SD = 8.0  # ... up to the mean + this many sd


# ----------------------------------------------------------------------------------------------------------------
# elementary functions


def log_cosh_half(c: torch.Tensor) -> torch.Tensor:
    r"""Stable :math:`\log\cosh(c/2) = |c|/2 + \log(1 + e^{-|c|}) - \log 2` for every ``c``: the normaliser of
    :math:`\mathrm{PG}(1, c)` relative to :math:`\mathrm{PG}(1, 0)` and the first term of
    :math:`\mathrm{KL}[\mathrm{PG}(1,c)\|\mathrm{PG}(1,0)]` (Wenzel et al. 2019).
    Element-wise: ``c [...]`` -> ``[...]``."""
    a = (0.5 * c).abs()
    return a + torch.log1p(torch.exp(-2 * a)) - math.log(2)


def pg_mean(c: torch.Tensor, b=1.0) -> torch.Tensor:
    r""":math:`\mathbb{E}[\omega] = \tfrac{b}{2c}\tanh(c/2) = \tfrac b4 \tanh(y)/y` with :math:`y = c/2`, for
    :math:`\omega \sim \mathrm{PG}(b, c)` (``b/4`` at ``c = 0``; Polson, Scott, Windle 2013): the
    :math:`\bar\omega_n` of Wenzel et al. 2019. Element-wise (broadcasting ``b``): ``c [...]`` -> ``[...]``."""
    y = 0.5 * c
    small = y.abs() < 1e-4
    y_safe = torch.where(small, torch.ones_like(y), y)
    ratio = torch.where(small, 1 - y * y / 3, torch.tanh(y_safe) / y_safe)  # series error 2 y^4 / 15 < 1e-17
    return 0.25 * b * ratio


def _pg_variance(b, c):
    r""":math:`\tfrac{b}{4c^3}(\sinh c - c)\,\mathrm{sech}^2(c/2) = b\,\frac{e^{-u}(\sinh u - u)}{u^3(1+e^{-u})^2}`,
    ``u = |c|`` (``b/24`` at ``c = 0``). For ``u < 1``, :math:`(\sinh u - u)/u^3 = \sum_k u^{2k}/(2k+3)!` (positive
    terms, no cancellation); for ``u >= 1``, :math:`e^{-u}(\sinh u - u) = (1 - e^{-2u})/2 - u e^{-u}` (no overflow,
    at most one digit lost at ``u = 1``)."""
    u = c.abs()
    small = u < 1
    us = torch.where(small, u, torch.zeros_like(u))
    ul = torch.where(small, torch.ones_like(u), u)
    # Horner for sum_{k=0}^{9} u^{2k} / (2k+3)!  (the omitted u^20/23! < 4e-23)
    u2 = us * us
    series = torch.full_like(us, 1 / math.factorial(21))
    for k in range(8, -1, -1):
        series = series * u2 + 1 / math.factorial(2 * k + 3)
    e = torch.exp(-us)
    var_small = e * series / (1 + e).pow(2)
    el = torch.exp(-ul)
    var_large = (-0.5 * torch.expm1(-2 * ul) - ul * el) / (ul.pow(3) * (1 + el).pow(2))
    return b * torch.where(small, var_small, var_large)


# ----------------------------------------------------------------------------------------------------------------


class PolyaGamma(TorchDistribution):
    r"""Pólya-Gamma distribution :math:`\mathrm{PG}(b, c)` (Polson, Scott and Windle 2013), the latent variable of
    the Pólya-Gamma augmented logistic likelihood (Wenzel et al. 2019).

    :param b: shape, ``> 0``, tensor or float, broadcastable with ``c``. Any positive real for :attr:`mean`,
        :attr:`variance` and :meth:`log_prob`; :meth:`sample` needs integer values.
    :param c: tilting parameter, real (the distribution depends on ``|c|`` only).
    :param int num_terms: most terms of each density series in :meth:`log_prob` (default 200; see the module
        docstring of :mod:`~pyro_sparsegp.distributions.polya_gamma_series` for the truncation
        and rounding error).
    :param validate_args: as for :class:`torch.distributions.Distribution`.

    ``batch_shape`` is the broadcast shape of ``b`` and ``c``; ``event_shape`` is ``()``.

    * :attr:`mean`: :math:`\frac{b}{2c}\tanh\frac c2` (``b/4`` at ``c = 0``);
    * :attr:`variance`: :math:`\frac{b}{4c^3}(\sinh c - c)\,\mathrm{sech}^2\frac c2` (``b/24`` at ``c = 0``);

    both evaluated without cancellation or overflow for every ``c``.

    ``has_rsample`` is ``True`` so that Pyro's ``TraceMeanField_ELBO`` accepts a ``PolyaGamma`` guide site (with the
    closed-form KL of :mod:`~pyro_sparsegp.distributions.kl`); :meth:`rsample` is an exact draw whose gradient is that
    of the mean (see there).

    References: N. G. Polson, J. G. Scott, J. Windle (2013), "Bayesian inference for logistic models using Pólya-Gamma
    latent variables", JASA 108(504); F. Wenzel, T. Galy-Fajou, C. Donner, M. Kloft, M. Opper (2019), "Efficient
    Gaussian process classification using Pólya-Gamma data augmentation", AAAI.
    """

    arg_constraints = {"b": constraints.positive, "c": constraints.real}
    support = constraints.positive
    has_rsample = True

    def __init__(self, b, c, num_terms: int = 200, validate_args=None):
        try:
            self.b, self.c = broadcast_all(b, c)
        except (RuntimeError, ValueError) as exc:  # torch's message names neither argument
            bad = [f"{n} is a {type(x).__name__}" for n, x in (("b", b), ("c", c))
                   if not (torch.is_tensor(x) or isinstance(x, numbers.Number))]
            shapes = [tuple(x.shape) if torch.is_tensor(x) else () for x in (b, c)]
            raise ValueError(f"PolyaGamma: b and c must be numbers or tensors ({', '.join(bad)})" if bad else
                             f"PolyaGamma: b {shapes[0]} and c {shapes[1]} do not broadcast to one batch shape (b: "
                             "the shape parameter, c: the tilting); give them the same shape or size-1 dims") from exc
        if isinstance(num_terms, bool) or int(num_terms) != num_terms or num_terms < 2:
            raise ValueError(f"num_terms (terms of each density series) must be an integer >= 2, got {num_terms!r}")
        self.num_terms = int(num_terms)
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
        """:math:`\\mathbb{E}[\\omega]`, shape ``batch_shape``."""
        return pg_mean(self.c, self.b)

    @property
    def variance(self):
        """:math:`\\mathrm{Var}[\\omega]`, shape ``batch_shape``."""
        return _pg_variance(self.b, self.c)

    def sample(self, sample_shape=torch.Size()):
        r"""Exact draws, shape ``sample_shape + batch_shape``, on the device and in the dtype of ``c``.

        Devroye's alternating-series rejection sampler for :math:`\mathrm{PG}(1, c)` (Polson, Scott and Windle
        2013, section 4, algorithm 1, ``t = 0.64``), vectorised over all draws; :math:`\mathrm{PG}(b, c)` for integer
        ``b`` is the sum of ``b`` independent :math:`\mathrm{PG}(1, c)` draws (cost proportional to ``b``).

        :raises ValueError: if some ``b`` is not an integer.
        """
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            b = self.b.expand(shape).reshape(-1)
            if not bool((b == b.round()).all()):
                raise ValueError(
                    "PolyaGamma.sample needs integer b: PG(b, c) is drawn exactly as a sum of b PG(1, c) draws"
                )
            z = 0.5 * self.c.detach().abs()
            consts = _proposal_constants(z)  # once per batch element, not per draw
            z, K, prob_tail = (t.expand(shape).reshape(-1) for t in (z, *consts))
            counts = b.to(torch.long)
            if counts.numel() == 0:
                return torch.empty(shape, dtype=z.dtype, device=z.device)
            n_max = int(counts.max().item())
            if bool((counts == n_max).all()):  # one b: draws laid out [b, n], summed in a fixed order
                draws = _sample_jstar1(z.repeat(n_max), K.repeat(n_max), prob_tail.repeat(n_max))
                draws = draws.reshape(n_max, -1).sum(0)
            else:
                rep = (t.repeat_interleave(counts) for t in (z, K, prob_tail))
                draws = _sample_jstar1(*rep)
                segment = torch.arange(len(z), device=z.device).repeat_interleave(counts)
                draws = torch.zeros_like(z).index_add_(0, segment, draws)
            return (0.25 * draws).reshape(shape)

    def rsample(self, sample_shape=torch.Size()):
        r"""An exact draw :math:`x` (as :meth:`sample`) returned as ``mean + (x - mean).detach()``: its value is the
        draw, its gradient with respect to ``(b, c)`` that of the mean. That makes the gradient of
        :math:`\mathbb{E}[f(\omega)]` exact for ``f`` linear in :math:`\omega` (how :math:`\omega` enters the
        augmented logistic likelihood) and biased otherwise; with a ``c`` that carries no gradient it is exactly
        :meth:`sample`."""
        x = self.sample(sample_shape)
        mean = self.mean.expand(x.shape)
        return mean + (x - mean).detach()

    def log_prob(self, value):
        r""":math:`\log p(x | b, c) = b\log\cosh(c/2) - c^2 x/2 + \log p(x | b, 0)`, shape
        ``broadcast(value.shape, batch_shape)``; the series :math:`\log p(x | b, 0)` and its error are described in
        :mod:`.polya_gamma_series` (float64 internally, returned in the promoted dtype of ``value`` and the
        parameters).

        :raises ValueError: where, up to the mean + 8 sd, the estimated error of the density exceeds ``1e-6 / sd``
            in absolute terms (the density's own scale is ``1 / sd``). Measured at
            ``c = 0``: never for integer ``b <= 50`` (there the relative error is below ``1e-6`` at every ``x``) nor
            for non-integer ``b <= 20``; in the upper bulk for non-integer ``b`` from about 30; near the mode for
            ``b`` from about 55 on. A tilt ``c`` moves the mass to
            smaller ``x``, where the series is exact. Unchecked, the density of ``PG(100, 0)`` integrated to ``1e5``.
            Beyond the mean + 8 sd the value is returned with the error :mod:`.polya_gamma_series` describes
            (non-integer ``b``: relative ``1e-6`` at the mean + 12 sd for ``b = 3.7``, useless by the mean + 16 sd)."""
        if self._validate_args:
            self._validate_sample(value)
        if not torch.is_tensor(value):
            value = torch.as_tensor(value, dtype=self.c.dtype, device=self.c.device)
        dtype = torch.promote_types(value.dtype, self.c.dtype)
        x, b, c = torch.broadcast_tensors(value, self.b, self.c)
        x64, b64, c64 = x.to(torch.float64), b.to(torch.float64), c.to(torch.float64)
        log_p0, log_err = _log_pg0(x64, b64, self.num_terms)
        log_p = b64 * log_cosh_half(c64) - 0.5 * c64 * c64 * x64 + log_p0
        with torch.no_grad():  # refused: an absolute error above 1e-6 / sd (the density's scale is 1 / sd) in the bulk
            var = _pg_variance(b64, c64)
            log_abs_err = log_p + log_err + 0.5 * var.log()
            bulk = (x64 > 0) & (x64 <= pg_mean(c64, b64) + _BULK_SD * var.sqrt())
            bad = ~(log_abs_err <= _LOG_DENSITY_TOL) & (log_p0 > -math.inf) & bulk
        if bool(bad.any()):
            i = bad.nonzero()[0]
            raise ValueError(
                f"PolyaGamma.log_prob: the density of PG(b={b64[tuple(i)].item():g}, c) at x={x64[tuple(i)].item():g} "
                f"cannot be computed to an absolute error of {math.exp(_LOG_DENSITY_TOL):.0e} / sd (both density "
                "series cancel there). Exact range: integer b <= 50 (relative error < 1e-6 everywhere); "
                "non-integer b up to "
                "about 20 (up to the mean + 8 sd); beyond, points in the upper bulk are refused, near the mode "
                "from "
                "b ~ 55 on (c = 0; a tilt c moves the mass to smaller x, where the series is exact). "
                "A saddle-point method for large b is not implemented."
            )
        return log_p.to(dtype)
