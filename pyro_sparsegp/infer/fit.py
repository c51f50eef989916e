"""A training loop for the package's modules: minibatches by tensor indexing, Adam on everything (or Adam on
hyperparameters plus natural-gradient steps on the Gaussian variational families), a progress bar with the running
ELBO, a guard that restores the last good parameters on any numerical failure, and checkpoints that resume training
identically.

Objective: the closed-form bound ``module.analytic_elbo`` for the built-in modules (SVGP, SOLVE-GP and anything
else with ``analytic_elbo`` and a likelihood): deterministic given the minibatch, as GPyTorch's
``VariationalELBO``; ``TraceMeanField_ELBO()`` for any other module with ``model(X, y, num_data=N)`` /
``guide(X, y, num_data=N)``; or the Pyro ELBO passed as ``elbo``.

Data: tensors ``X, y`` (numpy arrays and lists are converted), moved once to the module's device and dtype and
indexed ``X[idx]`` per step; or a ``dataset`` whose ``dataset[idx]`` returns the batch ``(X[idx], y[idx])`` for an
index tensor (e.g. :class:`~pyro_sparsegp.data_stream.MemmapDataset`, which streams from disk with memory flat in
``N``); or any ``DataLoader`` of ``(X, y)`` batches.

Data-parallel: run the same script under ``torchrun --nproc_per_node=K`` after
``torch.distributed.init_process_group("gloo")`` (``"nccl"`` on GPUs). ``fit`` then broadcasts rank 0's parameters,
gives each rank its slice of every global minibatch and averages losses and gradients over ranks (natural-gradient
steps are computed from the averaged gradients), so the ranks stay identical and memory per rank is independent of N.

The loop is :func:`fit`; its parts live in modules of their own: :mod:`~pyro_sparsegp.infer.batches` (the batch
source), :mod:`~pyro_sparsegp.infer.steps` (one step: the loss, its gradients and the update through
:class:`~pyro_sparsegp.infer.NaturalGradient`), :mod:`~pyro_sparsegp.infer.guard` (non-finite losses, deferred device
checks, a window redone with more jitter), :mod:`~pyro_sparsegp.infer.checkpoint` and
:mod:`~pyro_sparsegp.infer.distributed`.
"""

from __future__ import annotations

import collections
import math
import numbers
import os
import sys
from dataclasses import dataclass

import pyro
import torch
from torch.utils.data import DataLoader

