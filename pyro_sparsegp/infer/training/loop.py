"""A training loop for the package's modules: minibatches by tensor indexing, Adam on everything (or Adam on
hyperparameters plus natural-gradient steps on the Gaussian variational families), a progress bar with the running
ELBO, a guard that restores the last good parameters on any numerical failure, and checkpoints that resume training
identically.

Objective: the closed-form bound ``module.analytic_elbo`` for the built-in modules (SVGP, SOLVE-GP and anything
else with ``analytic_elbo`` and a likelihood): deterministic given the minibatch, as GPyTorch's
``VariationalELBO``; ``TraceMeanField_ELBO()`` for any other module with ``model(X, y, num_data=N)`` /
``guide(X, y, num_data=N)``; or the Pyro ELBO passed as ``elbo``.

Data, all passed as ``X``: tensors ``X, y`` (numpy arrays, lists and pandas objects are converted), moved once to
the module's device and dtype and indexed ``X[idx]`` per step; or a dataset (any other object with ``__getitem__`` and
``__len__``) whose ``dataset[idx]`` returns the batch ``(X[idx], y[idx])`` for an index tensor (e.g.
:class:`~pyro_sparsegp.data_stream.MemmapDataset`, which streams from disk with memory flat in ``N``); or any
``DataLoader`` of ``(X, y)`` batches.

Data-parallel: run the same script under ``torchrun --nproc_per_node=K`` after
``torch.distributed.init_process_group("gloo")`` (``"nccl"`` on GPUs). ``fit`` then broadcasts rank 0's parameters,
gives each rank its slice of every global minibatch and averages losses and gradients over ranks (natural-gradient
steps are computed from the averaged gradients), so the ranks stay identical and memory per rank is independent of N.

The loop is :func:`fit`; its parts live in modules of their own in :mod:`pyro_sparsegp.infer.training`:
:mod:`~pyro_sparsegp.infer.training.batches` (the batch source), :mod:`~pyro_sparsegp.infer.training.steps` (one step:
the loss, its gradients and the update through :class:`~pyro_sparsegp.infer.NaturalGradient`),
:mod:`~pyro_sparsegp.infer.training.guard` (non-finite losses, deferred device checks, a window redone with more
jitter), :mod:`~pyro_sparsegp.infer.training.checkpoint` and :mod:`~pyro_sparsegp.infer.training.distributed`.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import dataclass

import pyro
import torch

from ...checks.program import check_model
from ...context.reporting import at_step, in_layer
from ..natgrad.natural_policy import as_policy
from .arguments import Arguments, check_arguments, split_data
from .batches import BatchSource
from .checkpoint import FitState, as_checkpoint, load_checkpoint, save_checkpoint
from .distributed import _dist, broadcast_parameters, check_same_data
from .exact_finish import finish_run
from .guard import NonFiniteLossError, StepGuard, _Redo, deferred_checks_for
from .natural_finish import natural_finish_run
from .progress import Progress
from .steps import TrainingStep, _create_lazy_parameters

__all__ = ["fit"]

_DEFER_ON_CPU = False  # tests set it to run the deferred checks (every device but the CPU) on the CPU


class _RunningElbo:
    """Shows the running ELBO estimate on a :class:`Progress`: minus the mean loss of the last ``window`` steps (an
    exponential average started at the first, typically far larger loss lagged behind a short run)."""

    def __init__(self, bar: Progress, history=(), window: int = 20):
        self.bar, self.recent = bar, collections.deque(history, maxlen=window)  # a resumed run's losses so far

    def __call__(self, losses: list) -> None:
        self.recent.extend(losses)
        self.bar.update(len(losses), -sum(self.recent) / len(self.recent))


def _guarded_step(step: int, source: BatchSource, trainer: TrainingStep, guard: StepGuard) -> None:
    """Step ``step``: its batch, the loss and gradients, the guard's row, the update. A numerical failure goes to
    the guard (which restores the last good parameters and raises :class:`NonFiniteLossError`); others propagate."""
    try:
        with at_step(step):  # warnings raised in the step name it (pyro_sparsegp.context.reporting)
            Xb, yb = next(source)
            loss = trainer.gradients(Xb, yb, guard.context)
            guard.record(step, loss, trainer.grads())
            trainer.update(yb, guard.context, step)
            guard.after_update()
            trainer.plan.after_step(step)  # the iterate average (``average``)
    except (NonFiniteLossError, _Redo):
        raise
    except Exception as exc:  # noqa: BLE001 - classified: only numerical failures are caught
        if not guard.is_numerical(exc):
            raise
        guard.numerical_failure(step, exc)
    finally:
        trainer.clear()


def fit(
    module,
    X=None,
    y=None,
    *,
    num_data: int | None = None,
    num_steps: int = 1000,
    batch_size: int | None = None,
    lr: float = 0.01,
    natgrad="auto",
    elbo=None,
    seed: int = 0,
    progress: bool = True,
    checkpoint=None,
    callback=None,
    sync_every: int | None = None,
) -> FitState:
    """Train ``module`` by maximising its ELBO; returns a :class:`FitState` (the per-step losses, negative ELBO
    estimates). The arguments in brief (each in full, with the measurements behind the defaults, in
    ``docs/fitting.md``, "Fitting: the arguments of fit"):

    * ``module``: an SVGP, SOLVEGP, DeepGP or any PyroModule whose ``model``/``guide`` take ``(X, y, num_data=N)``;
    * data: ``X [N, D]`` with ``y [N, ...]`` (tensors, numpy arrays, lists, pandas objects; moved once to the
      module's device and dtype), or as ``X`` a dataset (any other object with ``__getitem__`` and ``__len__``:
      ``dataset[idx]`` gives ``(X[idx], y[idx])`` for ``idx [B]``, e.g.
      :class:`~pyro_sparsegp.data_stream.MemmapDataset`) or a ``torch.utils.data.DataLoader`` of ``(X, y)`` batches
      (with ``num_data`` = ``N``), ``y`` then ``None``;
    * ``num_steps``, ``batch_size`` (``X, y`` or a dataset; default 1024), ``lr`` (Adam), ``seed``, ``progress``
      (stderr), ``callback(step, loss)``, ``sync_every`` (how often the loss is read back: 1 on CPU, 20 GPU);
    * ``elbo``: ``"analytic"`` (``module.analytic_elbo``, the default where it exists) or a Pyro ELBO;
    * ``natgrad``: the natural-gradient and finish policy, a :class:`~pyro_sparsegp.infer.NaturalPolicy` (its
      docstring documents every field and what ``"auto"`` resolves to: the step length, warm-up, positive-definite
      step, layers, the iterate ``average``, the ``cooldown`` and the ``finish``, exact or natural); a float is
      ``NaturalPolicy(lr=that)``, ``None`` is ``NaturalPolicy(lr=None)`` (Adam trains q(u)), ``"auto"`` is
      ``NaturalPolicy()``;
    * ``checkpoint``: a path (written at the end of the run) or a :class:`~pyro_sparsegp.infer.Checkpoint` ``(path,
      every=0, resume=None)``, from which a run resumes identically.

    :raises NonFiniteLossError: on a numerical failure, after restoring the last good parameters; it names the step.
    """
    policy, files = as_policy(natgrad), as_checkpoint(checkpoint)
    if hasattr(module, "fit_data"):  # a module that draws its own units (GroupGP: whole groups) makes the dataset
        X, y = module.fit_data(X, y)
    X, dataset, loader = split_data(X, y)
    data = dict(X=X, y=y, dataset=dataset, loader=loader, num_data=num_data)
    options = dict(num_steps=num_steps, batch_size=batch_size, lr=lr, natgrad_lr=policy.lr, elbo=elbo, seed=seed,
                   checkpoint=files.path, checkpoint_every=files.every, resume=files.resume_path,
                   sync_every=sync_every)
    natgrad_options = dict(warmup=policy.warmup, retraction=policy.retraction, layers=policy.layers,
                           hidden_start=policy.hidden_start, average=policy.average, finish=policy.finish,
                           cooldown=policy.cooldown)
    with in_layer(getattr(module, "name", None)):  # warnings name the module unless a layer method names its own
        return _fit(module, data, options, natgrad_options, progress=progress, callback=callback)


def _fit(module, data: dict, options: dict, natgrad_options: dict, *, progress: bool, callback) -> FitState:
    """:func:`fit` once its arguments are gathered (``data``: ``X``, ``y``, ``dataset``, ``loader``, ``num_data``;
    ``options``: the run's; ``natgrad_options``: the natural-gradient plan's): check them, start, loop, end."""
    started = time.perf_counter()
    a = check_arguments(module, data, options, natgrad_options)
    run = _start(module, a, data["dataset"], data["loader"], options["resume"], progress)
    run.callback, run.checkpoint, run.started = callback, options["checkpoint"], started
    try:
        _loop(run)
    finally:
        run.bar.close()
    _end_of_run(run)
    return run.state


@dataclass
class _Run:
    """One :func:`fit` run once started: the module, its checked arguments, the batch source, the step, the state,
    the guard and the progress bar, what to call and where to write, this process's rank and whether it reports (rank
    0 with ``progress``). No tensors of its own, so shapes do not apply."""

    module: object
    a: Arguments
    source: BatchSource
    trainer: TrainingStep
    state: FitState
    guard: StepGuard
    bar: Progress
    run_key: dict
    rank: int = 0
    show: bool = False
    started: float = 0.0  # time.perf_counter() at the start
    callback: object = None
    checkpoint: str | None = None


def _start(module, a: Arguments, dataset, loader, resume, progress: bool) -> _Run:
    """Build the run: the batch source, lazily created parameters, the step, the state (fresh or resumed from
    ``resume``), the broadcast of rank 0's parameters, the deferred checks, the bar and the guard."""
    rank, world = _dist()
    if world > 1 and loader is None:  # every rank must hold the same data (a loader may be a shard per rank)
        check_same_data(a.X, a.y, a.num_data, a.device)
    source = BatchSource(a.X, a.y, dataset, loader, num_data=a.num_data, batch_size=a.batch_size, seed=a.seed,
                         rank=rank, world_size=world, dtype=a.dtype, device=a.device)
    if a.elbo != "analytic":  # a model/guide may create parameters at its first call: create them now
        first = source.first()
        _create_lazy_parameters(module, *first, a.num_data)
        check_model(module.model, module.guide, *first, num_data=a.num_data, elbo=a.elbo)  # shape mistakes are loud
    trainer = TrainingStep(module, a.elbo, a.num_data, a.lr, a.natgrad_lr, world, plan=a.plan)
    run_key = _run_key(a, loader, world)
    show = progress and rank == 0
    if show:
        print(describe_plan(a, trainer, loader is not None), file=sys.stderr, flush=True)
    _announce_join(trainer, show)
    state = _initial_state(module, trainer, resume, run_key if loader is None else None, a.seed + rank)
    a.plan.observe(0, state.losses)  # a resumed run's step control as the unbroken run left it
    if world > 1:  # every rank starts from rank 0's parameters
        broadcast_parameters(module)
    checks = deferred_checks_for(module, a.device, a.y, on_cpu=_DEFER_ON_CPU)  # no host reads inside a step
    source.restart(state.step)
    bar = Progress(a.num_steps, state.step, enabled=show, desc="fit")
    report = _RunningElbo(bar, state.losses) if show else None
    guard = StepGuard(module, trainer.optimizer, state, checks, sync_every=a.sync_every, num_steps=a.num_steps,
                      world_size=world, dtype=a.dtype, device=a.device, report=report, plan=a.plan)
    return _Run(module, a, source, trainer, state, guard, bar, run_key, rank, show, time.perf_counter())


