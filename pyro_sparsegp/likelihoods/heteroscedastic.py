r"""Heteroscedastic likelihoods: two latent functions per observation, a location and a log scale. The
Gaussian's are the mean and the log noise standard deviation (a chained GP, Saul, Hensman, Vehtari, Lawrence 2016;
the variational heteroscedastic GP of Lázaro-Gredilla and Titsias 2011); the negative binomial's are the log mean
count and the log dispersion. Shapes follow :mod:`.multilatent`: ``f [..., 2, B]``, the observed site and the
expected log-likelihood ``[..., 1, B]``, the predictive ``[..., B]``.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import constraints

from ..linalg import gauss_hermite
from .counts import _COUNTS_FIX
from .multilatent import _VAR_FLOOR, _MultiLatent

__all__ = ["HeteroscedasticGaussian", "HeteroscedasticNegativeBinomial"]


class HeteroscedasticGaussian(_MultiLatent):
    r""":math:`y = g + e^{h} \epsilon`, :math:`\epsilon \sim N(0, 1)`, with two latent functions: ``f[..., 0, :]``
    is the mean :math:`g` and ``f[..., 1, :]`` the log noise *standard deviation* :math:`h` (``latent_dim = 2``: a
    layer infers ``num_outputs = 2``). No parameters of its own: the noise is the second GP (give it a constant mean
    function for a starting noise level other than :math:`e^0 = 1`).

    **Expected log-likelihood**, closed form under :math:`q(g) q(h) = N(m_g, v_g) N(m_h, v_h)` (the data term of
    the chained-GP bound of Saul, Hensman, Vehtari, Lawrence 2016, "Chained Gaussian processes", which is that of
    Hensman, Matthews, Ghahramani 2015, eq. 21, with two latents; Lázaro-Gredilla and Titsias 2011, "Variational
    heteroscedastic Gaussian process regression", use the log *variance* :math:`2h`), through
    :math:`\mathbb{E} e^{-2h} = e^{-2 m_h + 2 v_h}`:

    .. math:: \mathbb{E}_q \log p(y \mid g, h) = -\tfrac12 \log 2\pi - m_h
              - \tfrac12 \big((y - m_g)^2 + v_g\big)\, e^{-2 m_h + 2 v_h}.

    **Predictive**: :math:`p(y_*) = \int N(y_*; m_g, v_g + e^{2h}) N(h; m_h, v_h) dh` (``g`` integrated exactly),
    by Gauss-Hermite quadrature over :math:`h` with :meth:`num_nodes` nodes: a ``MixtureSameFamily`` of Normals,
    batch ``[..., B]``, whose mean is :math:`m_g` exactly and whose variance is
    :math:`v_g + \sum_i w_i e^{2 h_i} \approx v_g + e^{2 m_h + 2 v_h}`.

    Shapes: ``f`` and the marginals ``[..., 2, B]``; ``y`` ``[B]``, ``[..., 1, B]`` or ``[..., B]``;
    :meth:`expected_log_prob` ``[..., 1, B]``; :meth:`predictive` batch ``[..., B]``.

    :param int num_gh: Gauss-Hermite nodes of the predictive (and, per latent, of the generic
        :meth:`quadrature_expected_log_prob`).
    """

    def __init__(self, num_gh: int = 20):
        super().__init__(2, num_gh)

    def _flat_distribution(self, f):
        return dist.Normal(f[..., 0, :], f[..., 1, :].exp())

    def expected_log_prob(self, y, f_loc, f_var):
        """The closed form of the class docstring, ``[..., 1, B]`` for marginals ``[..., 2, B]``."""
        self._check_f(f_loc)
        y = self._as_values(self._site_shaped(y, f_loc), f_loc)
        m_g, m_h = f_loc[..., 0:1, :], f_loc[..., 1:2, :]
        v_g, v_h = f_var[..., 0:1, :], f_var[..., 1:2, :]
        return -0.5 * math.log(2 * math.pi) - m_h - 0.5 * ((y - m_g).pow(2) + v_g) * (2 * v_h - 2 * m_h).exp()

    def predictive(self, f_loc, f_var):
        """The Gauss-Hermite mixture over the noise latent of the class docstring, batch ``[..., B]``."""
        self._check_f(f_loc)
        f_loc, f_var = torch.broadcast_tensors(f_loc, f_var)
        m_g, m_h = f_loc[..., 0, :], f_loc[..., 1, :]
        v_g, v_h = f_var[..., 0, :].clamp(min=0), f_var[..., 1, :].clamp(min=_VAR_FLOOR)
        x, w = gauss_hermite(self.num_nodes(v_h), f_loc.dtype, f_loc.device)
        h = m_h.unsqueeze(-1) + v_h.sqrt().unsqueeze(-1) * x  # [..., B, n]
        scale = (v_g.unsqueeze(-1) + (2 * h).exp()).sqrt()
        component = dist.Normal(m_g.unsqueeze(-1).expand_as(scale), scale)
        return dist.MixtureSameFamily(dist.Categorical(probs=w.expand(scale.shape)), component)


class HeteroscedasticNegativeBinomial(_MultiLatent):
    r"""Counts whose over-dispersion varies with the inputs: a negative binomial of mean :math:`\mu = e^{g}` and
    dispersion :math:`\alpha = e^{h}`, with two latent functions, ``f[..., 0, :]`` the log mean :math:`g` and
    ``f[..., 1, :]`` the log dispersion :math:`h` (``latent_dim = 2``: a layer infers ``num_outputs = 2``). The
    chained-GP construction of Saul, Hensman, Vehtari, Lawrence 2016 ("Chained Gaussian processes") applied to the
    negative binomial whose dispersion is a function of the covariates (the "heterogeneous" or "generalized"
    negative binomial of count regression: Hilbe 2011, "Negative Binomial Regression"; Cameron and Trivedi 2013,
    "Regression Analysis of Count Data"), with a GP in place of the linear predictor of :math:`\log \alpha`.

    * ``variance="NB2"`` (default, as :class:`~.NegativeBinomial`): variance :math:`\mu + \alpha \mu^2`,
      ``NegativeBinomial(total_count=e^{-h}, logits=g + h)``;
    * ``variance="NB1"``: variance :math:`\mu (1 + \alpha)`, ``NegativeBinomial(total_count=e^{g - h}, logits=h)``.

    No parameters of its own: the dispersion is the second GP (give the layer a constant mean function
    ``Constant(2, [log mean count, log alpha0])`` to start it elsewhere than :math:`\alpha = 1`).

    **Expected log-likelihood** (the data term of Hensman, Matthews, Ghahramani 2015, eq. 21, with two latents):
    the product Gauss-Hermite rule with ``num_gh`` nodes per latent (:func:`~.multilatent.gaussian_rule`); no closed
    form exists (:math:`\log \Gamma(y + r)` of a log-normal :math:`r`). Its error against an 80-node-per-latent
    rule (scipy's probability mass function) is measured in ``tests/likelihoods/test_heteroscedastic_counts.py``:
    with the default 10 nodes, below ``1e-9`` nats at latent standard deviations of 0.5 and ``1e-5`` at 1 (counts
    up to 40, log means in :math:`[-1, 3]`, log dispersions in :math:`[-2, 1]`). **Predictive**: the same rule's
    mixture of negative binomials (:class:`~.QuadratureMixture`), batch ``[..., B]``.

    Shapes: ``f`` and the marginals ``[..., 2, B]``; ``y`` ``[B]``, ``[..., 1, B]`` or ``[..., B]`` (non-negative
    integers); :meth:`expected_log_prob` ``[..., 1, B]``; :meth:`predictive` batch ``[..., B]``.

    :param str variance: ``"NB2"`` or ``"NB1"`` (above).
    :param int num_gh: Gauss-Hermite nodes per latent (``num_gh ** 2`` points per observation).
    """

    support = constraints.nonnegative_integer
    _y_fix = _COUNTS_FIX

    def __init__(self, variance: str = "NB2", num_gh: int = 10):
        if variance not in ("NB2", "NB1"):
            raise ValueError(f"variance must be 'NB2' (mu + alpha mu^2) or 'NB1' (mu (1 + alpha)), got {variance!r}")
        super().__init__(2, num_gh)
        self.variance = variance

    def _flat_distribution(self, f):
        g, h = f[..., 0, :], f[..., 1, :]
        if self.variance == "NB1":  # r = mu / alpha, p = alpha / (1 + alpha)
            return dist.NegativeBinomial((g - h).exp(), logits=h)
        return dist.NegativeBinomial((-h).exp(), logits=g + h)  # r = 1 / alpha, odds = alpha mu
