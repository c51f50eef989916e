r"""``fit``'s natural-gradient options, resolved in one place: the step length (``NaturalPolicy.lr``, ``"auto"`` per
likelihood and layer type), its warm-up (:mod:`~pyro_sparsegp.infer.natgrad.schedules`), the positive-definite step
(``retraction``, Lin, Schmidt, Khan 2020; :func:`~pyro_sparsegp.infer.natgrad.from_grads.natgrad_from_grads_`),
which layers' families take natural steps, and the iterate average at the end
(:mod:`~pyro_sparsegp.infer.natgrad.averaging`).

The ``"auto"`` policy (measured by ``benchmarks/natgrad_nonconjugate.py``; see :func:`resolve_natgrad`):

* a :class:`~pyro_sparsegp.Gaussian` or :class:`~pyro_sparsegp.PolyaGammaLogit` likelihood on the closed-form bound
  (conjugate given the bound: the plain step's precision is positive definite by itself): step length 0.1, the
  plain step (exact at length 1), on the module's own families (a DeepGP's last layer); no warm-up, but a single
  layer's first steps are the running average of
  :class:`~pyro_sparsegp.infer.natgrad.schedules.RunningAverageStart` (:math:`\max(0.1, 1/(k+1))`): a length-1 first
  step is exact there, and the running mean of the first minibatches' optima beats a 10% pull from the prior
  (``NaturalPolicy(warmup=0)`` gives the constant step);
* every other likelihood on the closed-form bound (Bernoulli, robust-max, softmax): natural steps of length
  :data:`AUTO_NONCONJUGATE_LR` with the positive-definite step and a warm-up of :data:`AUTO_WARMUP` steps, except
  robust-max on minibatches under :data:`AUTO_MIN_BATCH_FRACTION` of the data, and robust-max on inducing patches
  (convolutional and TICK models, at any minibatch), which get Adam (``None``). Robust-max is not log-concave: its
  natural step follows a curvature that one small minibatch estimates poorly. On patches natural steps lost at every
  size measured: the README's weighted-conv model (M = 100, 5x5 patches, ``normalisation="mean"``) on 1,500 of the
  bundled MNIST images, N / B = 23, 300 steps: test accuracy 0.378 (Adam 0.906) on the next 500 images, its loss
  rising from step 100 on; TICK on the same images, 150 steps: 0.784 (0.878). Measured
  (accuracy on 1,000 test images after 400 steps, lr 0.01; Adam in brackets): robust-max SVGP, M = 100, on 8,000
  Fashion-MNIST images (``benchmarks/convgp_mnist.py``'s RBF and TICK models) at N / B = 16 0.849 (0.838), 31 0.844
  (0.829), 62 0.821 (0.820; test LL -0.73 against -0.64), 125 0.803 (0.814; 0.818 against 0.837 at 1,500 steps);
  TICK at N / B = 125 0.634 (0.770), and no better with steps of 0.03 (0.713) or 0.01 (0.696). The log-concave
  likelihoods gain at small minibatches too: softmax on the same RBF model at N / B = 125 0.807 (0.794), test LL
  -0.542 (-0.583); Bernoulli on a 2-D toy set (3,000 points, M = 20) at N / B = 94, 47 and 12 test LL -0.189,
  -0.179, -0.173 (-0.202, -0.183, -0.177). Digits (N / B = 1 and 19) gain with either likelihood. The one
  counter-example seen: robust-max with 2 classes on that toy set lost at every size (-0.55, -0.47, -0.41 against
  -0.26, -0.28, -0.31), so the fraction is a rule of thumb, not a guarantee; ``natgrad=None`` chooses Adam;
* a Pyro ELBO passed as ``elbo``: natural gradients off (``None``), as before;
* a deep GP: natural steps on the last layer only (``layers="auto"`` is ``"last"``); ``"all"`` adds the
  hidden layers from half the steps on (``hidden_start="auto"``, :data:`AUTO_HIDDEN_START`; Adam trains them
  before, in the same Adam state) and averages their iterates over the last tenth of the steps before the exact
  finish of the last layer (``average="auto"``, :data:`AUTO_HIDDEN_AVERAGE`). Measured on kin8nm
  (``benchmarks/natgrad_nonconjugate.py --part dgp``: Salimbeni's protocol, M = 100, 5,000 steps, the exact finish;
  test log-likelihood minus the default's, paired by seed; CPU and GPU seeds draw different numbers, so they pair
  only with their own device's):

  - DGP 3, every layer from the first step (``hidden_start=0``, no average; what ``"all"`` did before):
    -0.010 (standard error 0.005; seeds 0-3), a bound higher by 0.018 nats per point. Run on to 10,000 steps
    (seed 0), it stops improving at a bound of -0.120 by step 7,500 (test log-likelihood 1.354) and the default
    passes it (-0.109 and 1.376): the hidden layers, fitted to hyperparameters that had not settled, were pruned
    (the first hidden layer's kernel variance 0.48 against 2.78, half its length-scales above 90 against one);
  - DGP 3, hidden layers from half the steps on, no average (``average=None``): -0.009 (0.0045) on the H100's seeds
    4-9 and +0.002, +0.004, -0.003, +0.000 on the CPU's seeds 0-3 (-0.005, 0.003 over all ten), bounds higher by
    0.011; from 80% of the steps on: -0.011 (0.004; H100 seeds 4-9), bound +0.001. Every variant raised the bound
    and lowered the test log-likelihood on average: the last iterate of a hidden layer's natural steps (length 0.1,
    from a Monte Carlo gradient) is one draw of a fluctuation about the plateau;
  - DGP 3 as ``"all"`` ships (half the steps, then the average of the last tenth), CPU seeds 0-19: level with the
    default, -0.0003 (standard error 0.0011; ahead on ten seeds by up to 0.013, behind on nine by up to 0.010; seeds
    0-5 gave +0.004, seeds 6-11 -0.002, seeds 12-19 -0.002), and a bound higher by 0.010 to 0.022 nats per point on
    every seed (seed 4 from a script that ran the same steps and the same average, ``fit`` for the others; the rows
    are in ``benchmarks/records/natgrad_dgp_kin8nm.json``). Averaging the default's Adam iterates the same way gave
    -0.002 and +0.004 (seeds 2, 4), and an average over the last quarter mixed in iterates from before the
    hyperparameters settled (1.364 and 1.376 for every layer, 1.367 and 1.367 for the default);
  - DGP 2 as ``"all"`` ships, CPU seeds 0-19: level with the default, +0.0004 (standard error 0.0010; ahead on
    eleven seeds by up to 0.007, behind on eight by up to 0.011), bounds higher by 0.006 to 0.020 on every seed;
    earlier, every layer from the first step was as good (1.33 and 1.33 against 1.33 and 1.32).

  No failure (no ``NonFiniteLossError``, no damped step, every average used where recorded) in any of these
  runs, 20 seeds of each model as ``"all"`` ships among them; earlier, none over 20 seeds x 1,000 steps of DGP 2 and
  3 with every layer from the first step. The default stays ``"last"``: ``"all"`` buys a higher bound, not a better
  predictive, for about 3% more wall time (DGP 3, 19 paired CPU seeds).
"""

