"""Inducing variables as data and shapes (:mod:`~pyro_sparsegp.inducing.variables`: points, patches, indexed patches,
sums of them) and their initialisation (:mod:`~pyro_sparsegp.inducing.init`: one torch k-means, no scipy;
:mod:`~pyro_sparsegp.inducing.selection`: :func:`select` among the training inputs, by the greedy conditional
variance of Burt, Rasmussen, van der Wilk 2020, k-means or random rows).

Shapes: ``Z`` ``[M, d]`` (one set shared by the outputs) or ``[L, M, d]`` (one set per output). Their covariances
``Kuu`` ``[(L,) M, M]`` and ``Kuf`` ``[..., (L|1,) M, B]`` are rules of :mod:`pyro_sparsegp.covariances`, registered
per (inducing type, kernel type) (Hensman, Matthews, Ghahramani 2015, eq. 19; van der Wilk et al. 2017, eqs. 12-13).
"""

from .init import init_patches, kmeans
from .selection import greedy_variance, select
from .variables import (
    IndexedInducingPatches,
    InducingPatches,
    InducingPoints,
    InducingSum,
    InducingVariables,
    as_inducing,
)

__all__ = [
    "InducingVariables",
    "InducingPoints",
    "InducingPatches",
    "IndexedInducingPatches",
    "InducingSum",
    "as_inducing",
    "kmeans",
    "init_patches",
    "select",
    "greedy_variance",
]
