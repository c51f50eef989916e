"""Inference, in three subpackages:

* :mod:`~pyro_sparsegp.infer.training`: the training loop :func:`fit` and its parts (batches, steps, guard,
  checkpoints, data-parallel, the exact finish, progress);
* :mod:`~pyro_sparsegp.infer.natgrad`: natural gradients: the optimiser :class:`NaturalGradient` for any ``SVI``
  program, ``fit``'s ``"auto"`` policy, schedules, the iterate average, and the closed-form and autodiff steps;
* :mod:`~pyro_sparsegp.infer.ep`: EP and SEP (:func:`fit_ep`), GFITC (:func:`fit_gfitc`) and MFSp (:func:`fit_mfsp`).

``ps.infer`` exports what a user calls; the rest is importable from its subpackage. Names and module paths of the
flat layout before it (``ps.infer.natgrad_step``, ``pyro_sparsegp.infer.natgrad_options``, ...) still work and
warn with a ``DeprecationWarning`` that names the new place (:mod:`._moved`).
"""

from . import _moved
from .ep import EPState, GFITCConvergenceWarning, GFITCState, MFSpState, fit_ep, fit_gfitc, fit_mfsp
from .natgrad import NaturalGradient, NaturalPolicy, natgrad_families
from .training import Checkpoint, EpochBatchSampler, FitState, NonFiniteLossError, fit, load_checkpoint, save_checkpoint

__all__ = [
    "fit",
    "NaturalPolicy",
    "Checkpoint",
    "FitState",
    "NonFiniteLossError",
    "save_checkpoint",
    "load_checkpoint",
    "EpochBatchSampler",
    "NaturalGradient",
    "natgrad_families",
    "fit_ep",
    "EPState",
    "fit_gfitc",
    "GFITCState",
    "GFITCConvergenceWarning",
    "fit_mfsp",
    "MFSpState",
]

_moved.install(__name__)


def __getattr__(name: str):
    """A name the flat layout exported from ``ps.infer`` (e.g. ``natgrad_step``): returned from its new module with a
    ``DeprecationWarning`` that names it. No tensors, so shapes do not apply."""
    return _moved.moved_name(__name__, name)
