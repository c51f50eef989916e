"""Transitional alias of :mod:`pyro_sparsegp.kernels.conv` (shapes and equations there)."""

# transitional: removed when layers/ and infer/ import pyro_sparsegp.covariances
from .kernels.conv import TICK, ConvKernel, _image, _pair, output_shape, patch_locations, patches  # noqa: F401
