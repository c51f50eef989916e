"""Discovery: which variational families natural-gradient steps train (Hensman, Fusi, Lawrence 2013, section 3.2),
and which Gaussian likelihood's noise takes the Fisher-scoring step beside them."""

from __future__ import annotations

from ...likelihoods import Gaussian
from ...variational import GaussianQ

__all__ = ["natgrad_families", "noise_natgrad_likelihood"]


def noise_natgrad_likelihood(module):
    """The :class:`~pyro_sparsegp.Gaussian` likelihood of ``module`` whose learnable noise
    :func:`noise_step_from_grads_` trains beside the natural-gradient families, or ``None`` (no likelihood, another
    likelihood, a frozen noise (``requires_grad_(False)``), or a noise with a prior: a ``PyroSample`` is its guide's
    to train). The step's noise is a scalar
    ``()``; the Fisher-scoring step of Hensman, Fusi, Lawrence 2013, eq. 4 in the noise precision."""
    lik = getattr(module, "likelihood", None)
    if isinstance(lik, Gaussian) and "noise" in getattr(lik, "_pyro_params", {}):
        return lik if lik.noise_unconstrained.requires_grad else None
    return None


def natgrad_families(module) -> list:
    """The variational families that natural-gradient steps train: every full-covariance
    :class:`~pyro_sparsegp.variational.GaussianQ` in ``module`` (q(u) of an SVGP; q(u) and q(v⊥) of a SOLVE-GP;
    ODVGP's mean-only q(v⊥) is not one and stays with the ordinary optimiser). A module may choose its own with a
    ``natgrad_families()`` method (:class:`~pyro_sparsegp.DeepGP`: the last layer's q(u), and its q(v⊥) if it is
    a SOLVE-GP). Returns a list of modules (each with ``u_loc`` ``[..., M]`` and ``u_scale_tril`` ``[..., M, M]``);
    the families whose natural parameters the step of Hensman, Fusi, Lawrence 2013, section 3.2, updates."""
    if hasattr(module, "natgrad_families"):
        return list(module.natgrad_families())
    return [m for m in module.modules() if isinstance(m, GaussianQ) and m.learn_scale]
