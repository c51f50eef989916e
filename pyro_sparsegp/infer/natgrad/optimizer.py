r"""A Pyro optimiser that takes natural-gradient steps on the Gaussian variational families and hands every other
parameter to an ordinary Pyro optimiser: the NGD + Adam hybrid of Salimbeni, Eleftheriadis, Hensman (2018), "Natural
gradients in practice", for any ``SVI`` program::

    svi = SVI(model, guide, ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1), Trace_ELBO())

``SVI.step`` computes the gradients of the loss :math:`\ell = -\mathcal{L}` and calls the optimiser with the
unconstrained parameters of the trace. Each full-covariance :class:`~pyro_sparsegp.variational.GaussianQ` alive in
the process (SVGP's ``q_u``, SOLVE-GP's ``q_u`` and ``q_v``, every DeepGP layer's ``q_u``; found through a registry
of weak references, :func:`~pyro_sparsegp.variational.live_gaussian_families`) whose ``u_loc`` and ``u_scale_tril``
arrive with gradients takes the step of
:func:`~pyro_sparsegp.infer.natgrad.from_grads.natgrad_from_grads_` (Hensman, Fusi, Lawrence 2013, section 3.2,
from the backward pass SVI already made: no second forward pass); the rest (kernel
hyperparameters, inducing inputs, autoguide parameters created at the first step, user ``PyroParam`` s) goes to the
wrapped optimiser. A family is recognised by the identity of its unconstrained tensors, which is what SVI hands over
both with Pyro's global parameter store and with ``pyro.settings.set(module_local_params=True)``.

SOLVE-GP's pair takes the factors' separate steps, as ``fit`` does with a Pyro ELBO: the joint mean step
(:func:`~pyro_sparsegp.infer.natgrad.joint.solvegp_joint_natgrad_from_grads_`) needs a probe set before the
forward pass, which an optimiser called after the backward pass cannot set. A learnable
:class:`~pyro_sparsegp.Gaussian` noise goes
to the wrapped optimiser, or, given ``num_obs`` (the number of observations, which SVI does not pass), takes ``fit``'s
Fisher-scoring step (:func:`~pyro_sparsegp.infer.natgrad.from_grads.noise_step_from_grads_`).
"""

from __future__ import annotations

import math
import numbers

import torch
from pyro.optim import PyroOptim

from ...checks.program import FirstStepCheck
from ...context.reporting import family_layer, in_layer
from ...likelihoods import live_gaussian_likelihoods
from ...variational import live_gaussian_families
from .averaging import IterateAverage
from .from_grads import natgrad_from_grads_, noise_step_from_grads_
from .natural_policy import NaturalPolicy, as_policy
from .policy import COOLDOWN_FACTOR
from .schedules import Cooldown, as_schedule

__all__ = ["NaturalGradient"]

_NAMES = ("u_loc", "u_scale_tril")


def _raw(q, name):
    """The unconstrained tensor behind ``q.<name>`` (the one in Pyro's store too, once the module has run)."""
    return q._parameters.get(f"{name}_unconstrained")


def split_families(params, families) -> tuple[list, set]:
    """``(stepped, claimed)``: the families among ``families`` whose parameters are among ``params`` with a gradient,
    and the ``id`` s of their unconstrained tensors (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``). A family with a
    gradient in one of the two only raises ``ValueError`` (a natural-gradient step needs both: Hensman, Fusi,
    Lawrence 2013, section 3.2); a family with no gradient in either is left alone (and not claimed)."""
    given = {id(p): p for p in params}
    stepped, claimed = [], set()
    for q in families:
        raws = [_raw(q, n) for n in _NAMES]
        graded = [r is not None and id(r) in given and r.grad is not None for r in raws]
        if not any(graded):
            continue
        if not all(graded):
            have = [n for n, g in zip(_NAMES, graded, strict=True) if g]
            lack = [n for n, g in zip(_NAMES, graded, strict=True) if not g]
            raise ValueError(
                f"NaturalGradient: the Gaussian family {q._pyro_name or type(q).__name__!r} received a gradient in "
                f"{have} but not in {lack}; a natural-gradient step needs both (is one of them blocked, hidden from "
                "the trace or frozen with requires_grad_(False)?). Unfreeze it, or pass families=[...] without it "
                "so that the wrapped optimiser trains it.")
        stepped.append(q)
        claimed.update(id(r) for r in raws)
    return stepped, claimed


