"""pyro_sparsegp: sparse variational Gaussian processes as Pyro distributions, guides and modules."""

from . import (
    bounds,
    checking,
    composition,
    conditionals,
    conv,
    covariances,
    data_stream,
    datasets,
    deep,
    distributions,
    inducing,
    infer,
    kernels,
    likelihoods,
    linalg,
    mean_functions,
    saving,
    variational,
)
from .checking import ModelShapeError, check_model
from .conv import ConvLayer, DeepConvGP
from .deep import DeepGP
from .inducing import IndexedInducingPatches, InducingPatches, InducingPoints, InducingSum
from .kernels import TICK, ConvKernel, SumKernel
from .layers import ODVGP, SOLVEGP, SVGP
from .likelihoods import Bernoulli, Gaussian, Likelihood, PolyaGammaLogit, RobustMax, Softmax
from .linalg import CholeskyJitterWarning

__version__ = "0.1.0"
__all__ = [
    "SVGP",
    "SOLVEGP",
    "ODVGP",
    "DeepGP",
    "ConvKernel",
    "TICK",
    "InducingPoints",
    "InducingPatches",
    "IndexedInducingPatches",
    "SumKernel",
    "InducingSum",
    "ConvLayer",
    "DeepConvGP",
    "Likelihood",
    "Gaussian",
    "Bernoulli",
    "PolyaGammaLogit",
    "RobustMax",
    "Softmax",
    "CholeskyJitterWarning",
    "check_model",
    "ModelShapeError",
    "bounds",
    "checking",
    "composition",
    "datasets",
    "data_stream",
    "deep",
    "conditionals",
    "conv",
    "covariances",
    "inducing",
    "distributions",
    "infer",
    "kernels",
    "likelihoods",
    "linalg",
    "mean_functions",
    "saving",
    "variational",
]