from ..composition import sampled_attributes
from ..inputs import as_tensor
from ..naming import check_not_superseded
from .batches import BatchSource, EpochBatchSampler, _first_batch, _round_keys, permute_positions  # noqa: F401
from .checkpoint import (  # noqa: F401
    CHECKPOINT_FORMAT,
    FitState,
    _read_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .distributed import _average, _dist, broadcast_parameters, check_same_data  # noqa: F401
from .exact_finish import finish_run, resolve_finish
from .guard import (  # noqa: F401
    _MAX_JITTER_TRIES,
    _NUMERICAL,
    NonFiniteLossError,
    StepGuard,
    _is_numerical,
    _non_finite_state,
    _Redo,
    _Snapshots,
    deferred_checks_for,
)
from .natgrad_options import NatGradPlan, resolve_natgrad
from .progress import Progress
from .steps import TrainingStep, _create_lazy_parameters, _default_elbo

__all__ = ["fit", "FitState", "NonFiniteLossError", "save_checkpoint", "load_checkpoint", "EpochBatchSampler"]

DEFAULT_BATCH_SIZE = 1024  # minibatch rows of X, y or a dataset when batch_size is not given
_DEFER_ON_CPU = False  # tests set it to run the deferred checks (every device but the CPU) on the CPU


# -- argument checks -------------------------------------------------------------------------------------------------
def _int(name, v, low):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def _positive(name, v, allow_none=False, high=None):
    if v is None and allow_none:
        return None
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok or (high is not None and v > high):
        rng = f"in (0, {high}]" if high is not None else "> 0"
        raise ValueError(f"{name} must be a finite number {rng}{' or None' if allow_none else ''}, got {v!r}")
    return float(v)


@dataclass
class _Arguments:
    """fit's arguments once checked: the data ``X [N, D], y [N, ...]`` on ``device`` (or ``None``), the sizes, the
    objective and the step lengths."""

    X: object
    y: object
    num_data: int
    num_steps: int
    batch_size: int
    lr: float
    natgrad_lr: float | None
    elbo: object
    seed: int
    checkpoint_every: int
    sync_every: int
    dtype: torch.dtype
    device: torch.device
    plan: NatGradPlan  # warm-up, positive-definite step, layers, iterate average (natgrad_options.py)
    finish: bool  # the exact last step for q(u) and the noise (exact_finish.py)
    finish_skipped: str | None  # why "auto" did not finish a module that could be (a progress line)


def _natgrad(module, natgrad_lr, elbo, num_steps, batch_fraction, options: dict):
    """``(natgrad_lr, plan)``: the step length (a float in ``(0, 1]`` or ``None``) and the
    :class:`~pyro_sparsegp.infer.natgrad_options.NatGradPlan` of fit's natural-gradient ``options`` (``"auto"``
    resolved per likelihood, layer type and ``batch_fraction`` = B / N, ``None`` if unknown)."""
    natgrad_lr, plan = resolve_natgrad(module, natgrad_lr, elbo, _default_elbo(module), num_steps=num_steps,
                                       batch_fraction=batch_fraction, **options)
    return _positive("natgrad_lr", natgrad_lr, allow_none=True, high=1), plan


def _check_files(checkpoint, checkpoint_every, resume, num_steps):
    if checkpoint_every and not checkpoint:
        raise ValueError("checkpoint_every needs a checkpoint path")
    if checkpoint is not None:
        folder = os.path.dirname(os.path.abspath(os.fspath(checkpoint)))
        if not os.path.isdir(folder):
            raise ValueError(f"the folder of checkpoint {os.fspath(checkpoint)!r} does not exist: {folder}")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"the folder of checkpoint {os.fspath(checkpoint)!r} is not writable: {folder}")
    if resume is not None:  # fail now, naming the file, not after building everything
        saved_step = int(_read_checkpoint(os.fspath(resume))["step"])
        if saved_step > num_steps:
            raise ValueError(f"checkpoint {os.fspath(resume)!r} is at step {saved_step}, beyond num_steps={num_steps}")


def _check_data(module, X, y, dataset, loader, num_data):
    """``(X, y, num_data, dtype, device)``: tensors on the module's device (floating data in its dtype), checked
    once for the whole data set, or ``None`` for a ``dataset``/``loader``."""
    ref = next(module.parameters(), None)  # None: a module whose parameters are all created at its first call
    device = ref.device if ref is not None else X.device if isinstance(X, torch.Tensor) else torch.device("cpu")
    dtype = ref.dtype if ref is not None else torch.get_default_dtype()
    if X is not None:
        if y is None:
            raise ValueError("fit needs y with X")
        X, y = as_tensor(X, "X", dtype, device), as_tensor(y, "y", dtype, device, floating=False)
        if X.dim() != 2:
            raise ValueError(f"X must be [N, D], got shape {tuple(X.shape)}")
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"X and y have different numbers of rows: N = {X.shape[0]} and {y.shape[0]}")
        if X.shape[0] == 0:
            raise ValueError("X and y are empty")
        if hasattr(module, "check_inputs"):  # the module's own layout and checks, once, naming N (not a minibatch)
            X, y = module.check_inputs(X, y)
        for name, t in (("X", X), ("y", y)):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or inf")
        num_data = X.shape[0]
    elif dataset is not None:
        num_data = len(dataset)
        if num_data == 0:
            raise ValueError("the dataset is empty")
    elif num_data is None:
        raise ValueError("fit with a DataLoader needs num_data (the size of the whole data set)")
    return X, y, _int("num_data", num_data, 1), dtype, device