def _noises(params) -> list:
    """The :class:`~pyro_sparsegp.Gaussian` likelihoods whose learnable noise (a ``PyroParam``, scalar ``()``; not a
    ``PyroSample``) is among ``params`` with a gradient: the Fisher-scoring step of Hensman et al. 2013, eq. 4."""
    given = {id(p) for p in params if p.grad is not None}
    return [lik for lik in live_gaussian_likelihoods()
            if "noise" in lik._pyro_params and id(lik._parameters.get("noise_unconstrained")) in given]


class NaturalGradient(PyroOptim):
    r"""Natural-gradient steps of length ``NaturalPolicy.lr`` on the full-covariance Gaussian families
    :math:`q(u) = N(m, LL^T)` (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``) that received gradients, the
    wrapped Pyro optimiser on every other parameter: Hensman, Fusi, Lawrence (2013), section 3.2, for the families,
    and the NGD + Adam hybrid of Salimbeni, Eleftheriadis, Hensman (2018) as a whole (module docstring).

    Under ``SVI`` the gradient is a Monte Carlo estimate (``u`` is sampled), so the precision takes the
    positive-definite step of Lin, Schmidt, Khan (2020) by default (``retraction=True``). The plain step with a sampled
    gradient diverges: its precision stays positive definite but collapses along the noise's directions, and the
    loss grows without bound (measured: SVGP and SOLVE-GP, ``Trace_ELBO`` and ``TraceMeanField_ELBO``, minibatches of
    64 and 256 of 2,000 points, step lengths 0.1 and 0.01, 3 seeds, 300 steps: all 48 runs; the positive-definite
    step converged in all 48, ``tests/infer/natgrad/test_natural_gradient_optimiser.py``). With one particle the
    outcome still depends on the seed: while q(u) is the prior, a step's sampled gradient moves its mean by about a
    prior draw, and a mean thrown far recovers slowly. Average a few particles (``num_particles=8,
    vectorize_particles=True``, as ``docs/composing.md``): on ``benchmarks/svi_hyperpriors.py`` (power plant,
    M = 128, seeds 0-2) the test RMSE after 600 steps was 1.02, 1.02, 1.01 times ``fit``'s with 8 particles and 1.03,
    1.00, 1.52 with one (after 2,000 steps 1.01, 1.00, 1.00 and 1.00, 1.00, 1.01). With a deterministic ELBO of a
    Gaussian likelihood on the full data (e.g. ``TraceMeanField_ELBO`` with ``u`` integrated out of the likelihood,
    as :class:`~pyro_sparsegp.DeepGP`'s ``marginalize_last`` does) ``retraction=False`` is exact: a step of length 1
    lands on the optimal q(u).

    :param optim: a :class:`pyro.optim.PyroOptim` (e.g. ``pyro.optim.Adam({"lr": 0.01})``) for the other parameters.
    :param natgrad: the policy, a :class:`~pyro_sparsegp.infer.NaturalPolicy` (the same object ``fit`` takes; its
        docstring documents each field and what ``"auto"`` resolves to here: step length 0.1, no warm-up, the
        positive-definite step, a cooldown over half of ``num_steps`` when ``num_steps`` is given, no average), or a
        step length in ``(0, 1]`` or a schedule ``step -> float`` (``NaturalPolicy(lr=that)``; ``step`` counts this
        optimiser's calls from 0). Its ``retraction`` may also be a function ``family -> bool`` (``fit`` passes its
        plan's). ``layers``, ``hidden_start`` and ``finish`` are ``fit``'s: other than ``"auto"`` they raise
        ``ValueError`` (select the families with ``families=``; a finish needs all the data).
    :param families: the ``GaussianQ`` modules to step (e.g. ``ps.infer.natgrad_families(dgp)``: a DeepGP's last
        layer only), or ``None`` (default): every full-covariance ``GaussianQ`` alive whose parameters SVI passes.
        Families left out are trained by ``optim``. The attribute ``families`` may be changed between steps: setting it
        to every layer's q(u) after a number of steps joins the hidden layers late, as ``fit``'s
        ``NaturalPolicy.hidden_start`` does (the wrapped optimiser then no longer receives them).
    :param int num_obs: the number of scalar observations the ELBO's likelihood term stands for (``N`` for ``y
        [N]``, ``N L`` for ``y [N, L]``): a learnable ``Gaussian`` noise with a gradient then takes the
        Fisher-scoring step of the natural step's length that ``fit`` takes (``noise_step_from_grads_``). ``None``
        (default): the noise goes to ``optim``.
    :param int num_steps: the number of steps the run will take (calls of this optimiser). Given, the last
        ``cooldown`` of them decay log-linearly to a tenth, for the natural steps and the wrapped optimiser's learning
        rates alike (:class:`~pyro_sparsegp.infer.natgrad.schedules.Cooldown`), and ``average`` (a fraction of them)
        keeps the Polyak-Ruppert average of the stepped families' natural parameters and of the stepped noises from
        step :attr:`average_from` on (:class:`~pyro_sparsegp.infer.natgrad.averaging.IterateAverage`); call
        :meth:`write_average` at the end of training to put it into the modules.

    ``get_state``/``set_state``/``save``/``load`` are the wrapped optimiser's (the natural-gradient steps keep no
    state).
    """

    def __init__(self, optim: PyroOptim, natgrad=0.1, families=None, num_obs: int | None = None,
                 num_steps: int | None = None):
        # no PyroOptim.__init__: this object holds no torch optimiser of its own, the wrapped one does
        if not isinstance(optim, PyroOptim) or isinstance(optim, NaturalGradient):
            raise TypeError(
                f"NaturalGradient wraps a pyro.optim.PyroOptim for the parameters that are not Gaussian families, "
                f"e.g. NaturalGradient(pyro.optim.Adam({{'lr': 0.01}}), natgrad=0.1); got {type(optim).__name__}"
                + (" (a torch.optim class: use its pyro.optim wrapper)" if isinstance(optim, type) or isinstance(
                    optim, torch.optim.Optimizer) else ""))
        self.policy = policy = as_policy(natgrad)
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral)
                                      or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer (the run's steps) or None, got {num_steps!r}")
        self.optim = optim
        self.schedule = _schedule(policy)
        self.num_steps, self._base_lr = num_steps, {}
        cooldown = (0.5 if num_steps is not None else None) if policy.cooldown == "auto" else policy.cooldown
        if num_steps is not None and cooldown:
            cooldown = float(cooldown)
            start = int(num_steps) - int(round(cooldown * num_steps))
            self.cooldown = Cooldown(self.schedule, start, int(num_steps), COOLDOWN_FACTOR)
            self.schedule = self.cooldown
        elif cooldown and num_steps is None:
            raise ValueError(f"NaturalPolicy.cooldown={cooldown!r} is a fraction of the run's steps: give "
                             "NaturalGradient num_steps=...")
        else:
            self.cooldown = None
        self.natgrad_lr = getattr(self.schedule, "target", None)  # the step length after the warm-up (a float)
        retraction = True if policy.retraction == "auto" else policy.retraction
        self.retraction = retraction if callable(retraction) else bool(retraction)
        self.average_from, self.average, self.step_count = _average_from(policy, num_steps), None, 0
        self.families = None if families is None else list(families)
        if num_obs is not None and (isinstance(num_obs, bool) or not isinstance(num_obs, numbers.Integral)
                                    or num_obs < 1):
            raise ValueError(f"num_obs must be a positive integer (the number of observations) or None, got "
                             f"{num_obs!r}")
        self.num_obs = num_obs
        self._check = FirstStepCheck()  # the first step checks the program SVI ran (pyro_sparsegp.checks.program)

    def __call__(self, params, *args, **kwargs) -> None:
        """One step: ``params`` is SVI's collection of unconstrained parameter tensors (gradients of the loss in
        ``.grad``). The natural-gradient steps, then the wrapped optimiser on the parameters left over."""
        params = list(params)
        self._check = self._check and self._check(params)  # once: the shapes of the program SVI ran
        families = live_gaussian_families() if self.families is None else self.families
        stepped, claimed = split_families(params, families)
        lr = self.schedule(self.step_count)
        for q in stepped:  # a warning of the step (damping) names the family's layer
            with in_layer(family_layer(q)):
                natgrad_from_grads_(q, lr, self.retraction(q) if callable(self.retraction) else self.retraction)
        noises = _noises(params) if self.num_obs is not None else []
        for lik in noises:
            noise_step_from_grads_(lik, lr, self.num_obs)
            claimed.add(id(lik.noise_unconstrained))
        rest = [p for p in params if id(p) not in claimed]
        if rest:
            self.optim(rest, *args, **kwargs)
            if self.cooldown is not None:  # the wrapped optimiser's rates for the next step follow the cooldown
                self._cool(self.cooldown.multiplier(self.step_count + 1))
        if self.average_from is not None and self.step_count >= self.average_from:
            if self.average is None:  # the families and noises stepped at the first averaged step
                self.average = IterateAverage(stepped, noises, start=self.average_from)
            self.average.update(self.step_count)
        self.step_count += 1

    def _cool(self, factor: float) -> None:
        """Set the learning rate of every torch optimiser inside the wrapped Pyro optimiser to ``factor`` times its
        first value (read when first seen; floats, so shapes do not apply)."""
        for opt in getattr(self.optim, "optim_objs", {}).values():
            for group in opt.param_groups:
                base = self._base_lr.setdefault(id(group), group["lr"])
                group["lr"] = base * factor

    def write_average(self) -> bool:
        """Write the Polyak-Ruppert average kept since step ``average_from`` into the families and noises (in place;
        :class:`~pyro_sparsegp.infer.natgrad.averaging.IterateAverage`). Returns whether there was one (``False`` before
        step ``average_from`` or without ``average_from``). No tensors in or out, so shapes do not apply."""
        return self.average is not None and self.average.write_()

    def get_state(self) -> dict:
        """The wrapped optimiser's state, ``{parameter name: optimiser state dict}`` (as ``PyroOptim.get_state``; a
        dict, not a tensor, so shapes do not apply; Salimbeni et al. 2018's hybrid keeps no state of its own)."""
        return self.optim.get_state()

    def set_state(self, state_dict: dict) -> None:
        """Restore a state from :meth:`get_state` into the wrapped optimiser (consumed as its parameters reappear; a
        dict, not a tensor, so shapes do not apply; Salimbeni et al. 2018's hybrid keeps no state of its own)."""
        self.optim.set_state(state_dict)

    def __repr__(self) -> str:
        wrapped = getattr(self.optim, "pt_optim_constructor", type(self.optim))  # pyro.optim.Adam wraps torch's Adam
        name = getattr(wrapped, "__name__", type(self.optim).__name__)
        fields = {k: getattr(self.policy, k) for k in self.policy.__dataclass_fields__
                  if k != "lr" and getattr(self.policy, k) != "auto"}
        lr = f"{self.policy.lr:g}" if isinstance(self.policy.lr, numbers.Real) else repr(self.policy.lr)
        natgrad = (lr if not fields else "NaturalPolicy(lr=" + lr
                   + "".join(f", {k}={v!r}" for k, v in fields.items()) + ")")
        extra = f", num_steps={self.num_steps}" if self.num_steps is not None else ""
        return f"NaturalGradient({name}, natgrad={natgrad}{extra})"


def _schedule(policy: NaturalPolicy):
    """The step-length schedule (``step -> float``) of ``policy`` under ``NaturalGradient`` (``"auto"``: 0.1, no
    warm-up); ``ValueError`` for a field that is ``fit``'s. No tensors, so shapes do not apply."""
    for name, why in (("layers", "pass families=[...] to select the families under SVI"),
                      ("hidden_start", "set the attribute families between steps to join layers late"),
                      ("finish", "a finish needs all the data: it is fit's")):
        if getattr(policy, name) != "auto":
            raise ValueError(f"NaturalPolicy.{name}={getattr(policy, name)!r} is fit's, not NaturalGradient's: "
                             f"leave it 'auto' here ({why})")
    if policy.lr is None:
        raise ValueError("NaturalGradient needs a step length NaturalPolicy.lr in (0, 1] or a schedule step -> float; "
                         "to train q(u) with the wrapped optimiser instead, pass that optimiser to SVI itself "
                         "(or families=[] here)")
    lr = 0.1 if policy.lr == "auto" else policy.lr
    warmup = 0 if policy.warmup == "auto" else policy.warmup
    if callable(lr) and warmup:
        raise ValueError("NaturalPolicy.warmup ramps a step length; NaturalPolicy.lr is a schedule here: give "
                         "the schedule its own warm-up (e.g. LogLinearWarmup) or a number as lr")
    return as_schedule(lr, warmup)


def _average_from(policy: NaturalPolicy, num_steps) -> int | None:
    """The first averaged step of ``policy.average`` (a fraction of ``num_steps``; ``"auto"`` or ``None``: no
    average, ``None``), as ``fit`` counts it. No tensors, so shapes do not apply."""
    if policy.average is None or policy.average == "auto":
        return None
    if num_steps is None:
        raise ValueError(f"NaturalPolicy.average={policy.average!r} is a fraction of the run's steps: give "
                         "NaturalGradient num_steps=...")
    return int(num_steps) - max(1, math.ceil(float(policy.average) * num_steps))
