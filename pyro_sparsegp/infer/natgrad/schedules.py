r"""Step-size schedules for natural-gradient steps.

:class:`LogLinearWarmup` is the warm-up of Salimbeni, Eleftheriadis, Hensman (2018), "Natural gradients in
practice: non-conjugate variational inference in Gaussian process models" (AISTATS): their experiments start the
natural step at :math:`\gamma_0 = 10^{-4}` and raise it log-linearly to its target (:math:`\gamma = 0.1`) over the
first few iterations (5 in the paper), then hold it. A short first step keeps the earliest, least accurate curvature
estimates (hyperparameters at their initial values, a q(u) far from the data) from moving q(u) far; the
target is reached after ``steps`` steps.

:class:`RunningAverageStart` is the opposite start, for a step that is exact at length 1 (a Gaussian or
Pólya-Gamma likelihood on the closed-form bound): :math:`\rho_k = \max(\rho, 1/(k+1))`, the Robbins-Monro schedule
:math:`(k+\tau)^{-\kappa}` of Hoffman, Blei, Wang, Paisley (2013), "Stochastic variational inference" (JMLR), with
:math:`\tau = \kappa = 1`, held at :math:`\rho` once it gets there. With the hyperparameters fixed, the first
:math:`1/\rho` steps make q(u)'s natural parameters the running mean of the minibatches' optima instead of a
:math:`(1-\rho)^k` pull away from the prior; the floor :math:`\rho` keeps tracking the hyperparameters as they move.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["LogLinearWarmup", "RunningAverageStart", "Cooldown", "constant_schedule", "as_schedule"]


class LogLinearWarmup:
    r"""The step length at step ``k`` (``k = 0, 1, ...``): :math:`\rho_k = \rho_0 (\rho/\rho_0)^{k/K}` for
    :math:`k < K`, then :math:`\rho` (Salimbeni, Eleftheriadis, Hensman 2018; module docstring).

    :param float target: :math:`\rho`, the step length after the warm-up, in ``(0, 1]``.
    :param int steps: :math:`K`, the length of the ramp (``0``: no warm-up, :math:`\rho` from the first step).
    :param float start: :math:`\rho_0` in ``(0, target]`` (default ``1e-4``, the paper's).

    Calling it with a step number (an ``int``) returns a Python float (no tensors, so shapes do not apply).
    """

    def __init__(self, target: float, steps: int = 5, start: float = 1e-4):
        for name, v, high in (("target", target, 1.0), ("start", start, target)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (0.0 < float(v) <= float(high)):
                raise ValueError(f"LogLinearWarmup: {name} must be a number in (0, {high:g}], got {v!r}")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"LogLinearWarmup: steps must be an integer >= 0, got {steps!r}")
        self.target, self.steps, self.start = float(target), int(steps), float(start)

    def __call__(self, step: int) -> float:
        """The step length of step ``step`` (an ``int >= 0``; returns a float)."""
        if step >= self.steps:
            return self.target
        return self.start * math.exp(math.log(self.target / self.start) * max(step, 0) / self.steps)

    def __repr__(self) -> str:
        return f"LogLinearWarmup(target={self.target:g}, steps={self.steps}, start={self.start:g})"


class RunningAverageStart:
    r"""The step length at step ``k`` (``k = 0, 1, ...``): :math:`\rho_k = \max(\rho, 1/(k+1))` (Hoffman et al.
    2013's Robbins-Monro schedule with a floor; module docstring). ``fit``'s ``NaturalPolicy(warmup="auto")`` for a step
    that is exact at length 1: on the time-to-accuracy benchmark (``benchmarks/time_to_accuracy.py``, M = 256,
    evaluations every 5-20 steps) GPyTorch-NGD's final test log-likelihood is reached at step 90 instead of 105 on
    elevators (float64 and float32) and 100 instead of 120 on keggdirected, and at the same step on protein (60) and
    on the 200,000-point flights set (520).

    :param float target: :math:`\rho` in ``(0, 1]``, the step length from step ``ceil(1/rho) - 1`` on.

    Calling it with a step number (an ``int``) returns a Python float (no tensors, so shapes do not apply).
    """

    def __init__(self, target: float):
        from .damping import check_natgrad_lr

        self.target, self.steps = check_natgrad_lr(target), 0  # ``steps``: no ramp from a small length (for reprs)

    def __call__(self, step: int) -> float:
        """The step length of step ``step`` (an ``int >= 0``; returns a float)."""
        return max(self.target, 1.0 / (max(step, 0) + 1))

    def __repr__(self) -> str:
        return f"RunningAverageStart(target={self.target:g})"


class Cooldown:
    r"""A schedule ``base`` whose last steps decay log-linearly: :math:`\rho_k = \rho^{base}_k\,
    c^{(k - k_0)/(K - k_0)}` for :math:`k_0 \le k < K`, :math:`\rho^{base}_k` before (:math:`c` the ``factor``,
    :math:`k_0` the ``start``, :math:`K` the ``end``). A step length that is held and then decays is the
    "warmup-stable-decay" shape (Hägele et al. 2024, "Scaling laws and compute-optimal training beyond fixed training
    durations"); for stochastic natural-gradient VI it is the Robbins-Monro decrease of Hoffman, Blei, Wang, Paisley
    (2013) confined to the end of a run of known length: the fluctuation about the plateau, whose size grows with
    the step length, shrinks by ``factor`` over the decay while the first steps keep their speed.

    :param base: a schedule ``step -> float`` (or a number: constant).
    :param int start: :math:`k_0`, the first step of the decay.
    :param int end: :math:`K`, the number of steps of the run (the decay reaches ``factor`` there).
    :param float factor: :math:`c` in ``(0, 1]``, the fraction of the base length left at the end.

    Calling it with a step number (an ``int``) returns a Python float (no tensors, so shapes do not apply).
    """

    def __init__(self, base, start: int, end: int, factor: float = 0.1):
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0.0 < float(factor) <= 1.0:
            raise ValueError(f"Cooldown: factor must be a number in (0, 1], got {factor!r}")
        for name, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"Cooldown: {name} must be an integer >= 0, got {v!r}")
        self.base = base if callable(base) else constant_schedule(base)
        self.start, self.end, self.factor = int(start), max(int(end), int(start) + 1), float(factor)
        self.target = getattr(self.base, "target", None)  # the held length (for reprs and the log line)
        self.steps = getattr(self.base, "steps", 0)

    def multiplier(self, step: int) -> float:
        """The decay factor at ``step``: 1 before ``start``, ``factor`` from ``end`` on (a float; no tensors, so shapes
        do not apply)."""
        if step < self.start:
            return 1.0
        return self.factor ** (min(step - self.start, self.end - self.start) / (self.end - self.start))

    def __call__(self, step: int) -> float:
        """The step length of step ``step`` (an ``int >= 0``; returns a float)."""
        return self.base(step) * self.multiplier(step)

    def __repr__(self) -> str:
        return f"Cooldown({self.base!r}, start={self.start}, end={self.end}, factor={self.factor:g})"


def constant_schedule(lr: float):
    """A schedule (``step -> float``) that returns ``lr`` at every step: no warm-up (no tensors, so shapes do not
    apply; the fixed step length :math:`\\rho` of Hensman, Fusi, Lawrence 2013, section 3.2)."""
    return LogLinearWarmup(lr, steps=0, start=lr)


def as_schedule(lr, warmup: int = 0, start: float = 1e-4):
    """``lr`` (a number in ``(0, 1]``) as a :class:`LogLinearWarmup` over ``warmup`` steps from ``min(start, lr)``;
    a callable ``lr`` (``step -> float``) is returned unchanged. No tensors, so shapes do not apply (Salimbeni et
    al. 2018's warm-up; module docstring)."""
    if callable(lr):
        return lr
    from .damping import check_natgrad_lr

    lr = check_natgrad_lr(lr)
    return LogLinearWarmup(lr, steps=warmup, start=min(float(start), lr))