def _check_arguments(module, X, y, dataset, loader, num_data, num_steps, batch_size, lr, natgrad_lr, elbo, seed,
                     checkpoint, checkpoint_every, resume, sync_every, natgrad_options: dict) -> _Arguments:
    """fit's arguments checked (a ``ValueError`` or ``TypeError`` naming the first wrong one, before anything is
    touched) and completed with their defaults."""
    num_steps = _int("num_steps", num_steps, 0)
    finish = natgrad_options.pop("finish")
    if not torch.is_grad_enabled():  # else the first backward fails with "element 0 of tensors does not require grad"
        raise RuntimeError("fit needs gradients and was called with them disabled (inside torch.no_grad() or "
                           "torch.inference_mode()): call it outside that block")
    if loader is not None and batch_size is not None:
        raise ValueError("batch_size applies to X, y and dataset=...; a loader's batches are its own (set batch_size "
                         "on the DataLoader)")
    batch_size = _int("batch_size", DEFAULT_BATCH_SIZE if batch_size is None else batch_size, 1)
    lr = _positive("lr", lr)
    checkpoint_every = _int("checkpoint_every", checkpoint_every, 0)
    seed = _int("seed", seed, 0)
    _check_files(checkpoint, checkpoint_every, resume, num_steps)
    if sum(s is not None for s in (X, dataset, loader)) != 1:
        raise ValueError("fit needs exactly one data source: X and y, dataset=..., or loader=...")
    check_not_superseded(module)
    X, y, num_data, dtype, device = _check_data(module, X, y, dataset, loader, num_data)
    if loader is None:
        batch_size = min(batch_size, num_data)
    batch = batch_size if loader is None else getattr(loader, "batch_size", None)  # a loader's may be unknown
    fraction = batch / num_data if batch else None
    natgrad_lr, plan = _natgrad(module, natgrad_lr, elbo, num_steps, fraction, natgrad_options)
    elbo = _default_elbo(module) if elbo is None else elbo
    epochs = num_steps * batch_size * _dist()[1] / num_data if loader is None else 0.0
    # an average of a deep GP's hidden layers goes with the exact finish of its last layer; others would clash
    clash = None if plan.hidden(plan.families()) or plan.average_auto else natgrad_options["average"]
    finish, skipped = resolve_finish(module, finish, elbo, natgrad_lr, loader, clash, num_steps, epochs)
    plan.resolve_average(finish)
    if elbo != "analytic" and not hasattr(elbo, "differentiable_loss"):
        raise TypeError('elbo must be a Pyro ELBO with differentiable_loss, or "analytic"')
    if elbo == "analytic" and not hasattr(module, "analytic_elbo"):
        raise TypeError(f'elbo="analytic" needs a module with analytic_elbo; {type(module).__name__} has none')
    if elbo == "analytic" and (sampled := sampled_attributes(module, names=False)):
        where = ", ".join(f"{type(sub).__name__}.{attr}" for sub, attr, _ in sampled)
        raise ValueError(f"fit's closed-form bound needs fixed hyperparameters, and {where} is a PyroSample "
                         "(a hyperprior): train this model with SVI and a guide for it beside the layer's guide, "
                         "e.g. AutoGuideList with an AutoNormal (docs/composing.md), with "
                         "ps.infer.NaturalGradient for q(u)")
    sync_every = (20 if device.type != "cpu" else 1) if sync_every is None else _int("sync_every", sync_every, 1)
    return _Arguments(X, y, num_data, num_steps, batch_size, lr, natgrad_lr, elbo, seed, checkpoint_every,
                      sync_every, dtype, device, plan, finish, skipped)


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
    dataset=None,
    loader: DataLoader | None = None,
    num_data: int | None = None,
    num_steps: int = 1000,
    batch_size: int | None = None,
    lr: float = 0.01,
    natgrad_lr: float | str | None = "auto",
    elbo=None,
    seed: int = 0,
    progress: bool = True,
    checkpoint: str | None = None,
    checkpoint_every: int = 0,
    resume: str | None = None,
    callback=None,
    sync_every: int | None = None,
    natgrad_warmup: int | str = "auto",
    natgrad_retraction: bool | str = "auto",
    natgrad_layers: str = "auto",
    natgrad_hidden_start: int | str = "auto",
    average: float | str | None = "auto",
    finish: str | None = "auto",
) -> FitState:
    """Train ``module`` by maximising its ELBO; returns a :class:`FitState` (the per-step losses, negative ELBO
    estimates). The arguments in brief (each in full, with the policies and measurements behind the defaults, in
    ``docs/fitting.md``, "Fitting: the arguments of fit"):

    * ``module``: an SVGP, SOLVEGP, DeepGP or any PyroModule whose ``model``/``guide`` take ``(X, y, num_data=N)``;
    * data: ``X [N, D]`` with ``y [N, ...]`` (tensors, numpy arrays, lists; moved once to the module's device and
      dtype), or ``dataset`` (``dataset[idx]`` gives ``(X[idx], y[idx])`` for ``idx [B]``), or ``loader`` (any
      DataLoader of ``(X, y)`` batches, with ``num_data`` = ``N``);
    * ``num_steps``, ``batch_size`` (``X, y`` or ``dataset``; default 1024), ``lr`` (Adam), ``seed``, ``progress``
      (stderr), ``callback(step, loss)``, ``sync_every`` (how often the loss is read back: 1 on CPU, 20 GPU);
    * ``elbo``: ``"analytic"`` (``module.analytic_elbo``, the default where it exists) or a Pyro ELBO;
    * ``natgrad_lr`` (``"auto"``, ``None`` for Adam, or a step length in ``(0, 1]``), ``natgrad_warmup``,
      ``natgrad_retraction``, ``natgrad_layers``, ``natgrad_hidden_start``: natural-gradient steps on the Gaussian
      variational families (:mod:`~pyro_sparsegp.infer.natgrad_options` has the ``"auto"`` policy);
    * ``average``: the Polyak-Ruppert average over the last fraction ``average`` of the steps, ``None`` or ``"auto"``;
    * ``finish``: ``"exact"`` ends with q(u) and the Gaussian noise at their optimum on all the data (one pass;
      :mod:`~pyro_sparsegp.infer.exact_finish`), ``None`` keeps the last iterate; ``"auto"``: exact for an SVGP
      or SOLVE-GP (a DeepGP's last layer) with a Gaussian likelihood, natural gradients, ``X, y`` or ``dataset``
      and at least one epoch;
    * ``checkpoint``, ``checkpoint_every``, ``resume``: checkpoints from which a run resumes identically.

    :raises NonFiniteLossError: on a numerical failure, after restoring the last good parameters; it names the step.
    """
    a = _check_arguments(module, X, y, dataset, loader, num_data, num_steps, batch_size, lr, natgrad_lr, elbo, seed,
                         checkpoint, checkpoint_every, resume, sync_every, dict(
                             warmup=natgrad_warmup, retraction=natgrad_retraction, layers=natgrad_layers,
                             hidden_start=natgrad_hidden_start, average=average, finish=finish))
    rank, world = _dist()
    if world > 1 and loader is None:  # every rank must hold the same data (a loader may be a shard per rank)
        check_same_data(a.X, a.y, a.num_data, a.device)
    source = BatchSource(a.X, a.y, dataset, loader, num_data=a.num_data, batch_size=a.batch_size, seed=a.seed,
                         rank=rank, world_size=world, dtype=a.dtype, device=a.device)
    if a.elbo != "analytic":  # a model/guide may create parameters at its first call: create them now
        _create_lazy_parameters(module, *source.first(), a.num_data)
    trainer = TrainingStep(module, a.elbo, a.num_data, a.lr, a.natgrad_lr, world, plan=a.plan)
    run_key = _run_key(a, loader, world)
    _announce_join(trainer, progress and rank == 0)
    state = _initial_state(module, trainer, resume, run_key if loader is None else None, a.seed + rank)
    if world > 1:  # every rank starts from rank 0's parameters
        broadcast_parameters(module)
    checks = deferred_checks_for(module, a.device, a.y, on_cpu=_DEFER_ON_CPU)  # no host reads inside a step
    source.restart(state.step)
    show = progress and rank == 0
    bar = Progress(a.num_steps, state.step, enabled=show, desc="fit")
    report = _RunningElbo(bar, state.losses) if show else None
    guard = StepGuard(module, trainer.optimizer, state, checks, sync_every=a.sync_every, num_steps=a.num_steps,
                      world_size=world, dtype=a.dtype, device=a.device, report=report, plan=a.plan)
    try:
        _loop(module, a, source, trainer, guard, state, callback, checkpoint, run_key, rank)
    finally:
        bar.close()
    _end_of_run(module, a, source, trainer, state, checkpoint if rank == 0 else None, run_key, show)
    return state