from __future__ import annotations

import math

from .averaging import IterateAverage
from .control import StepControl
from .families import natgrad_families
from .natural_policy import NaturalPolicy
from .schedules import Cooldown, LogLinearWarmup, RunningAverageStart

__all__ = ["resolve_natgrad", "NatGradPlan", "all_layer_families", "AUTO_NONCONJUGATE_LR", "AUTO_WARMUP",
           "AUTO_MIN_BATCH_FRACTION", "AUTO_HIDDEN_START", "AUTO_HIDDEN_AVERAGE"]

AUTO_NONCONJUGATE_LR = 0.1  # the step length "auto" gives a non-conjugate likelihood on the closed-form bound
AUTO_WARMUP = 5  # steps of the log-linear warm-up from 1e-4 that "auto" gives it: the paper's 5 (on digits a
# 20-step ramp was no more accurate at 100 steps, benchmarks/natgrad_nonconjugate.py)
AUTO_MIN_BATCH_FRACTION = 1 / 32  # "auto" gives robust-max natural steps only for B / N at least this
AUTO_HIDDEN_START = 0.5  # layers="all": the fraction of the steps after which the hidden layers join
AUTO_HIDDEN_AVERAGE = 0.1  # layers="all", average="auto": the last fraction of the steps whose hidden
# iterates are averaged (beside the exact finish of the last layer)
AUTO_COOLDOWN = 0.5  # cooldown="auto": the last half of the steps of non-conjugate natural steps decay
COOLDOWN_FACTOR = 0.1  # the step lengths at the end of a cooldown, relative to their held values


