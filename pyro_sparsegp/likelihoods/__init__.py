r"""Likelihoods: the distribution of ``y`` given latent ``f``, the expected log-likelihood under
:math:`q(f_n) = N(\mu_n, \sigma^2_n)`, and the predictive distribution.

One generic method, closed forms as overrides: :meth:`Likelihood.expected_log_prob` integrates by Gauss-Hermite
quadrature with ``num_gh`` nodes (Hensman, Matthews, Ghahramani 2015, section 4); :class:`Gaussian` overrides it
analytically. ``Likelihood.quadrature_expected_log_prob`` is always the generic quadrature, so tests can compare an
override with it.

Binary labels are ``{0, 1}`` everywhere in the package.

One module per family: :mod:`.base` (:class:`Likelihood`, the registry of live Gaussian likelihoods),
:mod:`.gaussian`, :mod:`.bernoulli`, :mod:`.polya_gamma` (:class:`PolyaGammaLogit` and the closed forms of its
augmented bound), :mod:`.counts` (:class:`Poisson`, :class:`NegativeBinomial`, :class:`ZeroInflatedPoisson`,
:class:`ZeroInflatedNegativeBinomial`), :mod:`.continuous` (:class:`StudentT`, :class:`Gamma`, :class:`Beta`),
:mod:`.multilatent` (the shapes and integration rules of likelihoods of several latent functions),
:mod:`.multiclass` (:class:`RobustMax`, :class:`Softmax`), :mod:`.heteroscedastic`
(:class:`HeteroscedasticGaussian`, :class:`HeteroscedasticNegativeBinomial`)
and :mod:`.generic` (:func:`from_distribution`: any Pyro distribution).
``docs/likelihoods.md`` is the catalogue.

Shapes: element-wise likelihoods take ``f`` ``[..., B]`` and give ``y`` ``[..., B]``; a likelihood of ``Q > 1``
latent functions (``latent_dim = Q``) takes ``f`` ``[..., Q, B]`` and its observed site is ``[..., 1, B]``.
"""

from .base import Likelihood, _check_finite, live_gaussian_likelihoods  # noqa: F401  (_check_finite: layers.py)
from .bernoulli import Bernoulli
from .continuous import Beta, Gamma, StudentT
from .counts import NegativeBinomial, Poisson, ZeroInflatedNegativeBinomial, ZeroInflatedPoisson
from .gaussian import Gaussian
from .generic import from_distribution
from .heteroscedastic import HeteroscedasticGaussian, HeteroscedasticNegativeBinomial
from .multiclass import RobustMax, Softmax
from .multilatent import QuadratureMixture, gaussian_rule
from .polya_gamma import PolyaGammaLogit, jaakkola_jordan_bound, optimal_c

__all__ = [
    "Likelihood",
    "Gaussian",
    "Bernoulli",
    "PolyaGammaLogit",
    "RobustMax",
    "Softmax",
    "Poisson",
    "NegativeBinomial",
    "ZeroInflatedPoisson",
    "ZeroInflatedNegativeBinomial",
    "StudentT",
    "Gamma",
    "Beta",
    "HeteroscedasticGaussian",
    "HeteroscedasticNegativeBinomial",
    "from_distribution",
    "gaussian_rule",
    "QuadratureMixture",
    "live_gaussian_likelihoods",
    "optimal_c",
    "jaakkola_jordan_bound",
]