def _run_key(a, loader, world: int) -> dict:
    """What a checkpoint must match to resume this run (a loader's batches cannot be checked); no tensors."""
    return {"batch_size": a.batch_size if loader is None else "a loader's", "num_data": a.num_data, "seed": a.seed,
            "world_size": world}


def _announce_join(trainer, show: bool) -> None:
    """A line on ``stderr`` (where progress is shown) saying from which step the hidden layers' families join the
    natural steps (``natgrad_layers="all"`` with ``natgrad_hidden_start`` after the first step); no tensors."""
    late = trainer.plan.late(trainer.plan.families()) if trainer.natgrad_lr else []
    if show and late and trainer.plan.hidden_start < trainer.plan.num_steps:
        print(f"fit: the hidden layers' q(u) take Adam steps, then natural steps from step {trainer.plan.hidden_start} "
              "(natgrad_hidden_start)", file=sys.stderr, flush=True)


def _end_of_run(module, a, source, trainer, state, checkpoint, run_key, show) -> None:
    """After the loop: the iterate average (``average``) or the exact finish into the module, then the checkpoint
    (``None``: none, or not rank 0's to write) with the final model and the loop's own state to resume from."""
    ends_changed = a.finish or a.plan.average is not None  # the module after the loop is not the loop's own
    loop_state = ({k: v.detach().clone() for k, v in module.state_dict().items()}
                  if checkpoint and ends_changed else None)
    changed = a.plan.finish()
    state.not_averaged = list(a.plan.averager.kept) if a.plan.averager is not None else []
    if show and state.not_averaged:
        print(f"fit: no iterate average of {', '.join(state.not_averaged)}: its averaged precision is not positive "
              "definite, or too ill-conditioned, in float64 (a run too short for it); the last iterate is kept",
              file=sys.stderr, flush=True)
    if a.finish:  # q(u) and the noise at their optimum on all the data, given the hyperparameters
        # on a forked RNG: a DeepGP's finish samples its hidden layers, and the checkpoint keeps the loop's RNG state,
        # from which a resumed run must draw what the unbroken one draws
        with torch.random.fork_rng(devices=[a.device] if a.device.type == "cuda" else []):
            finish_run(module, source, a.num_data, show)
    elif show and a.finish_skipped:
        print(f"fit: no exact finish: {a.finish_skipped}", file=sys.stderr, flush=True)
    if checkpoint:
        save_checkpoint(checkpoint, module, trainer.optimizer, state, run_key,
                        loop_state=loop_state if changed or a.finish else None)


