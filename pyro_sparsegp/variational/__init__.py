"""Variational strategies and families over inducing variables (GPyTorch separates them the same way: a
distribution, and a strategy that turns it into ``q(f)``).

* :mod:`~pyro_sparsegp.variational.distributions`: :class:`GaussianQ` ``q(u) = N(m, S)`` and the natural-parameter
  maps used by natural-gradient steps.
* :mod:`~pyro_sparsegp.variational.strategy`: :class:`Strategy`, the SVGP strategy (factors, prior, conditional,
  marginals and full covariance of ``q(f)``, KL), with the guide-to-model cache of
  :mod:`~pyro_sparsegp.variational.cache`.
* :mod:`~pyro_sparsegp.variational.lmc`: :class:`LMCStrategy` and :class:`OrthogonalLMCStrategy`, the linear model
  of coregionalisation over either (``Q`` latent GPs mixed into ``L`` outputs).
* :mod:`~pyro_sparsegp.variational.orthogonal`: :class:`OrthogonalStrategy`, SOLVE-GP's two sets of inducing
  variables (ODVGP as its restriction); :mod:`~pyro_sparsegp.variational.structured`: its structured-covariance view.
"""

from .cache import FactorCache, XKey, take
from .distributions import GaussianQ, from_natural, live_gaussian_families, to_natural
from .lmc import LinearMixing, LMCStrategy, OrthogonalLMCStrategy
from .orthogonal import CVV_ADVICE, OrthogonalStrategy
from .strategy import Factors, Strategy

__all__ = ["GaussianQ", "to_natural", "from_natural", "live_gaussian_families", "Strategy", "OrthogonalStrategy",
           "Factors", "FactorCache", "XKey", "take", "CVV_ADVICE", "LinearMixing", "LMCStrategy",
           "OrthogonalLMCStrategy"]