def _on_patches(module) -> bool:
    """Whether ``module`` has inducing patches (a convolutional or TICK model, a conv + RBF sum, a deep conv GP):
    ``"auto"`` leaves their robust-max q(u) to Adam (module docstring). No tensors, so shapes do not apply."""
    from ...inducing import InducingPatches

    return any(isinstance(m, InducingPatches) for m in module.modules())


def all_layer_families(module) -> list:
    """Every full-covariance :class:`~pyro_sparsegp.variational.GaussianQ` in ``module`` (all layers of a deep GP,
    not only those of ``module.natgrad_families()``). Returns a list of modules (``u_loc [..., M]``, ``u_scale_tril
    [..., M, M]``), the families of Hensman, Fusi, Lawrence 2013, section 3.2."""
    from ...variational import GaussianQ

    return [m for m in module.modules() if isinstance(m, GaussianQ) and m.learn_scale]


def resolve_natgrad(module, natgrad_lr, elbo, default_elbo, *, warmup="auto", retraction="auto", layers="auto",
                    average="auto", num_steps=0, batch_fraction=None, hidden_start="auto", cooldown=None):
    """``(natgrad_lr, plan)``: the step length after the warm-up (a float, or ``None``: natural gradients off) and
    the :class:`NatGradPlan` for ``fit`` (module docstring for ``"auto"``). ``elbo``: ``fit``'s argument;
    ``default_elbo``: what ``fit`` would use without one (``"analytic"`` or a Pyro ELBO); ``batch_fraction``: ``B / N``
    (``None``: unknown, taken as large enough). No tensors, so shapes do not apply. Implements the choices of
    Salimbeni, Eleftheriadis, Hensman (2018) and Lin, Schmidt, Khan (2020)."""
    from ...likelihoods import Gaussian, PolyaGammaLogit, RobustMax

    NaturalPolicy(lr=natgrad_lr, warmup=warmup, retraction=retraction, layers=layers, hidden_start=hidden_start,
                  average=average, cooldown="auto" if cooldown is None else cooldown)  # the checks, naming the field
    analytic = (elbo is None or elbo == "analytic") and default_elbo == "analytic"
    # conjugate given the bound: Gaussian, and Polya-Gamma's augmented bound (Gaussian in u given omega, whose
    # data term's curvature is negative semi-definite): the plain step is positive definite by itself
    conjugate = isinstance(getattr(module, "likelihood", None), (Gaussian, PolyaGammaLogit))
    if isinstance(natgrad_lr, str) and natgrad_lr == "auto":
        natgrad_lr = None
        small_batch = batch_fraction is not None and batch_fraction < AUTO_MIN_BATCH_FRACTION
        robustmax = isinstance(getattr(module, "likelihood", None), RobustMax)
        if analytic and natgrad_families(module) and not (robustmax and (small_batch or _on_patches(module))):
            natgrad_lr = 0.1 if conjugate else AUTO_NONCONJUGATE_LR
        auto_on = natgrad_lr is not None
    else:
        auto_on = False
    running_start = warmup == "auto" and conjugate and analytic  # exact at length 1: RunningAverageStart
    if warmup == "auto":
        warmup = AUTO_WARMUP if auto_on and not conjugate else 0
    if retraction == "auto":
        retraction = None  # per family: see NatGradPlan.retract
    elif callable(retraction) and not isinstance(retraction, bool):
        raise ValueError("NaturalPolicy.retraction under fit must be True, False or 'auto' (a function family -> bool "
                         "is NaturalGradient's)")
    plan = NatGradPlan(module, int(warmup), retraction, layers, average, num_steps, conjugate and analytic,
                       running_start, _hidden_start(hidden_start, num_steps))
    if natgrad_lr is not None and not (conjugate and analytic):  # the step control of control.py
        plan.control = StepControl(start=int(warmup))
    if isinstance(cooldown, str) and cooldown == "auto":
        cooldown = AUTO_COOLDOWN if natgrad_lr is not None and not (conjugate and analytic) else None
    plan.cooldown = _cooldown(cooldown)
    return natgrad_lr, plan


def _cooldown(cooldown) -> float:
    """The last fraction of the steps over which the step lengths decay (:class:`~.schedules.Cooldown`): ``None``
    or ``0`` for none (checked by :class:`~.natural_policy.NaturalPolicy`). No tensors, so shapes do not apply."""
    return 0.0 if cooldown is None else float(cooldown)


def _hidden_start(hidden_start, num_steps: int) -> int:
    """The step from which ``layers="all"`` steps the hidden layers' families (``"auto"``: half the steps,
    :data:`AUTO_HIDDEN_START`); no tensors, so shapes do not apply."""
    if isinstance(hidden_start, str) and hidden_start == "auto":
        return int(AUTO_HIDDEN_START * num_steps)
    return int(hidden_start)