def _run_key(a, loader, world: int) -> dict:
    """What a checkpoint must match to resume this run (a loader's batches cannot be checked); no tensors."""
    return {"batch_size": a.batch_size if loader is None else "a loader's", "num_data": a.num_data, "seed": a.seed,
            "world_size": world}


def describe_plan(a: Arguments, trainer: TrainingStep, loader: bool = False) -> str:
    """The line ``fit`` prints at its start: the run's size and what ``"auto"`` chose (the natural steps, their length,
    warm-up and cooldown, or Adam; the average; the finish). No tensors, so shapes do not apply."""
    plan = a.plan
    if loader:
        size = f"{a.num_steps} steps of a loader's batches, N = {a.num_data}"
    else:
        size = (f"{a.num_steps} steps of {a.batch_size} rows of N = {a.num_data} "
                f"({a.num_steps * a.batch_size / a.num_data:.3g} epochs)")
    decay = (f", the last {plan.cooldown:.0%} of the steps decaying to a tenth" if plan.cooldown else "")
    if trainer.natgrad_lr:
        retract = ("positive-definite" if plan.retraction is None and not plan.conjugate or plan.retraction
                   else "plain")
        start = ("running-average start" if plan.running_start and not plan.warmup
                 else f"{plan.warmup}-step warm-up" if plan.warmup else "no warm-up")
        fams = "every layer's q(u)" if plan.layers == "all" else "q(u)"
        steps = f"{fams}: natural steps of {trainer.natgrad_lr:g} ({retract}, {start}{decay})"
        if trainer.noise_lik is not None:
            steps += " and the noise's Fisher step"
        steps += f"; Adam {a.lr:g} on the rest"
    else:
        steps = f"Adam {a.lr:g} on every parameter{decay}"
    average = f"; iterate average of the last {plan.average:.0%}" if plan.average else ""
    finish = {"exact": "exact (q(u) and the noise at their optimum on all the data)",
              "natural": f"natural (at most {a.finish_passes} damped full-data natural steps)"}.get(a.finish, "none")
    return f"fit: {size}; {steps}{average}; finish: {finish}"


