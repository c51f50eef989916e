"""One optimisation step of :func:`~pyro_sparsegp.infer.fit`: the loss of a minibatch and its gradients, then the
update, which is :class:`~pyro_sparsegp.infer.NaturalGradient`, the Pyro optimiser that ``SVI`` programs use, so that
``fit`` and a user's ``SVI`` loop take the same steps (Salimbeni, Eleftheriadis, Hensman 2018's NGD + Adam hybrid):

* natural-gradient steps on the full-covariance Gaussian families (Hensman, Fusi, Lawrence 2013, section 3.2:
  :func:`~pyro_sparsegp.infer.natgrad.natgrad_from_grads_`) and the Fisher-scoring step on a learnable Gaussian
  noise (:func:`~pyro_sparsegp.infer.natgrad.noise_step_from_grads_`), inside ``NaturalGradient``;
* Adam on every other parameter: one ``torch.optim.Adam`` over all of them (its state is what checkpoints hold),
  handed to ``NaturalGradient`` as the wrapped ``PyroOptim`` (:class:`_TorchOptim`); without natural gradients
  it is the whole update;
* SOLVE-GP's joint mean step (:func:`~pyro_sparsegp.infer.natgrad.solvegp_joint_natgrad_from_grads_`), which
  ``NaturalGradient`` cannot take: it needs a probe set before the forward pass (:meth:`TrainingStep.gradients`
  sets it), and an optimiser is called after the backward pass.

The steps of the three parts touch disjoint parameters and read no other part's, so their order changes nothing.
"""

from __future__ import annotations

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.optim import PyroOptim

from ...likelihoods import Gaussian
from ..natgrad import (
    clear_natgrad_probes,
    natgrad_from_grads_,
    natgrad_pairs,
    noise_natgrad_likelihood,
    set_natgrad_probes,
    solvegp_joint_natgrad_from_grads_,
)
from ..natgrad.natural_policy import NaturalPolicy
from ..natgrad.optimizer import NaturalGradient
from ..natgrad.policy import resolve_natgrad
from .distributed import average_loss_and_gradients

__all__ = ["TrainingStep"]


def _default_elbo(module):
    if hasattr(module, "analytic_elbo") and getattr(module, "likelihood", None) is not None:
        return "analytic"
    return TraceMeanField_ELBO()


def _create_lazy_parameters(module, Xb, yb, num_data) -> None:
    """Run the guide, then the model on the guide's draws, once on ``(Xb [B, D], yb [B, ...])``, without gradients
    and with every RNG state restored after it (so the run is unchanged): parameters that the guide or model
    creates at its first call (an autoguide inside the module, a lazily created ``PyroParam``) then exist when the
    optimiser is built, and train like the others instead of keeping their initial values."""
    rng = pyro.util.get_rng_state()
    try:
        with torch.no_grad():
            guide_trace = pyro.poutine.trace(module.guide).get_trace(Xb, yb, num_data=num_data)
            pyro.poutine.replay(module.model, trace=guide_trace)(Xb, yb, num_data=num_data)
    finally:
        pyro.util.set_rng_state(rng)