class _Controlled:
    """A schedule times the step control's multiplier (floats; no tensors, so shapes do not apply)."""

    def __init__(self, base, control):
        self.base, self.control = base, control
        self.target, self.steps = getattr(base, "target", None), getattr(base, "steps", 0)

    def __call__(self, step: int) -> float:
        return self.base(step) * self.control.scale

    def __repr__(self) -> str:
        return f"{self.base!r} x {self.control.scale:g}"


class NatGradPlan:
    """What ``fit`` does with the natural-gradient families and the noise beyond a constant step (Salimbeni,
    Eleftheriadis, Hensman 2018's warm-up; Lin, Schmidt, Khan 2020's positive-definite step; Polyak-Ruppert averaging
    of the natural parameters of Hensman, Fusi, Lawrence 2013, section 3.2): built by
    :func:`resolve_natgrad`, then :meth:`start` once the families are known. No tensors of its own (the average's are
    in :class:`~pyro_sparsegp.infer.natgrad.averaging.IterateAverage`), so shapes do not apply."""

    def __init__(self, module, warmup, retraction, layers, average, num_steps, conjugate, running_start=False,
                 hidden_start=0):
        self.module, self.warmup, self.retraction, self.layers = module, warmup, retraction, layers
        self.average_auto = isinstance(average, str)  # "auto": AUTO_HIDDEN_AVERAGE where resolve_average says
        self.average = None if self.average_auto else average
        self.num_steps, self.conjugate = num_steps, conjugate
        self.running_start = running_start  # warmup="auto" on a conjugate step: RunningAverageStart
        self.hidden_start = hidden_start if layers == "all" else 0  # the step from which hidden families join
        self.schedule, self.averager, self._hidden = None, None, set()
        self.finished = False  # fit ends with the exact finish (set by resolve_average): average only hidden()
        self.cooldown = 0.0  # the last fraction of the steps whose lengths decay to COOLDOWN_FACTOR (Adam's too)
        self.control = None  # a StepControl: halves every step length when the bound collapses (control.py)

    def families(self) -> list:
        """The families that take natural steps: ``layers="all"`` every full-covariance ``GaussianQ``, else
        the module's own choice (:func:`~pyro_sparsegp.infer.natgrad.families.natgrad_families`; a DeepGP's last layer).
        Returns a list of modules (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``)."""
        if self.layers == "all":
            return all_layer_families(self.module)
        return natgrad_families(self.module)

    def start(self, families, noise_lik, natgrad_lr) -> None:
        """Fix the schedule (a :class:`~pyro_sparsegp.infer.natgrad.schedules.LogLinearWarmup` to ``natgrad_lr``), the
        families off the likelihood's layer (for the ``"auto"`` positive-definite step) and the averager (if
        ``average``: of ``families`` and the noise, or with the exact finish (:attr:`finished`) of the :meth:`hidden`
        families only).
        ``families``: modules (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``); ``noise_lik``: a Gaussian
        likelihood with a scalar ``()`` noise, or ``None``."""
        own = {id(q) for q in natgrad_families(self.module)}
        # a step exact at length 1 (the module's own families, no hidden layer whose samples make it Monte Carlo)
        exact = self.running_start and all(id(q) in own for q in all_layer_families(self.module))
        if natgrad_lr:
            self.schedule = (RunningAverageStart(natgrad_lr) if exact
                             else LogLinearWarmup(natgrad_lr, self.warmup, min(1e-4, natgrad_lr)))
            if self.cooldown:
                self.schedule = Cooldown(self.schedule, self.cooldown_start, self.num_steps, COOLDOWN_FACTOR)
            if self.control is not None:
                self.schedule = _Controlled(self.schedule, self.control)
        self._hidden = {id(q) for q in families if id(q) not in own}
        if self.finished:  # the exact finish sets the module's own families and the noise: average the hidden ones
            families, noise_lik = self.hidden(families), None
        if self.average is not None and (families or noise_lik is not None):
            start = self.num_steps - max(1, math.ceil(self.average * self.num_steps))
            self.averager = IterateAverage(families, [noise_lik] if noise_lik is not None else [], start=start,
                                           warn=not self.average_auto)  # "auto": fit's progress line says it

    def resolve_average(self, finished: bool) -> None:
        """Record whether the run ends with the exact finish and resolve ``average="auto"``: the last
        :data:`AUTO_HIDDEN_AVERAGE` of the steps for a deep GP's :meth:`hidden` families under
        ``layers="all"`` beside the exact finish of its last layer, else no average. No tensors, so shapes do
        not apply."""
        self.finished = finished
        if self.average_auto:
            self.average = AUTO_HIDDEN_AVERAGE if finished and self.hidden(self.families()) else None

    def hidden(self, families) -> list:
        """The families among ``families`` beyond the module's own (the hidden layers' of a deep GP under
        ``layers="all"``; none otherwise). ``families``: modules (``u_loc [..., M]``, ``u_scale_tril
        [..., M, M]``); returns a sublist."""
        if self.layers != "all":
            return []
        own = {id(q) for q in natgrad_families(self.module)}
        return [q for q in families if id(q) not in own]

    def late(self, families) -> list:
        """The families among ``families`` that join the natural steps only at step :attr:`hidden_start` (the
        :meth:`hidden` ones, if it is after the first step; Adam trains them before). ``families``: modules (``u_loc
        [..., M]``, ``u_scale_tril [..., M, M]``); returns a sublist."""
        return self.hidden(families) if self.hidden_start else []

    def active(self, step: int, families) -> list:
        """The families among ``families`` that take a natural step at step ``step``: all of them from
        :attr:`hidden_start` on, before it those not in :meth:`late`. ``families``: modules (``u_loc [..., M]``,
        ``u_scale_tril [..., M, M]``); returns a sublist."""
        if step >= self.hidden_start:
            return list(families)
        late = {id(q) for q in self.late(families)}
        return [q for q in families if id(q) not in late]

    @property
    def cooldown_start(self) -> int:
        """The first step of the decay (``num_steps`` without one; an ``int``, so shapes do not apply)."""
        return self.num_steps - int(round(self.cooldown * self.num_steps))

    def adam_multiplier(self, step: int) -> float:
        """The factor of Adam's learning rate at ``step``: 1, then over the cooldown the same log-linear decay to
        :data:`COOLDOWN_FACTOR` as the natural steps (:class:`~.schedules.Cooldown`), times the step control's scale
        (a float; no tensors, so shapes do not apply)."""
        scale = 1.0 if self.control is None else self.control.scale
        if not self.cooldown or step < self.cooldown_start:
            return scale
        span = max(self.num_steps - self.cooldown_start, 1)
        return scale * COOLDOWN_FACTOR ** (min(step - self.cooldown_start, span) / span)

    def observe(self, first_step: int, losses) -> list:
        """Feed the losses read back (floats of steps ``first_step, ...``) to the step control; returns its halvings
        ``[(step, scale)]`` (none without a control; no tensors, so shapes do not apply)."""
        return [] if self.control is None else self.control.observe(first_step, losses)

    def lr(self, step: int) -> float:
        """The natural step length at step ``step`` (after the warm-up: ``natgrad_lr``; no tensors, so shapes do not
        apply)."""
        return self.schedule(step)

    def retract(self, q) -> bool:
        """Whether family ``q`` takes the positive-definite step: ``retraction`` if given, else (``"auto"``)
        for a non-conjugate likelihood, for every family under a Pyro ELBO (a Monte Carlo gradient, with which the
        plain step diverges: :class:`~pyro_sparsegp.infer.NaturalGradient`) and for every family off the likelihood's
        layer (a deep GP's hidden layers, whose gradient is a Monte Carlo estimate), not for a Gaussian likelihood's
        own layer on the closed-form bound (the plain step is exact there). ``q``: a module (``u_loc [..., M]``,
        ``u_scale_tril [..., M, M]``); returns a bool."""
        if self.retraction is not None:
            return self.retraction
        return not self.conjugate or id(q) in self._hidden

    def after_step(self, step: int) -> None:
        """Add the iterate after step ``step`` to the average (from the averaging start on; no tensors, so shapes do
        not apply)."""
        if self.averager is not None:
            self.averager.update(step)

    def mark(self) -> None:
        """The start of a window of steps that may be redone (``fit`` on an accelerator; no tensors, so shapes do not
        apply)."""
        if self.averager is not None:
            self.averager.mark()

    def rewind(self) -> None:
        """A window is redone: drop its steps from the average (no tensors, so shapes do not apply)."""
        if self.averager is not None:
            self.averager.rewind()

    def finish(self) -> bool:
        """Write the average into the module (``average`` given and at least one step averaged; no tensors, so shapes
        do not apply)."""
        return self.averager is not None and self.averager.write_()