def _initial_state(module, trainer, resume, expect, seed):
    """A fresh :class:`FitState` (seeding Pyro's RNG with ``seed``), or the one of the checkpoint ``resume``
    (checked against the run's ``expect``, ``None`` for a loader, whose batches cannot be checked)."""
    if resume is not None:
        return load_checkpoint(os.fspath(resume), module, trainer.optimizer, expect=expect)
    pyro.set_rng_seed(seed)
    return FitState()


def _loop(module, a, source, trainer, guard, state, callback, checkpoint, run_key, rank):
    """:func:`fit`'s steps from ``state.step`` to ``a.num_steps``: guarded steps, the callback on the steps whose
    losses are read back, checkpoints, and a window redone from its start when a deferred check fails."""
    step = called = state.step
    while step < a.num_steps:
        try:
            guard.begin(step)
            _guarded_step(step, source, trainer, guard)
            step = state.step = step + 1
            while callback is not None and called < len(state.losses):  # the steps whose losses are read back
                called += 1
                callback(called, state.losses[called - 1])
            if checkpoint and a.checkpoint_every and step % a.checkpoint_every == 0 and rank == 0:
                guard.check()
                save_checkpoint(checkpoint, module, trainer.optimizer, state, run_key)
        except _Redo as redo:  # a deferred check failed in the window: redo it from its start, with the remedy
            step = state.step = guard.redo(redo)
            source.restart(step)
    guard.check()
