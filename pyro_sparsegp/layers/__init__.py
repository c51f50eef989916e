"""The layers: thin Pyro programs (sites, plates, model/guide, the closed-form bound, prediction) over a variational
strategy (:mod:`pyro_sparsegp.variational`).

* :class:`SVGP` (:mod:`~pyro_sparsegp.layers.svgp`): Hensman, Fusi, Lawrence 2013; Hensman, Matthews, Ghahramani 2015.
* :class:`SOLVEGP` (:mod:`~pyro_sparsegp.layers.solvegp`): an SVGP with the orthogonal strategy (Shi, Titsias, Mnih
  2020); ``odvgp=True`` for ODVGP (Salimbeni et al. 2018).
* :class:`ODVGP` (:mod:`~pyro_sparsegp.layers.odvgp`): ODVGP with many mean inducing points, trained on a
  column-subsampled bound.
* :class:`DeepGP` (:mod:`~pyro_sparsegp.layers.deep`): the doubly stochastic deep GP over any stack of layers that
  speak the hidden-layer protocol; :class:`ConvLayer` and :class:`DeepConvGP` (:mod:`~pyro_sparsegp.layers.conv`):
  convolutional hidden layers and the deep convolutional GP, a ``DeepGP``.
* :class:`GPLVM` (:mod:`~pyro_sparsegp.layers.gplvm`): the Bayesian GPLVM (Titsias and Lawrence 2010) on minibatches,
  with a per-point or an amortised (encoder) guide and inference of ``q(x*)`` for new rows.
* :class:`GroupGP` (:mod:`~pyro_sparsegp.layers.groups`): a GP per group with a shared kernel beside a population
  GP, groups subsampled, a step's cost independent of the number of groups (data side:
  :mod:`~pyro_sparsegp.layers.group_data`).
"""

from ..context.naming import ParamStoreWarning
from .base import LayerData, UntrainableWarning, as_inputs
from .conv import ConvLayer, DeepConvGP
from .deep import DeepGP
from .gplvm import GPLVM
from .groups import GroupGP
from .odvgp import ODVGP
from .solvegp import SOLVEGP, OrthogonalInputs
from .svgp import SVGP

__all__ = ["SVGP", "GPLVM", "GroupGP", "SOLVEGP", "ODVGP", "DeepGP", "ConvLayer", "DeepConvGP", "OrthogonalInputs",
           "LayerData", "as_inputs", "UntrainableWarning", "ParamStoreWarning"]
