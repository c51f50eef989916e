"""Checks of inputs and programs, each failing (or warning) with words that name the problem and the fix:

* :mod:`~pyro_sparsegp.checks.inputs`: the one input-conversion path (tensors, numpy, lists, pandas) and the
  precision test of a cast (:class:`InputPrecisionWarning`);
* :mod:`~pyro_sparsegp.checks.validation`: the checks of user input at the public entry points (the layers'
  constructors, ``model``/``guide``/``predict``);
* :mod:`~pyro_sparsegp.checks.matrices`: the input checks of :func:`pyro_sparsegp.linalg.cholesky`;
* :mod:`~pyro_sparsegp.checks.program`: :func:`check_model`, which traces a Pyro program around the layers and raises
  :class:`ModelShapeError` where the ELBO would count the data wrongly, with its rules in
  :mod:`~pyro_sparsegp.checks.rules`.

``ps.checks`` exports what a user calls or catches; the rest is importable from its module.
"""

from .inputs import InputPrecisionWarning
from .program import ModelShapeError, check_model

__all__ = ["check_model", "ModelShapeError", "InputPrecisionWarning"]
