"""pyro_sparsegp: sparse variational Gaussian processes as Pyro distributions, guides and modules."""

from . import (
    bounds,
    composition,
    conditionals,
    datasets,
    deep,
    distributions,
    infer,
    kernels,
    likelihoods,
    linalg,
    mean_functions,
    variational,
)
from .deep import DeepGP
from .layers import SVGP
from .likelihoods import Bernoulli, Gaussian, Likelihood, PolyaGammaLogit
from .likelihoods_multiclass import RobustMax, Softmax
from .linalg import CholeskyJitterWarning
from .solvegp import SOLVEGP

__version__ = "0.1.0"
__all__ = [
    "SVGP",
    "SOLVEGP",
    "DeepGP",
    "Likelihood",
    "Gaussian",
    "Bernoulli",
    "PolyaGammaLogit",
    "RobustMax",
    "Softmax",
    "CholeskyJitterWarning",
    "bounds",
    "composition",
    "datasets",
    "deep",
    "conditionals",
    "distributions",
    "infer",
    "kernels",
    "likelihoods",
    "linalg",
    "mean_functions",
    "variational",
]