class _TorchOptim(PyroOptim):
    """A ``PyroOptim`` over one torch optimiser built beforehand on a fixed list of parameters (``fit``'s Adam):
    a call steps every one of them that has a gradient, except those in ``skip`` (a hidden layer's family is among
    Adam's parameters until it joins the natural steps, ``NaturalPolicy.hidden_start``; from then on it is skipped), and
    the state is the torch optimiser's ``state_dict``. Takes and returns no tensor, so shapes do not apply."""

    def __init__(self, optimizer: torch.optim.Optimizer):  # no PyroOptim.__init__: no per-parameter optimisers
        self.optimizer, self.skip = optimizer, set()  # skip: ids of parameters that take natural steps now

    def __call__(self, params, *args, **kwargs) -> None:
        # every parameter of the torch optimiser with a gradient, as before, except the families that joined the
        # natural steps (``skip``: they keep their gradients for the natural step; Adam skips a None gradient)
        held = [(p, p.grad) for g in self.optimizer.param_groups for p in g["params"]
                if p.grad is not None and id(p) in self.skip]
        for p, _ in held:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in held:
                p.grad = grad

    def get_state(self) -> dict:
        return self.optimizer.state_dict()

    def set_state(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


class _Adam(torch.optim.Adam):
    """``torch.optim.Adam`` that also takes sparse gradients (a :class:`~pyro_sparsegp.layers.groups.GroupGP` with
    ``sparse=True``): such a parameter takes the lazy step of ``torch.optim.SparseAdam`` (the moments and values of
    the rows in the gradient only, bias-corrected by the parameter's own step count), the others Adam's step; one
    optimiser, so its ``state_dict`` (Adam's layout) is what checkpoints hold. Parameters of any shape ``[G, ...]``."""

    @torch.no_grad()
    def step(self, closure=None):
        held = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None or not p.grad.is_sparse:
                    continue
                grad = p.grad.coalesce()
                held.append((p, p.grad))
                p.grad = None  # Adam's step below skips it
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                rows, values = grad.indices()[0], grad.values()
                m = state["exp_avg"][rows].mul_(beta1).add_(values, alpha=1 - beta1)
                v = state["exp_avg_sq"][rows].mul_(beta2).addcmul_(values, values, value=1 - beta2)
                state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
                t = state["step"].item()
                step_size = group["lr"] * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
                p.index_add_(0, rows, m / (v.sqrt() + group["eps"]), alpha=-step_size)
        try:
            return super().step(closure)
        finally:
            for p, grad in held:
                p.grad = grad


class TrainingStep:
    """The step of one ``fit`` run over ``module``: the objective (``elbo="analytic"``: minus
    ``module.analytic_elbo``; else a Pyro ELBO's ``differentiable_loss`` of ``model``/``guide``, both on
    ``(X [B, D], y [B, ...], num_data=N)``), the optimiser, and the update (module docstring). ``natgrad_lr``:
    ``None`` (Adam on everything) or the step length in ``(0, 1]``; ``world_size > 1``: losses and gradients are
    averaged over ranks after the backward pass.

    :ivar optimizer: the ``torch.optim.Adam`` of the parameters that take no natural-gradient step (checkpointed).
    """

    def __init__(self, module, elbo, num_data: int, lr: float, natgrad_lr: float | None, world_size: int = 1,
                 plan=None):
        self.plan = plan if plan is not None else resolve_natgrad(module, natgrad_lr, elbo, elbo)[1]
        families = self.plan.families() if natgrad_lr else []
        if natgrad_lr and not families:
            raise ValueError("natural steps (NaturalPolicy.lr) need a module with a full-covariance Gaussian "
                             "variational family (q_u): pass natgrad=None for Adam")
        self.module, self.elbo, self.num_data, self.natgrad_lr, self.world_size = (
            module, elbo, num_data, natgrad_lr, world_size)
        self.noise_lik = noise_natgrad_likelihood(module) if families else None
        # SOLVE-GP layers with both q(u) and q(v⊥) in the families move their means jointly (the closed-form bound
        # carries the probe whose gradient couples them; natgrad.solvegp_joint_natgrad_from_grads_)
        # (a family frozen with requires_grad_(False) is in no pair: it stays put and its partner steps alone)
        trainable = [q for q in families if all(p.requires_grad for p in q.parameters())]
        self.pairs = natgrad_pairs(module, trainable) if elbo == "analytic" else []
        paired = {id(q) for gp in self.pairs for q in (gp.q_u, gp.q_v)}
        solo = [q for q in families if id(q) not in paired]
        self.late = self.plan.late(families)  # Adam's until they join the natural steps (NaturalPolicy.hidden_start)
        late = {id(q) for q in self.late}
        nat_ids = {id(p) for q in families if id(q) not in late for p in q.parameters()}
        if self.noise_lik is not None:
            nat_ids.add(id(self.noise_lik.noise_unconstrained))
        self.params, self.lr = list(module.parameters()), lr
        self.optimizer = _Adam([p for p in self.params if id(p) not in nat_ids], lr=lr)
        adam = self.adam = _TorchOptim(self.optimizer)
        self.plan.start(families or self.plan.families(), self.noise_lik or noise_natgrad_likelihood(module),
                        natgrad_lr)
        if not families:
            self.engine, self.handed = adam, self.params
            return
        num_obs = num_data if self.noise_lik is not None else None  # set per batch in update
        self.solo = solo
        # before the join (plan.hidden_start): the families, pairs and Adam's skipped ids, fixed once (no per-step work)
        self._early = (self.plan.active(0, solo), [gp for gp in self.pairs if id(gp.q_u) not in late])
        self._late_ids = {id(p) for q in self.late for p in q.parameters()}
        self.engine = NaturalGradient(adam, NaturalPolicy(lr=self.plan.schedule, retraction=self.plan.retract),
                                      families=solo, num_obs=num_obs)
        # what NaturalGradient is handed: not the pairs' families (their joint step is below) nor another Gaussian
        # likelihood's noise (Adam's: only the module's likelihood takes the Fisher-scoring step)
        others = {id(p) for gp in self.pairs for q in (gp.q_u, gp.q_v) for p in q.parameters()}
        others |= {id(m.noise_unconstrained) for m in module.modules() if isinstance(m, Gaussian)
                   and m is not self.noise_lik and "noise" in m._pyro_params}
        self.handed = [p for p in self.params if id(p) not in others]

    def loss(self, Xb, yb) -> torch.Tensor:
        """The loss ``()`` (minus the ELBO) of the minibatch ``Xb [B, D], yb [B, ...]``."""
        if self.elbo == "analytic":
            return -self.module.analytic_elbo(Xb, yb, num_data=self.num_data)
        return self.elbo.differentiable_loss(self.module.model, self.module.guide, Xb, yb, num_data=self.num_data)

    def gradients(self, Xb, yb, context) -> torch.Tensor:
        """The loss ``()`` of ``Xb [B, D], yb [B, ...]`` and its gradients (in the parameters' ``.grad``; forward
        and backward passes inside ``context()``), averaged over ranks; sets the SOLVE-GP probes first
        (:meth:`clear` removes them)."""
        for p in self.params:
            p.grad = None
        set_natgrad_probes(self.pairs)
        with context():
            loss = self.loss(Xb, yb)
            loss.backward()
        if self.world_size > 1:  # data-parallel: average the loss and the gradients over ranks
            loss = average_loss_and_gradients(loss, self.params + [gp.strategy.cross_probe for gp in self.pairs])
        return loss

    def grads(self) -> list:
        """The gradients of the last :meth:`gradients` (tensors of the parameters' shapes; ``None`` s left out)."""
        return [p.grad._values() if p.grad.is_sparse else p.grad for p in self.params if p.grad is not None]

    def update(self, yb, context, step: int = 0) -> None:
        """The update of step ``step`` from the gradients (module docstring), inside ``context()``; ``yb [B, ...]``
        gives the number of observations per data point for the noise's step (``N L`` for ``y [N, L]``). The
        natural step length follows fit's step count (a warm-up continues across a resume and a redone window)."""
        for group in self.optimizer.param_groups:  # Adam's rate follows the plan's cooldown (1 before it)
            group["lr"] = self.lr * self.plan.adam_multiplier(step)
        with context():
            if self.noise_lik is not None:  # y [B] or [B, L]: num_data * L observations share the noise
                per_row = (~torch.isnan(yb)).sum() / max(yb.shape[0], 1) if yb.is_floating_point() else None
                self.engine.num_obs = self.num_data * (yb.numel() // max(yb.shape[0], 1) if per_row is None
                                                       else per_row)  # missing outputs (NaN) are no observations
            pairs = self.pairs
            if isinstance(self.engine, NaturalGradient):  # late families join at hidden_start (Adam's before)
                self.engine.step_count = step
                joined = step >= self.plan.hidden_start
                self.engine.families, pairs = (self.solo, self.pairs) if joined else self._early
                self.adam.skip = self._late_ids if joined else set()
            self.engine(self.handed)
            lr, retract = (self.plan.lr(step), self.plan.retract) if pairs else (None, None)
            for gp in pairs:
                if gp.strategy.cross_probe.grad is not None:
                    solvegp_joint_natgrad_from_grads_(gp, lr, retract(gp.q_u))
                else:  # a bound that bypassed the layer's qf: the factors' own natural-gradient steps
                    natgrad_from_grads_(gp.q_u, lr, retract(gp.q_u))
                    natgrad_from_grads_(gp.q_v, lr, retract(gp.q_v))

    def clear(self) -> None:
        """Remove the SOLVE-GP probes (however the step ended)."""
        clear_natgrad_probes(self.pairs)
