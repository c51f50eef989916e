"""Expectation propagation for the multi-class robust-max GP and its baselines, each training the same module that
VI trains: :func:`fit_ep` (EP and SEP, Villacampa-Calvo and Hernández-Lobato 2017; the site updates in
:mod:`.sites`), :func:`fit_gfitc` (their GFITC baseline) and :func:`fit_mfsp` (the MFSp baseline of Hensman,
Matthews, Ghahramani 2015). The module ``pyro_sparsegp.infer.ep`` of the flat layout before it is this package,
which exports what that module did."""

from .ep import EPState, ep_log_evidence, ep_refine, ep_surrogate, fit_ep
from .gfitc import (
    GFITCConvergenceWarning,
    GFITCState,
    fit_gfitc,
    gfitc_log_evidence,
    gfitc_marginals,
    gfitc_refine,
    gfitc_surrogate,
)
from .mfsp import MFSpState, fit_mfsp, mfsp_bound

__all__ = ["fit_ep", "EPState", "ep_log_evidence", "ep_refine", "ep_surrogate", "fit_gfitc", "GFITCState",
           "GFITCConvergenceWarning", "gfitc_log_evidence", "gfitc_marginals", "gfitc_refine", "gfitc_surrogate",
           "fit_mfsp", "MFSpState", "mfsp_bound"]
