"""Torch/Pyro distributions of the package. Importing it registers the package's KL divergences."""

from . import kl  # noqa: F401
from .marginalized import MarginalizedLikelihood

__all__ = ["MarginalizedLikelihood"]
