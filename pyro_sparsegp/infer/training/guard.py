"""The step guard of :func:`~pyro_sparsegp.infer.fit`: what it does about a numerical failure and about the checks
deferred on an accelerator.

* Every step's loss, and a number that is finite exactly when the loss and every gradient are, are kept on the
  device and read back every ``sync_every`` steps (a *window*): one host read per window.
* A non-finite loss or gradient, or an error that a non-finite, overflowing or underflowing parameter caused (a failed
  factorisation, a validation error naming ``nan``/``inf``, a distribution parameter outside its support such as a
  noise driven to 0), restores the copy of the parameters taken at the start of the window (or of the previous one)
  and raises :class:`NonFiniteLossError` naming the step.
* On every device but the CPU the steps' own checks are deferred (:mod:`pyro_sparsegp.context.deferred`): their flags
  are read with the losses, and a window in which a Cholesky factorisation failed (or a kernel's product form was
  inexact) is **redone** from its start with ten times the jitter (or the exact differences), Adam's moments
  restored too.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import sys

import torch

from ...checks.inputs import fill_missing
from ...context.deferred import DeferredChecks, deferred_checks
from ...context.reporting import _warn_once
from ...linalg import CholeskyJitterWarning
from ..natgrad.control import SPIKE_RUN
from .distributed import max_over_ranks_

__all__ = ["NonFiniteLossError", "StepGuard", "deferred_checks_for"]

_MAX_JITTER_TRIES = 6  # tenfold escalations of a redone window's jitter, as linalg.cholesky's max_tries


class NonFiniteLossError(FloatingPointError):
    """Raised by :func:`fit` on a numerical failure: a non-finite loss or gradient, or a factorisation or
    validation error caused by non-finite or overflowing parameters. ``step`` is the step at which it happened,
    ``restored_step`` the step whose parameters the module holds again (those of the last finite loss that ``fit``
    kept a copy of; ``None`` if the failure came at the first step, whose parameters are unchanged) and ``state``
    the :class:`FitState` up to the failure (losses included). The original exception, if any, is the cause."""

    def __init__(self, step: int, loss: float, restored_step: int | None = None, state=None, reason: str = ""):
        where = "the parameters are those it started from" if restored_step is None else (
            f"parameters restored to those of step {restored_step}")
        why = reason or (f"non-finite loss ({loss})" if not math.isfinite(loss) else
                         f"non-finite gradient (loss {loss})")
        super().__init__(f"{why} at step {step}; {where}; lower the learning rate (lr / NaturalPolicy.lr) or check "
                         "the data")
        self.step, self.loss, self.restored_step, self.state = step, loss, restored_step, state


# a failure message that names a non-finite or overflowing value, a failed factorisation, or a distribution parameter
# outside its support (torch's "Expected parameter scale ... to satisfy the constraint GreaterThan(0)": a noise driven
# to 0 by an underflowing raw parameter; the data's own checks say "Expected value argument")
_NUMERICAL = re.compile(r"\bnan\b|\binf\b|infinit|positive.definite|non-?finite|overflow|"
                        r"Expected parameter \w+ .*to satisfy the constraint", re.IGNORECASE | re.DOTALL)


def _non_finite_state(module) -> bool:
    """Whether any parameter, unconstrained or constrained (``exp`` of a raw parameter may overflow), is not
    finite."""
    with torch.no_grad():
        for p in module.parameters():
            if not bool(torch.isfinite(p).all()):
                return True
        for m in module.modules():
            for name in getattr(m, "_pyro_params", {}):
                v = getattr(m, name)
                if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()):
                    return True
    return False


def _is_numerical(exc, module) -> bool:
    if isinstance(exc, (torch.linalg.LinAlgError, FloatingPointError)):
        return True
    if not isinstance(exc, (ValueError, RuntimeError, UserWarning)):  # a warning: under warnings-as-errors
        return False
    return bool(_NUMERICAL.search(str(exc))) or _non_finite_state(module)


class _Snapshots:
    """Two preallocated copies of the module's state (ping-pong), refreshed in place: ``take(step)`` copies the
    current parameters into the older slot. ``restore(good)`` loads the newest copy taken at a step ``<= good``."""

    def __init__(self, module):
        self.module = module
        self.slots = [None, None]  # each: (step, {name: tensor})
        self.newest = 1

    def take(self, step: int) -> None:
        src = self.module.state_dict()
        i = 1 - self.newest
        slot = self.slots[i]
        if slot is None or slot[1].keys() != src.keys() or any(slot[1][k].shape != v.shape for k, v in src.items()):
            self.slots[i] = (step, {k: v.detach().clone() for k, v in src.items()})
        else:
            bufs = slot[1]
            torch._foreach_copy_([bufs[k] for k in src], [v.detach() for v in src.values()])
            self.slots[i] = (step, bufs)
        self.newest = i

    def restore(self, good: int) -> int | None:
        for i in (self.newest, 1 - self.newest):
            slot = self.slots[i]
            if slot is not None and slot[0] <= good:
                self.module.load_state_dict(slot[1])
                return slot[0]
        return None


class _Redo(Exception):
    """A sync found a deferred check's flag raised in the window (``pyro_sparsegp.context.deferred``): redo the
    window."""

    def __init__(self, cholesky: bool, inexact: bool, damping: bool = False):
        super().__init__(f"redo the window (failed factorisation: {cholesky}, inexact kernel: {inexact}, "
                         f"natural step to damp: {damping})")
        self.cholesky, self.inexact, self.damping = cholesky, inexact, damping


def deferred_checks_for(module, device, y=None, on_cpu: bool = False) -> DeferredChecks | None:
    """The :class:`~pyro_sparsegp.context.deferred.DeferredChecks` of a run on ``device`` (``None`` on the CPU unless
    ``on_cpu``: checks read at once there). With deferred checks the value checks that the steps skip run here, once,
    on the whole targets ``y [N, ...]`` (if given)."""
    checks = DeferredChecks(device) if (device.type != "cpu" or on_cpu) else None
    if checks is not None and y is not None:
        lik = getattr(module, "likelihood", None)
        if lik is not None and hasattr(lik, "check_y"):
            lik.check_y(fill_missing(y)[0])  # NaN: missing outputs, which the module's check_inputs allowed
    return checks


class StepGuard:
    """The guard of one :func:`~pyro_sparsegp.infer.fit` run over ``module`` and its torch ``optimizer``: copies of
    the parameters at each window's start, the pending per-step rows ``[loss, check, (flags)]`` (device tensors of
    ``dtype``), the sync that reads them into ``state.losses`` (and passes them to ``report``), and what a failure
    leads to (module docstring). ``checks``: the run's deferred checks, or ``None``.

    Per step: :meth:`begin`, the forward and backward passes under :attr:`context`, :meth:`record`, the update under
    :attr:`context`, :meth:`after_update`; :meth:`numerical_failure` for a numerical exception; :meth:`redo` on
    ``_Redo``."""

    def __init__(self, module, optimizer, state, checks, *, sync_every: int, num_steps: int, world_size: int = 1,
                 dtype=None, device=None, report=None, plan=None):
        self.module, self.optimizer, self.state, self.checks = module, optimizer, state, checks
        self.plan = plan  # a NatGradPlan: its iterate average follows the windows (mark, rewind)
        self.sync_every, self.num_steps, self.world_size, self.report = sync_every, num_steps, world_size, report
        self.context = (lambda: deferred_checks(checks)) if checks is not None else contextlib.nullcontext
        self.snaps = _Snapshots(module)
        self.window_start = state.step
        self.pending = []  # per step since the last sync: [loss, check] (and the deferred flags so far), on the device
        self.due = False  # deferred checks: the window is full; it syncs after this step's update (after_update)
        self.optimizer_copy = None
        self.zero = torch.zeros((), dtype=dtype, device=device)

    def begin(self, step: int) -> None:
        """Before step ``step``: at a window's start, copy the parameters (and, with deferred checks, Adam's state:
        a redone window restarts its moments too; one device copy per window)."""
        if (step - self.window_start) % self.sync_every == 0:
            self.snaps.take(step)
            self.window_start = step
            if self.plan is not None:
                self.plan.mark()
            if self.checks is not None:
                self.optimizer_copy = copy.deepcopy(self.optimizer.state_dict())

    def record(self, step: int, loss: torch.Tensor, grads: list) -> None:
        """Keep step ``step``'s loss ``()`` and whether it and ``grads`` (tensors of any shapes) are finite, without
        reading them; read back the window when it is full or the run's last step."""
        check = loss.detach() + (torch.stack(torch._foreach_norm(grads, float("inf"))).sum() * 0
                                 if grads else self.zero)
        row = torch.stack([loss.detach(), check])
        self.pending.append(row if self.checks is None else torch.cat([row, self.checks.flags.to(row.dtype)]))
        if self.sync_every == 1 or (step + 1 - self.window_start) % self.sync_every == 0 or step + 1 == self.num_steps:
            if self.checks is None:
                self.check()
            else:  # the flags that the window's last update raises belong to this window (its start is clean)
                self.due = True

    def after_update(self) -> None:
        """After a step's update: with deferred checks, a full window folds the flags that the update raised (a
        natural step to damp, a failed factorisation) into its last row and syncs (the CPU syncs in
        :meth:`record`, before the update). No tensor arguments or results, so shapes do not apply."""
        if self.due:
            self.due = False
            last = self.pending[-1]
            self.pending[-1] = torch.cat([last[:2], torch.maximum(last[2:], self.checks.flags.to(last.dtype))])
            self.check()

    def _sync(self):
        """Read back the pending losses; returns ``(index of the first bad step in the window, its loss)``, or None.
        Raises ``_Redo`` when a deferred check's flag was raised at or before the first non-finite loss."""
        if not self.pending:
            return None
        table = torch.stack(self.pending)
        if self.checks is not None and self.world_size > 1:  # every rank redoes the window if one must
            max_over_ranks_(table, 2)
        vals = table.tolist()
        self.pending = []
        bad = next((i for i, row in enumerate(vals) if not (math.isfinite(row[0]) and math.isfinite(row[1]))), None)
        if self.checks is not None:
            flagged = next((i for i, row in enumerate(vals) if any(f > 0 for f in row[2:])), None)
            if flagged is not None and (bad is None or flagged <= bad):  # else the non-finite loss came first
                row, c = vals[-1], self.checks
                raise _Redo(row[2 + c.CHOLESKY] > 0, row[2 + c.INEXACT] > 0, row[2 + c.DAMPING] > 0)
        if bad is not None:
            self.state.losses.extend(row[0] for row in vals[:bad])
            return bad, vals[bad][0]
        self.state.losses.extend(row[0] for row in vals)
        if self.report is not None:
            self.report([row[0] for row in vals])
        if self.plan is not None:  # the step control (natgrad/control.py) sees every loss read back
            first = len(self.state.losses) - len(vals)
            for step, scale in self.plan.observe(first, [row[0] for row in vals]):
                if self.report is not None:
                    print(f"\nfit: step {step}: the bound collapsed on {SPIKE_RUN} batches in a row; every step "
                          f"length is now {scale:g} of its schedule's", file=sys.stderr, flush=True)
        return None

    def _fail(self, step_bad, value, good, exc=None, reason=""):
        restored = self.snaps.restore(good)
        raise NonFiniteLossError(step_bad, value, restored, self.state, reason) from exc

    def check(self, exc=None) -> None:
        """Sync; on a bad loss in the window, restore the last good parameters and raise
        :class:`NonFiniteLossError`."""
        self.due = False
        bad = self._sync()
        if bad is not None:
            i, value = bad
            self._fail(self.window_start + i, value, self.window_start + i - 1, exc)

    def is_numerical(self, exc: Exception) -> bool:
        """Whether ``exc`` is a numerical failure (module docstring), which the guard handles; others propagate."""
        return _is_numerical(exc, self.module)

    def numerical_failure(self, step: int, exc: Exception) -> None:
        """A numerical exception in step ``step``: restore the last good parameters and raise
        :class:`NonFiniteLossError` from ``exc``."""
        self.check(exc)
        # the losses up to this step were finite: the parameters of this step are the last good ones
        # unless the failure came from its own loss evaluation (then the previous step's)
        in_update = len(self.state.losses) > step
        self._fail(step, float("nan"), step if in_update else step - 1, exc,
                   reason=f"numerical failure ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})")

    def redo(self, redo_exc: _Redo) -> int:
        """A window whose steps used a failed factorisation or an inexact kernel: back to its start, with the remedy
        (pyro_sparsegp.context.deferred); returns the step to continue from (the batches replay from there)."""
        checks, start = self.checks, self.window_start
        self.pending, self.due = [], False
        self.snaps.restore(start)
        if self.plan is not None:  # the window's steps leave the iterate average
            self.plan.rewind()
        self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_copy))  # the copy may serve another redo
        checks.reset()
        if redo_exc.cholesky:
            checks.jitter_scale *= 10.0
            if checks.jitter_scale > 10.0**_MAX_JITTER_TRIES:
                raise torch.linalg.LinAlgError(
                    f"fit: a Cholesky factorisation failed at step {start} or the {self.sync_every - 1} after it "
                    f"even with {checks.jitter_scale / 10:.0e} times the base jitter; check the inputs (duplicate "
                    "points, NaN) and the kernel hyperparameters")
            _warn_once(("fit-jitter", checks.jitter_scale), f"fit: a Cholesky factorisation failed in the window "
                       f"from step {start}; the window is redone with the jitter raised to "
                       f"{checks.jitter_scale:.0e} times the base for the rest of the run", CholeskyJitterWarning)
        if redo_exc.inexact:
            checks.exact_kernels = True
        if redo_exc.damping:  # the halving needs host reads: a NatGradDampingWarning reports it, as on the CPU
            checks.damp_at_once = True
        return start
