"""Damping of natural-gradient steps: the step length is halved (per output) until the new precision of q(u) has a
Cholesky factor (the rule of the :mod:`pyro_sparsegp.infer.natgrad` docstring, for Hensman, Fusi, Lawrence 2013,
section 3.2), the warning that reports it, and the check of the step length."""

from __future__ import annotations

import numbers

import torch

from ...context.reporting import _warn_once

__all__ = ["NatGradDampingWarning", "check_natgrad_lr"]

_MAX_HALVINGS = 30


class NatGradDampingWarning(UserWarning):
    """A natural-gradient step was shortened so that the new precision of q(u) stays positive definite.
    A warning about the package's damping rule (module docstring): implements no paper equation."""


def check_natgrad_lr(lr) -> float:
    """``lr`` as a float in ``(0, 1]``, else ``ValueError`` naming the range. ``lr`` is a number or a one-element
    tensor (any shape with one element, e.g. ``()``); returns a Python float. The step length :math:`\\ell` of
    Hensman, Fusi, Lawrence 2013, section 3.2 (an argument check: implements no equation of its own)."""
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        lr = lr.item()
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (0.0 < float(lr) <= 1.0):
        raise ValueError(
            f"natural-gradient step length must be a number in (0, 1] (1 is the full step, exact for a Gaussian "
            f"likelihood on the full batch; 0.05-0.5 suits non-conjugate likelihoods), got {lr!r}; to train q(u) "
            "with Adam instead, pass natgrad=None"
        )
    return float(lr)


def _damped_length(theta2, target2, lr):
    """Per-output step lengths ``[...]``: ``lr``, halved until ``-2((1-r) theta2 + r target2)`` has a Cholesky
    factor (``0`` after ``_MAX_HALVINGS``: that output keeps its q(u)); see the module docstring."""
    rho = torch.full(theta2.shape[:-2], float(lr), dtype=theta2.dtype, device=theta2.device)
    for _ in range(_MAX_HALVINGS):
        r = rho[..., None, None]
        prec = -2.0 * ((1 - r) * theta2 + r * target2)
        _, info = torch.linalg.cholesky_ex(0.5 * (prec + prec.mT))
        bad = (info > 0) | ~torch.isfinite(prec).all(-1).all(-1)
        if not bool(bad.any()):
            break
        rho = torch.where(bad, 0.5 * rho, rho)
    else:
        rho = torch.where(bad, torch.zeros_like(rho), rho)
    if bool((rho < lr).any()):
        _warn_once(
            ("natgrad-damped",),
            f"natural-gradient step of length {lr:g} would have made the precision of q(u) indefinite (a "
            f"non-log-concave likelihood or too long a step); it was shortened to {float(rho.min()):.3g}. Reported "
            "once; use a smaller NaturalPolicy.lr if this recurs.",
            NatGradDampingWarning,
            stacklevel=4,
        )
    return rho


def _damp(factor, D, info, rho, lr, retraction):
    """Damping (the module docstring): halve the step ``rho [...]`` of each output whose new precision has no
    Cholesky factor (``info [...] > 0``; a non-log-concave likelihood, too long a step, a noisy gradient), at most
    ``_MAX_HALVINGS`` times, then set it to 0 (that output keeps its q); ``factor(rho)`` returns ``(D, info)`` with
    ``D [..., M, M]``. Warns once (:class:`NatGradDampingWarning`) with the remedy that applies. Returns
    ``(D, rho)``."""
    halvings = 0
    while bool((info > 0).any()) and halvings <= _MAX_HALVINGS:
        bad = info > 0
        rho = torch.where(bad, 0.5 * rho, rho) if halvings < _MAX_HALVINGS else torch.where(bad, 0.0, rho)
        D, info = factor(rho)
        halvings += 1
    if halvings:
        if retraction:  # K >= I/2 for every finite gradient: only a non-finite or overflowing one fails
            advice = ("even the positive-definite step (retraction) had no Cholesky factor, so the gradient of q was "
                      "not finite or overflowed; lower NaturalPolicy.lr and lr, or check the data")
        else:
            advice = ("if this recurs use a smaller NaturalPolicy.lr, the positive-definite step "
                      "(NaturalPolicy(retraction=True); NaturalGradient's \"auto\"), or more particles "
                      "(num_particles=8, vectorize_particles=True) when u is sampled")
        _warn_once(
            ("natgrad-damped", bool(retraction)),
            f"natural-gradient step of length {lr:g} would have made the precision of q indefinite (a "
            "non-log-concave likelihood, too long a step, or the noise of a Monte Carlo gradient when the ELBO "
            f"samples u); it was shortened to {float(rho.min()):.3g}. Reported once; {advice}.",
            NatGradDampingWarning,
            stacklevel=5,
        )
    return D, rho
