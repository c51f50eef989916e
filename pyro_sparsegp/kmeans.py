"""Transitional alias of :mod:`pyro_sparsegp.inducing.init` (shapes there)."""

# transitional: removed when layers/ and infer/ import pyro_sparsegp.covariances
from .inducing.init import kmeans  # noqa: F401