def _announce_join(trainer, show: bool) -> None:
    """A line on ``stderr`` (where progress is shown) saying from which step the hidden layers' families join the
    natural steps (``NaturalPolicy(layers="all")`` with ``hidden_start`` after the first step); no tensors."""
    late = trainer.plan.late(trainer.plan.families()) if trainer.natgrad_lr else []
    if show and late and trainer.plan.hidden_start < trainer.plan.num_steps:
        print(f"fit: the hidden layers' q(u) take Adam steps, then natural steps from step {trainer.plan.hidden_start} "
              "(NaturalPolicy.hidden_start)", file=sys.stderr, flush=True)


def _end_of_run(run: _Run) -> None:
    """After the loop: the iterate average (``average``) or the exact finish into the module, then the checkpoint
    (none, or not rank 0's to write) with the final model and the loop's own state to resume from."""
    a, module = run.a, run.module
    checkpoint = run.checkpoint if run.rank == 0 else None
    ends_changed = a.finish or a.plan.average is not None  # the module after the loop is not the loop's own
    loop_state = ({k: v.detach().clone() for k, v in module.state_dict().items()}
                  if checkpoint and ends_changed else None)
    changed = a.plan.finish()
    state = run.state
    state.not_averaged = list(a.plan.averager.kept) if a.plan.averager is not None else []
    if run.show and state.not_averaged:
        print(f"fit: no iterate average of {', '.join(state.not_averaged)}: its averaged precision is not positive "
              "definite, or too ill-conditioned, in float64 (a run too short for it); the last iterate is kept",
              file=sys.stderr, flush=True)
    done = ""
    if a.finish:  # q(u) (and the noise) at their optimum on all the data, given the hyperparameters
        # on a forked RNG: a DeepGP's finish samples its hidden layers, and the checkpoint keeps the loop's RNG state,
        # from which a resumed run must draw what the unbroken one draws
        with torch.random.fork_rng(devices=[a.device] if a.device.type == "cuda" else []):
            if a.finish == "exact":
                finish_run(module, run.source, a.num_data, run.show)
                done = "exact"
            else:
                rep = natural_finish_run(module, run.source, a.num_data, run.show, a.finish_passes, seed=a.seed)
                done = (f"natural, {rep['accepted']} of {rep['passes']} steps accepted, bound "
                        f"{rep['before'] / a.num_data:.5g} -> {rep['after'] / a.num_data:.5g} per point")
    elif run.show and a.finish_skipped:
        print(f"fit: {a.finish_skipped}", file=sys.stderr, flush=True)
    if checkpoint:
        save_checkpoint(checkpoint, module, run.trainer.optimizer, state, run.run_key,
                        loop_state=loop_state if changed or a.finish else None)
    if run.show:
        last = state.losses[-20:]
        bound = (f"bound {-sum(last) / len(last) / a.num_data:.5g} per point (mean of the last {len(last)} steps' "
                 "estimates)" if last else "no steps taken")
        ended = "averaged" if changed else (f"finish: {done}" if done else "the last iterate")
        print(f"fit: done: {state.step} steps in {time.perf_counter() - run.started:.1f} s; {bound}; {ended}",
              file=sys.stderr, flush=True)


