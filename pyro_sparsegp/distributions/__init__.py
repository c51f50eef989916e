"""Torch/Pyro distributions of the package. Importing it registers the package's KL divergences."""

from . import kl  # noqa: F401
from .augmented import PolyaGammaAugmentedBernoulli
from .kl import ConditionalNormal
from .marginalized import MarginalizedLikelihood
from .polya_gamma import PolyaGamma

__all__ = ["MarginalizedLikelihood", "PolyaGamma", "PolyaGammaAugmentedBernoulli", "ConditionalNormal"]
