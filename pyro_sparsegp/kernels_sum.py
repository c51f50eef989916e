"""Transitional alias of :mod:`pyro_sparsegp.kernels.sum` (shapes and equations there)."""

# transitional: removed when layers/ and infer/ import pyro_sparsegp.covariances
from .kernels.sum import SumKernel  # noqa: F401
