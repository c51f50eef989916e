"""Kernels: batched evaluation of Pyro's kernels, the convolutional kernels, sums of independent GPs.

* :mod:`~pyro_sparsegp.kernels.batched`: :func:`kernel_matrix` ``k(X, Z)`` ``[..., N, M]`` and :func:`kernel_diag`
  ``[..., N]`` of any :mod:`pyro.contrib.gp.kernels` kernel with leading batch dimensions on ``X`` ``[..., N, D]`` and
  ``Z`` ``[..., M, D]``; the package's one Matérn-3/2 (:func:`matern32`).
* :mod:`~pyro_sparsegp.kernels.matvec`: :func:`kernel_matvec` ``k(X, Z) @ a`` ``[N]`` in cache-sized blocks with
  closed-form gradients (RBF, Matérn), without the ``[N, M]`` matrix (ODVGP's mean and its subsampled KL).
* :mod:`~pyro_sparsegp.kernels.conv`: the (weighted) convolutional kernel :class:`ConvKernel` (van der Wilk et al.
  2017, eqs. 6 and 10) and :class:`TICK` (Dutordoir et al. 2020, sec. 3) on flattened images ``[..., H*W*C]``.
* :mod:`~pyro_sparsegp.kernels.sum`: :class:`SumKernel`, the kernel of a sum of independent GPs.
* :mod:`~pyro_sparsegp.kernels.separate`: :class:`Separate`, one kernel per latent GP (or output) of a layer.

The covariances of inducing variables under these kernels (``Kuu``, ``Kuf``, the diagonal of ``Kff``) are in
:mod:`pyro_sparsegp.covariances`, registered per (inducing type, kernel type).
"""

from .batched import expected_input_dim, kernel_diag, kernel_matrix, matern32, required_features
from .conv import CHUNK_ELEMENTS, TICK, ConvKernel, output_shape, patch_locations, patches
from .matvec import kernel_matvec
from .separate import Separate
from .sum import SumKernel

__all__ = [
    "kernel_matrix",
    "kernel_matvec",
    "kernel_diag",
    "expected_input_dim",
    "required_features",
    "matern32",
    "ConvKernel",
    "TICK",
    "SumKernel",
    "Separate",
    "patches",
    "patch_locations",
    "output_shape",
    "CHUNK_ELEMENTS",
]