def _initial_state(module, trainer, resume, expect, seed):
    """A fresh :class:`FitState` (seeding Pyro's RNG with ``seed``), or the one of the checkpoint ``resume``
    (checked against the run's ``expect``, ``None`` for a loader, whose batches cannot be checked)."""
    if resume is not None:
        return load_checkpoint(os.fspath(resume), module, trainer.optimizer, expect=expect)
    pyro.set_rng_seed(seed)
    return FitState()


def _loop(run: _Run) -> None:
    """:func:`fit`'s steps from ``run.state.step`` to ``num_steps``: guarded steps, the callback on the steps whose
    losses are read back, checkpoints, and a window redone from its start when a deferred check fails."""
    a, state, guard, callback = run.a, run.state, run.guard, run.callback
    step = called = state.step
    while step < a.num_steps:
        try:
            guard.begin(step)
            _guarded_step(step, run.source, run.trainer, guard)
            step = state.step = step + 1
            while callback is not None and called < len(state.losses):  # the steps whose losses are read back
                called += 1
                callback(called, state.losses[called - 1])
            if run.checkpoint and a.checkpoint_every and step % a.checkpoint_every == 0 and run.rank == 0:
                guard.check()
                save_checkpoint(run.checkpoint, run.module, run.trainer.optimizer, state, run.run_key)
        except _Redo as redo:  # a deferred check failed in the window: redo it from its start, with the remedy
            step = state.step = guard.redo(redo)
            run.source.restart(step)
    guard.check()
