r"""The last step of a non-conjugate layer: damped natural-gradient steps of q(u) on the closed-form bound of *all*
the data, the hyperparameters held, each accepted only if it raises that bound.

For a likelihood other than the Gaussian there is no closed-form optimum of q(u) (the exact finish of
:mod:`.exact_finish`), but the natural-gradient step of length 1 on the full data is the fixed-point iteration of
conjugate-computation variational inference (Khan and Lin 2017, "Conjugate-computation variational inference:
converting variational inference in non-conjugate models to inferences in conjugate models", AISTATS, eq. 10):
:math:`\theta \leftarrow \theta_{prior} + \nabla_\eta \sum_n \mathbb{E}_q \log p(y_n | f_n)`, a Newton-like step
for q(u) that converges in a few iterations for log-concave likelihoods. The minibatch iterate that the loop ends
with is one draw from the fluctuation about the plateau; these steps move it to the plateau's centre for the
final hyperparameters. With a full-data gradient the bound is deterministic (quadrature; a deep GP's hidden samples
drawn from the same seed at every evaluation), so the step is damped by backtracking: a step that lowers the bound
is undone and halved (at most :data:`MAX_HALVINGS` times), an accepted one lets the next pass try twice the length
(at most 1). The precision takes the positive-definite step of Lin, Schmidt, Khan (2020), which agrees with the
natural step to first order and keeps every trial positive definite, so a non-log-concave likelihood (robust-max)
is finished the same way.

Cost: per pass one forward and backward pass over the data (the gradient) and one forward pass per trial step (the
bound), :math:`O(NM^2)` each, in batches of the run's size.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch

from ..natgrad.families import natgrad_families
from ..natgrad.from_grads import natgrad_from_grads_
from .distributed import rank_and_world_size
from .exact_finish import resolve_finish, supports_exact_finish, untouchable

__all__ = ["natural_finish_", "natural_finish_run", "why_not_natural_finish", "resolve_any_finish", "MAX_HALVINGS",
           "DEFAULT_PASSES", "EPOCHS_PER_PASS"]

MAX_HALVINGS = 6  # a pass whose step still lowers the bound after this many halvings stops the finish
DEFAULT_PASSES = 4  # full-data natural steps at most (each one gradient pass and at least one bound pass)
EPOCHS_PER_PASS = 5  # finish="auto": one pass per this many epochs of training (the finish costs at most ~1/4 more)


def _sum_over_ranks(values: list) -> list:
    """``values`` (tensors) summed over an initialised process group's ranks (unchanged without one)."""
    if rank_and_world_size()[1] == 1 or not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values])
    torch.distributed.all_reduce(flat)
    out, i = [], 0
    for v in values:
        out.append(flat[i: i + v.numel()].reshape(v.shape))
        i += v.numel()
    return out


