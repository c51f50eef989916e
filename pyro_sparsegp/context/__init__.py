"""Run-time context of the layers, plumbing that a Pyro program around them relies on:

* :mod:`~pyro_sparsegp.context.composition`: the layer contract (:func:`~.composition.layer_method`, hyperparameters
  drawn once per program, cache keys :func:`~.composition.values_key`, :class:`~.composition.BoundModule`) and the
  data plate :func:`plate`, which joins a plate of the same name that the program already drew;
* :mod:`~pyro_sparsegp.context.naming`: unique module names, and never two live modules reading one set of
  parameters;
* :mod:`~pyro_sparsegp.context.reporting`: where a warning comes from (the layer, ``fit``'s step, the user's line),
  and each cause reported once;
* :mod:`~pyro_sparsegp.context.deferred`: the deferred numerical checks of ``fit`` on an accelerator.

``ps.context`` exports what a user calls (``ps.context.plate`` in a guide); the rest is importable from its module.
"""

from .composition import plate

__all__ = ["plate"]
