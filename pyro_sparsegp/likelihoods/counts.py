r"""Likelihoods of counts ``y`` in ``{0, 1, 2, ...}`` with a log link for the mean, :math:`\mu = e^f`: Poisson,
negative binomial, and their zero-inflated versions. ``f``, ``y`` and the marginals of ``q(f)`` are ``[..., B]``.

Each expected log-likelihood is the data term of Hensman, Matthews, Ghahramani 2015, eq. 21 under
:math:`q(f) = N(m, v)`; it is closed form where the log-normal moment :math:`\mathbb{E}[e^f] = e^{m + v/2}` is
all it needs (Poisson, and the non-zero counts of the zero-inflated Poisson), else Gauss-Hermite quadrature with
:meth:`~.Likelihood.num_nodes` nodes (their section 4): measured against scipy's adaptive quadrature of scipy's
probability mass functions (``tests/likelihoods/test_count_likelihoods.py``), within ``1e-5`` nats at
:math:`\sqrt{v} \le 1` and ``1e-4`` at :math:`\sqrt{v} = 2`. The predictive distributions are the Gauss-Hermite
mixtures of :meth:`~.Likelihood.predictive` (a mixture of the count distribution at the nodes).
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam
from torch.distributions import constraints

from .base import Likelihood, _init_param

__all__ = ["Poisson", "NegativeBinomial", "ZeroInflatedPoisson", "ZeroInflatedNegativeBinomial"]

_COUNTS_FIX = "; counts must be non-negative integers (0, 1, 2, ...): round or drop the others"


class _Counts(Likelihood):
    support = constraints.nonnegative_integer
    _y_fix = _COUNTS_FIX

    def _nb(self, f):
        """NB2 at log mean ``f``: ``total_count = 1 / alpha``, ``logits = f + log alpha`` (mean ``exp f``)."""
        alpha = self.dispersion
        return alpha.reciprocal(), f + alpha.log()


class Poisson(_Counts):
    r"""Counts with :math:`y \sim \mathrm{Poisson}(e^f)` (log link), no parameters.

    Expected log-likelihood, closed form (the log-normal moment :math:`\mathbb{E}_q e^f = e^{m + v/2}`):

    .. math:: \mathbb{E}_{N(f; m, v)} \log p(y \mid f) = y\, m - e^{m + v/2} - \log \Gamma(y + 1),

    the data term of Hensman, Matthews, Ghahramani 2015, eq. 21. The predictive is the Gauss-Hermite mixture of
    Poissons at the nodes (mean :math:`\approx e^{m + v/2}`). ``f``, ``y``, marginals ``[..., B]``.

    :param int num_gh: Gauss-Hermite nodes of the predictive.
    """

    def distribution(self, f):
        return dist.Poisson(f.exp())

    def expected_log_prob(self, y, f_loc, f_var):
        y = self._as_values(y, f_loc)
        return y * f_loc - (f_loc + 0.5 * f_var).exp() - torch.lgamma(y + 1)


class NegativeBinomial(_Counts):
    r"""Over-dispersed counts: the negative binomial of mean :math:`\mu = e^f` (log link) and learnable dispersion
    :math:`\alpha > 0`, variance :math:`\mu + \alpha \mu^2` (the "NB2" parameterisation of Cameron and Trivedi
    1986, "Econometric models based on count data"; Hilbe 2011, "Negative Binomial Regression"):

    .. math:: p(y \mid f) = \frac{\Gamma(y + r)}{\Gamma(r)\, y!}
              \Big(\frac{r}{r + \mu}\Big)^{r} \Big(\frac{\mu}{r + \mu}\Big)^{y}, \qquad r = 1 / \alpha,

    i.e. ``pyro.distributions.NegativeBinomial(total_count=1/alpha, logits=f + log(alpha))``. As
    :math:`\alpha \to 0` it tends to the Poisson. With ``variance="NB1"`` the variance is
    :math:`\mu (1 + \alpha)` instead (a constant over-dispersion factor: Cameron and Trivedi's NB1,
    ``total_count`` :math:`r = \mu / \alpha`, ``logits`` :math:`\log \alpha`; GPyTorch's
    ``NegativeBinomialLikelihood`` is of this form), which fits counts whose variance grows linearly with the mean
    better. Expected log-likelihood by Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani 2015, section 4);
    predictive: the Gauss-Hermite mixture. ``f``, ``y``, marginals ``[..., B]``; ``dispersion`` ``()``.

    :param float dispersion: initial :math:`\alpha`, a ``PyroParam`` constrained positive (replace it by a
        ``PyroSample`` for a hyperprior).
    :param int num_gh: Gauss-Hermite nodes.
    :param str variance: ``"NB2"`` (default, :math:`\mu + \alpha \mu^2`) or ``"NB1"`` (:math:`\mu (1 + \alpha)`).
    """

    def __init__(self, dispersion: float = 1.0, num_gh: int = 20, variance: str = "NB2"):
        super().__init__(num_gh)
        if variance not in ("NB2", "NB1"):
            raise ValueError(f"variance must be 'NB2' (mu + alpha mu^2) or 'NB1' (mu (1 + alpha)), got {variance!r}")
        self.variance = variance
        self.dispersion = PyroParam(_init_param(dispersion, "dispersion", example="NegativeBinomial(dispersion=0.5)"),
                                    constraints.positive)

    def distribution(self, f):
        if self.variance == "NB1":  # r = mu / alpha, p = alpha / (1 + alpha): mean mu, variance mu (1 + alpha)
            alpha = self.dispersion
            return dist.NegativeBinomial(f.exp() / alpha, logits=alpha.log().expand(f.shape))
        total_count, logits = self._nb(f)
        return dist.NegativeBinomial(total_count, logits=logits)


class _ZeroInflated(_Counts):
    # log(pi + (1 - pi) p(0 | f)) turns from 0 to log(pi) within about one unit of f: num_gh nodes up to sd 1, then
    # num_gh * sd (measured for the zero-inflated Poisson's zeros, pi = 0.3, worst over means in [-3, 3]: 8e-6 nats
    # at sd 1, 9e-5 at sd 2, 5e-4 at sd 3, 2e-3 at sd 4)
    _node_sd = 1.0

    def _gate(self, gate, cls):
        return PyroParam(_init_param(gate, "gate", 0.0, 1.0, f"{cls}(gate=0.2)"), constraints.unit_interval)

    def _gate_logits(self):
        return torch.logit(self.gate)


class ZeroInflatedPoisson(_ZeroInflated):
    r"""Counts with extra zeros: :math:`y = 0` with probability :math:`\pi` (the learnable ``gate``), else
    :math:`y \sim \mathrm{Poisson}(e^f)`:

    .. math:: p(0 \mid f) = \pi + (1 - \pi) e^{-e^f}, \qquad p(y \mid f) = (1 - \pi)\, \mathrm{Poisson}(y; e^f)
              \quad (y > 0)

    (Lambert 1992, "Zero-inflated Poisson regression"; ``pyro.distributions.ZeroInflatedPoisson``). Expected
    log-likelihood: closed form for :math:`y > 0`, :math:`\log(1 - \pi) + y m - e^{m + v/2} - \log\Gamma(y + 1)`;
    Gauss-Hermite quadrature for :math:`y = 0` (Hensman, Matthews, Ghahramani 2015, section 4). Predictive: the
    Gauss-Hermite mixture. ``f``, ``y``, marginals ``[..., B]``; ``gate`` ``()``.

    :param float gate: initial :math:`\pi \in (0, 1)`, a ``PyroParam`` constrained to the unit interval.
    :param int num_gh: Gauss-Hermite nodes.
    """

    def __init__(self, gate: float = 0.1, num_gh: int = 20):
        super().__init__(num_gh)
        self.gate = self._gate(gate, "ZeroInflatedPoisson")

    def distribution(self, f):
        return dist.ZeroInflatedPoisson(f.exp(), gate_logits=self._gate_logits())

    def expected_log_prob(self, y, f_loc, f_var):
        y = self._as_values(y, f_loc)
        y, f_loc, f_var = torch.broadcast_tensors(y, f_loc, f_var)
        positive = torch.log1p(-self.gate) + y * f_loc - (f_loc + 0.5 * f_var).exp() - torch.lgamma(y + 1)
        zero = self.quadrature_expected_log_prob(torch.zeros_like(y), f_loc, f_var)  # no closed form at y = 0
        return torch.where(y == 0, zero, positive)


class ZeroInflatedNegativeBinomial(_ZeroInflated):
    r"""Over-dispersed counts with extra zeros: :math:`y = 0` with probability :math:`\pi` (the learnable
    ``gate``), else :math:`y` from the :class:`NegativeBinomial` of mean :math:`e^f` and learnable dispersion
    :math:`\alpha` (NB2, variance :math:`\mu + \alpha\mu^2`; Greene 1994, "Accounting for excess zeros and sample
    selection in Poisson and negative binomial regression models"; Pyro's ``ZeroInflatedDistribution`` of the NB).
    Expected log-likelihood by Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani 2015, section 4); predictive:
    the Gauss-Hermite mixture. ``f``, ``y``, marginals ``[..., B]``; ``dispersion`` and ``gate`` ``()``.

    :param float dispersion: initial :math:`\alpha > 0` (``PyroParam``, positive).
    :param float gate: initial :math:`\pi \in (0, 1)` (``PyroParam``, unit interval).
    :param int num_gh: Gauss-Hermite nodes.
    """

    def __init__(self, dispersion: float = 1.0, gate: float = 0.1, num_gh: int = 20):
        super().__init__(num_gh)
        self.dispersion = PyroParam(
            _init_param(dispersion, "dispersion", example="ZeroInflatedNegativeBinomial(dispersion=0.5)"),
            constraints.positive)
        self.gate = self._gate(gate, "ZeroInflatedNegativeBinomial")

    def distribution(self, f):
        total_count, logits = self._nb(f)
        # Pyro's ZeroInflatedNegativeBinomial would validate probs = sigmoid(logits), which rounds to 1 in float32
        return dist.ZeroInflatedDistribution(dist.NegativeBinomial(total_count, logits=logits),
                                             gate_logits=self._gate_logits())
