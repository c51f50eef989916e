"""Inference, in three subpackages:

* :mod:`~pyro_sparsegp.infer.training`: the training loop :func:`fit` and its parts (batches, steps, guard,
  checkpoints, data-parallel, the exact finish, progress);
* :mod:`~pyro_sparsegp.infer.natgrad`: natural gradients: the optimiser :class:`NaturalGradient` for any ``SVI``
  program, ``fit``'s ``"auto"`` policy, schedules, the iterate average, and the closed-form and autodiff steps;
* :mod:`~pyro_sparsegp.infer.ep`: EP and SEP (:func:`fit_ep`), GFITC (:func:`fit_gfitc`) and MFSp (:func:`fit_mfsp`).

``ps.infer`` exports what a user calls; the rest is importable from its subpackage (``ps.infer.natgrad.natgrad_step``,
``pyro_sparsegp.infer.natgrad.policy``, ...), and from there only: the flat layout before the three subpackages is
gone.
"""

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
