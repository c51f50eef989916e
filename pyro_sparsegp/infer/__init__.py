"""Inference: natural-gradient steps, the ``fit`` training loop, EP/SEP (``fit_ep``), GFITC (``fit_gfitc``) and MFSp
(``fit_mfsp``)."""

from .averaging import IterateAverage
from .ep import EPState, ep_log_evidence, ep_surrogate, fit_ep
from .exact_finish import exact_finish_
from .fit import EpochBatchSampler, FitState, NonFiniteLossError, fit, load_checkpoint, save_checkpoint
from .gfitc import GFITCConvergenceWarning, GFITCState, fit_gfitc, gfitc_log_evidence, gfitc_surrogate
from .mfsp import MFSpState, fit_mfsp, mfsp_bound
from .natgrad import (
    clear_natgrad_probes,
    gaussian_natgrad_step,
    natgrad_families,
    natgrad_from_grads_,
    natgrad_pairs,
    natgrad_step,
    natgrad_step_for,
    polya_gamma_natgrad_step,
    set_natgrad_probes,
    solvegp_joint_natgrad_from_grads_,
    solvegp_natgrad_step,
)
from .natural_gradient import NaturalGradient
from .schedules import LogLinearWarmup, RunningAverageStart

__all__ = [
    "fit_ep",
    "EPState",
    "ep_log_evidence",
    "ep_surrogate",
    "fit_gfitc",
    "GFITCState",
    "GFITCConvergenceWarning",
    "gfitc_log_evidence",
    "gfitc_surrogate",
    "fit_mfsp",
    "mfsp_bound",
    "MFSpState",
    "fit",
    "FitState",
    "NonFiniteLossError",
    "EpochBatchSampler",
    "save_checkpoint",
    "load_checkpoint",
    "NaturalGradient",
    "LogLinearWarmup",
    "RunningAverageStart",
    "IterateAverage",
    "exact_finish_",
    "natgrad_step",
    "gaussian_natgrad_step",
    "polya_gamma_natgrad_step",
    "natgrad_step_for",
    "natgrad_from_grads_",
    "natgrad_families",
    "solvegp_natgrad_step",
    "solvegp_joint_natgrad_from_grads_",
    "natgrad_pairs",
    "set_natgrad_probes",
    "clear_natgrad_probes",
]
