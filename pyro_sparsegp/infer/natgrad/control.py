r"""A step length that adapts to what the run shows: halve the step lengths when the bound collapses.

A natural-gradient step on a minibatch can throw q(u) far from the plateau when the likelihood's curvature is
estimated poorly: a log link (Poisson, negative binomial) where a few large counts dominate the batch, a
non-log-concave likelihood (robust-max), a small batch. The run shows it as a **collapse of the bound**: the
minibatch losses jump far above their recent level and stay there for the next steps (an outlier batch alone
raises one loss, not several in a row). :class:`StepControl` watches the losses ``fit`` reads back (every step on
the CPU, every ``sync_every`` steps on a GPU: it never forces a read), keeps an exponential average of their level
and of their absolute deviation, and when :data:`SPIKE_RUN` consecutive losses lie more than :data:`SPIKE_SIZE`
deviations above the level, halves the multiplier of every step length (the natural steps' and Adam's), down to
:data:`MIN_SCALE`; ``fit`` says so on its progress stream. This is the backtracking of a trust region (Nocedal and
Wright 2006, "Numerical optimization", section 4.1: shrink the radius when the actual change of the objective
disagrees with the model's) driven by the losses the run computes anyway, instead of a second evaluation per step.
"""

from __future__ import annotations

__all__ = ["StepControl", "SPIKE_SIZE", "SPIKE_RUN", "MIN_SCALE", "BURN_IN"]

SPIKE_SIZE = 8.0  # a loss this many mean absolute deviations above the running level is part of a collapse
SPIKE_RUN = 2  # consecutive such losses make a collapse (one outlier batch is not one)
MIN_SCALE = 1 / 16  # the multiplier is never halved below this
BURN_IN = 20  # losses seen before any verdict (the level and deviation of the first steps are meaningless)
_DECAY = 0.05  # weight of a new loss in the running level and deviation


class StepControl:
    """The step-length multiplier of one run (module docstring: the trust-region backtracking of Nocedal and Wright
    2006, section 4.1, driven by the losses read back). :meth:`observe` takes the losses as they are read back;
    :attr:`scale` multiplies the step lengths from then on; :attr:`events` lists ``(step, scale)`` for each halving.
    Floats only, so shapes do not apply."""

    def __init__(self, start: int = 0):
        self.start = start  # losses of steps before this (a warm-up) only feed the running level
        self.scale, self.events = 1.0, []
        self.level = self.dev = None
        self.seen = self.run = 0

    def observe(self, first_step: int, losses) -> list:
        """Feed the losses of steps ``first_step, first_step + 1, ...`` (floats); returns the halvings they caused,
        ``[(step, new scale)]``."""
        out = []
        for k, loss in enumerate(losses):
            step = first_step + k
            if self.level is None:
                self.level, self.dev = loss, 0.0
                continue
            high = self.seen >= BURN_IN and step >= self.start and loss > self.level + SPIKE_SIZE * self.dev
            self.seen += 1
            if high:
                self.run += 1
                if self.run >= SPIKE_RUN and self.scale > MIN_SCALE:
                    self.scale = max(MIN_SCALE, self.scale / 2)
                    self.events.append((step, self.scale))
                    out.append((step, self.scale))
                    self.run = 0
                continue  # a collapse's losses do not move the level it is measured against
            self.run = 0
            self.dev += _DECAY * (abs(loss - self.level) - self.dev)
            self.level += _DECAY * (loss - self.level)
        return out

    def state_dict(self) -> dict:
        """The control's state (floats and ints, so shapes do not apply), for checkpoints."""
        return {"scale": self.scale, "events": list(self.events), "level": self.level, "dev": self.dev,
                "seen": self.seen, "run": self.run}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (floats and ints, so shapes do not apply)."""
        for k, v in state.items():
            setattr(self, k, list(map(tuple, v)) if k == "events" else v)