class _FullBound:
    """The closed-form bound of ``module`` on all of ``batches()`` (a callable returning an iterable of ``(X [B, D],
    y [B, ...])`` that covers this rank's share of the data once), as a weighted sum of minibatch bounds, each drawn
    from the same seed (a deep GP's hidden samples are then the same at every evaluation)."""

    def __init__(self, module, batches, num_data: int, seed: int):
        self.module, self.batches, self.num_data, self.seed = module, batches, num_data, seed

    @contextlib.contextmanager
    def _seeded(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            yield

    def value(self) -> float:
        """The full-data bound (a float; summed over ranks)."""
        total = None
        with torch.no_grad(), self._seeded():
            for X, y in self.batches():
                part = self.module.analytic_elbo(X, y, num_data=self.num_data) * (X.shape[0] / self.num_data)
                total = part.detach().double() if total is None else total + part.detach().double()
        return float(_sum_over_ranks([total])[0])

    def gradient_(self, params: list) -> float:
        """Put the gradient of minus the full-data bound into ``params``' ``.grad`` (summed over ranks); returns the
        bound (a float)."""
        for p in params:
            p.grad = None
        total = 0.0
        with self._seeded():
            for X, y in self.batches():
                bound = self.module.analytic_elbo(X, y, num_data=self.num_data) * (X.shape[0] / self.num_data)
                grads = torch.autograd.grad(-bound, params, allow_unused=True)
                for p, g in zip(params, grads, strict=True):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad + g
                total += float(bound.detach())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        summed = _sum_over_ranks([p.grad for p in params] + [torch.tensor(total, dtype=torch.float64)])
        for p, g in zip(params, summed, strict=False):
            p.grad = g.to(p.dtype)
        return float(summed[-1])


def natural_finish_(module, batches, num_data: int, passes: int = DEFAULT_PASSES, seed: int = 0,
                    tol: float = 1e-6) -> dict:
    r"""Damped full-data natural-gradient steps on the families of ``module`` (:func:`natgrad_families`; a DeepGP's
    last layer), in place (module docstring: the fixed point of Khan and Lin 2017, eq. 10, with the step of Hensman,
    Fusi, Lawrence 2013, section 3.2, and Lin, Schmidt, Khan 2020's positive-definite precision).

    :param module: a module with ``analytic_elbo(X, y, num_data=N)``.
    :param batches: a callable returning an iterable of ``(X [B, D], y [B, ...])`` that covers the data once.
    :param int num_data: ``N``.
    :param int passes: at most this many accepted or attempted steps.
    :param int seed: the seed of every bound evaluation (a deep GP's hidden samples).
    :param float tol: stop once a step raises the bound by less than ``tol`` per data point.
    :returns: ``{"passes": taken, "accepted": k, "before": bound, "after": bound, "lr": last length}``, the bounds
        in nats over the whole data set.
    """
    families = [q for q in natgrad_families(module) if all(p.requires_grad for p in q.parameters())]
    params = [p for q in families for p in (q.u_loc_unconstrained, q.u_scale_tril_unconstrained)]
    others = [p for p in module.parameters() if all(p is not q for q in params)]
    frozen = [p.requires_grad for p in others]
    full = _FullBound(module, batches, num_data, seed)
    report = {"passes": 0, "accepted": 0, "before": math.nan, "after": math.nan, "lr": 1.0}
    if not families:
        return report
    lr = 1.0
    try:
        for p in others:  # only q(u)'s gradient is needed: no backward pass through the hyperparameters
            p.requires_grad_(False)
        current = full.gradient_(params)
        report["before"] = report["after"] = current
        for _ in range(passes):
            report["passes"] += 1
            saved = [p.detach().clone() for p in params]
            grads = [p.grad.clone() for p in params]
            for _halving in range(MAX_HALVINGS + 1):
                with torch.no_grad():
                    for q in families:
                        natgrad_from_grads_(q, lr, retraction=True)
                new = full.value()
                if math.isfinite(new) and new >= current:
                    break
                with torch.no_grad():  # undo, halve, and try again from the same gradient
                    for p, s, g in zip(params, saved, grads, strict=True):
                        p.copy_(s)
                        p.grad = g.clone()
                lr /= 2
            else:
                break  # no length raised the bound: keep what we have
            report["accepted"] += 1
            gain, current = new - current, new
            report["after"], report["lr"] = current, lr
            if gain < tol * num_data:
                break
            lr = min(1.0, 2 * lr)
            current = full.gradient_(params)
    finally:
        for p, f in zip(others, frozen, strict=True):
            p.requires_grad_(f)
        for p in params:
            p.grad = None
        if hasattr(module, "clear_cache"):
            module.clear_cache()
    return report


def natural_finish_run(module, source, num_data: int, show: bool, passes: int = DEFAULT_PASSES, seed: int = 0) -> dict:
    """fit's last passes (:func:`natural_finish_` over ``source.one_pass()``, batches ``(X [B, D], y [B, ...])``), with
    a line on ``stderr`` where progress is shown: the steps taken, the bound before and after (nats per point) and
    the time. Returns the report (Khan and Lin 2017's fixed point, eq. 10; module docstring)."""
    start = time.perf_counter()
    report = natural_finish_(module, source.one_pass, num_data, passes=passes, seed=seed)
    if show:
        per = (report["after"] - report["before"]) / num_data
        print(f"fit: natural finish of q(u) on all {num_data} points: {report['accepted']} of {report['passes']} "
              f"full-data natural steps accepted (last length {report['lr']:.3g}), bound "
              f"{report['before'] / num_data:.5g} -> {report['after'] / num_data:.5g} per point ({per:+.2g}; "
              f"{time.perf_counter() - start:.1f} s)",
              file=sys.stderr, flush=True)
    return report


def why_not_natural_finish(module, elbo) -> str | None:
    """``None`` if :func:`natural_finish_` applies to ``module`` trained on ``elbo``, else why not (a phrase): it needs
    the closed-form bound (``analytic_elbo``, Hensman, Matthews, Ghahramani 2015, eq. 21) with a likelihood, full-
    covariance natural-gradient families none of which is frozen, and fixed hyperparameters (no ``PyroSample``). No
    tensors, so shapes do not apply."""
    if elbo != "analytic" or not hasattr(module, "analytic_elbo"):
        return "it is trained on a Pyro ELBO, not the closed-form bound"
    families = natgrad_families(module)
    if not families:
        return "it has no full-covariance q(u)"
    return untouchable(module, families)


def resolve_any_finish(module, finish, elbo, natgrad_lr, loader, average, num_steps, epochs):
    """``(kind, skipped, passes)``: how :func:`~pyro_sparsegp.infer.fit` ends. ``finish``: ``"exact"`` (a Gaussian
    layer's optimum, :mod:`.exact_finish`), ``"natural"`` (the damped full-data natural steps of this module, at most
    :data:`DEFAULT_PASSES`), ``None``, or ``"auto"``: exact where it applies (:func:`resolve_finish`), else natural for
    a module trained by natural steps on the closed-form bound from ``X, y`` or a ``dataset``, with one pass per
    :data:`EPOCHS_PER_PASS` epochs of training (at most :data:`DEFAULT_PASSES`; none under 5 epochs), no
    ``average``. ``kind`` is ``"exact"``, ``"natural"`` or ``None``; ``skipped`` says why ``"auto"`` left out a finish
    the module could take (for fit's progress line). No tensors, so shapes do not apply (Khan and Lin 2017's fixed
    point, eq. 10; module docstring)."""
    if finish not in ("auto", "exact", "natural", None):
        raise ValueError(f'NaturalPolicy.finish must be "auto", "exact", "natural" or None, got {finish!r}')
    if finish in ("exact", None) or (finish == "auto" and supports_exact_finish(module)):
        done, skipped = resolve_finish(module, finish, elbo, natgrad_lr, loader, average, num_steps, epochs)
        return ("exact" if done else None), (skipped and f"no exact finish: {skipped}"), 0
    reason = why_not_natural_finish(module, elbo)
    if finish == "natural":
        if reason is not None:
            raise ValueError(f'NaturalPolicy(finish="natural") cannot finish this module: {reason}')
        if average is not None:
            raise ValueError('NaturalPolicy.average and finish="natural" both set q(u) at the end: choose one')
        return "natural", None, DEFAULT_PASSES
    if reason is not None or num_steps == 0 or average is not None:
        return None, None, 0
    if loader is not None:
        return None, ("no natural finish: the data come from a loader, which may be endless "
                      '(NaturalPolicy(finish="natural") makes passes of it)'), 0
    if natgrad_lr is None:
        return None, ("no natural finish: q(u) was trained by Adam (natgrad=None); "
                      'NaturalPolicy(finish="natural") adds it'), 0
    passes = min(DEFAULT_PASSES, int(epochs // EPOCHS_PER_PASS))
    if passes < 1:
        return None, (f"no natural finish: the run saw {epochs:.2g} epochs, fewer than the {EPOCHS_PER_PASS} per "
                      "full-data pass that keep the finish within a quarter of the training "
                      '(NaturalPolicy(finish="natural") forces it)'), 0
    return "natural", None, passes
