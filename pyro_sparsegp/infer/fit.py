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
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from torch.utils.data import DataLoader, Sampler

from ..deferred import DeferredChecks, deferred_checks
from ..inputs import as_tensor
from ..linalg import CholeskyJitterWarning, _warn_once
from ..naming import check_not_superseded
from .natgrad import (
    clear_natgrad_probes,
    natgrad_from_grads_,
    natgrad_pairs,
    noise_natgrad_likelihood,
    noise_step_from_grads_,
    set_natgrad_probes,
    solvegp_joint_natgrad_from_grads_,
)
from .natgrad_options import resolve_natgrad  # natsafe: warm-up, PD step, layers, averaging
from .progress import Progress

__all__ = ["fit", "FitState", "NonFiniteLossError", "save_checkpoint", "load_checkpoint", "EpochBatchSampler"]

CHECKPOINT_FORMAT = "pyro_sparsegp.fit/2"


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
        super().__init__(f"{why} at step {step}; {where}; lower the learning rate (lr / natgrad_lr) or check the data")
        self.step, self.loss, self.restored_step, self.state = step, loss, restored_step, state


_M1, _P = np.uint64(1540483477), np.uint64(4294967291)  # odd multiplier < 2^31, the largest prime < 2^32


def _round_keys(seed: int, epoch: int, rounds: int = 4) -> list:
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randint(0, 2**31 - 1, (rounds,), generator=g).tolist()


def permute_positions(pos, n: int, keys: list) -> torch.Tensor:
    """A pseudo-random permutation of ``range(n)`` evaluated at the positions ``pos`` (``[B]`` integers), in
    ``O(B)`` time and memory: a balanced Feistel network on the smallest even number of bits covering ``n``, one
    round per key (round function: multiply modulo a prime, then an xor-shift), with cycle-walking (positions that
    land outside ``range(n)`` are permuted again until they land inside, which keeps it a bijection of ``range(n)``).
    Returns ``LongTensor [B]``."""
    half = max(1, math.ceil(max(1, (n - 1).bit_length()) / 2))
    h, mask, s16 = np.uint64(half), np.uint64((1 << half) - 1), np.uint64(16)
    ks = [np.uint64(k) for k in keys]
    out = np.asarray(pos, dtype=np.uint64).copy()
    todo = np.arange(out.size)
    while todo.size:
        x = out[todo]
        left, right = x >> h, x & mask
        for k in ks:
            f = ((right + k) * _M1) % _P  # < 2^32 * 2^31: no overflow
            left, right = right, left ^ ((f ^ (f >> s16)) & mask)
        out[todo] = (left << h) | right
        todo = todo[out[todo] >= n]
    return torch.from_numpy(out.astype(np.int64))


class EpochBatchSampler(Sampler):
    """Minibatch index tensors of a pseudo-random permutation per epoch, a deterministic function of
    ``(seed, epoch)``, so that a resumed run sees the same batches as an uninterrupted one. Yields ``LongTensor [B]``
    (the last batch of an epoch may be shorter with one rank). Each batch is computed from its positions alone
    (:func:`permute_positions`): memory ``O(B)``, independent of ``N``.

    Data-parallel: with ``world_size`` ranks each step draws a global batch of ``batch_size * world_size`` indices
    and rank ``r`` takes the ``r``-th slice; the last incomplete global batch of an epoch is dropped so that every
    rank has a full batch."""

    def __init__(
        self, num_data: int, batch_size: int, seed: int = 0, start_step: int = 0, rank: int = 0, world_size: int = 1
    ):
        if world_size > 1 and num_data < batch_size * world_size:
            raise ValueError(f"{num_data} points cannot fill {world_size} batches of {batch_size}")
        self.num_data, self.batch_size, self.seed, self.start_step = num_data, batch_size, seed, start_step
        self.rank, self.world_size = rank, world_size

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``ceil(N / batch_size)`` with one rank, ``N // (batch_size * world_size)`` with
        several (the last incomplete global batch is dropped)."""
        if self.world_size == 1:
            return math.ceil(self.num_data / self.batch_size)
        return self.num_data // (self.batch_size * self.world_size)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The whole permutation of epoch ``epoch`` (``LongTensor [N]``; for inspection, ``O(N)``)."""
        return permute_positions(np.arange(self.num_data), self.num_data, _round_keys(self.seed, epoch))

    def __iter__(self):
        step, epoch, keys = self.start_step, None, None
        while True:
            e, pos = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, keys = e, _round_keys(self.seed, e)
            start = (pos * self.world_size + self.rank) * self.batch_size
            stop = min(start + self.batch_size, self.num_data)
            yield permute_positions(np.arange(start, stop), self.num_data, keys)
            step += 1


@dataclass
class FitState:
    """What :func:`fit` returns and checkpoints: the step count and the loss history (one float per step)."""

    step: int = 0
    losses: list = field(default_factory=list)


def save_checkpoint(path, module, optimizer, state: FitState, extra: dict | None = None) -> None:
    """Write the whole training state (module parameters, optimizer state, step, losses, RNG states and ``extra``,
    e.g. fit's batch size) to ``path`` atomically (a temporary file, then a rename)."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": state.step,
        "losses": list(state.losses),
        "torch_rng": torch.get_rng_state(),
        "extra": extra or {},
    }
    if torch.cuda.is_available():
        payload["cuda_rng"] = torch.cuda.get_rng_state_all()
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _read_checkpoint(path) -> dict:
    """The payload of a checkpoint file, or a ``ValueError`` naming the file and what is wrong with it."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist (or is not a file)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"checkpoint {path!r} is empty (an interrupted write?)")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated zip, garbage bytes, a pickle of arbitrary objects: all unreadable here
        raise ValueError(
            f"checkpoint {path!r} is not a readable torch file (truncated or not a checkpoint): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    keys = {"format", "module", "optimizer", "step", "losses", "torch_rng"}
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT or not keys <= payload.keys():
        raise ValueError(
            f"checkpoint {path!r} was not written by pyro_sparsegp's fit/save_checkpoint (format "
            f"{CHECKPOINT_FORMAT!r}); it holds a {type(payload).__name__}"
            + (f" with keys {sorted(payload)[:8]}" if isinstance(payload, dict) else "")
        )
    return payload


def load_checkpoint(path, module, optimizer=None, expect: dict | None = None) -> FitState:
    """Restore what :func:`save_checkpoint` wrote into ``module`` (and ``optimizer``); returns the
    :class:`FitState`. ``expect``: entries that the checkpoint's ``extra`` must match (fit passes its batch size,
    data size, seed and world size). Raises ``ValueError`` naming the file for a missing, empty, truncated,
    foreign or mismatching checkpoint; the module is left untouched then."""
    payload = _read_checkpoint(path)
    for k, v in (expect or {}).items():
        saved = payload.get("extra", {}).get(k)
        if saved != v:
            raise ValueError(f"checkpoint {path!r} was written with {k}={saved!r}; this run has {k}={v!r}: resume "
                             f"with the same {k} (or start afresh without resume)")
    own = module.state_dict()
    theirs = payload["module"]
    if own.keys() != theirs.keys() or any(own[k].shape != theirs[k].shape for k in own):
        diff = sorted(set(own) ^ set(theirs)) or [k for k in own if own[k].shape != theirs[k].shape]
        raise ValueError(f"checkpoint {path!r} holds another module layout (differing entries: {diff[:6]})")
    module.load_state_dict(theirs)
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    if "cuda_rng" in payload and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    return FitState(int(payload["step"]), list(payload["losses"]))


def _dist():
    """``(rank, world_size)`` of an initialised ``torch.distributed`` process group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _average(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t.div_(torch.distributed.get_world_size())


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


def _default_elbo(module):
    if hasattr(module, "analytic_elbo") and getattr(module, "likelihood", None) is not None:
        return "analytic"
    return TraceMeanField_ELBO()


# -- numerical failures ----------------------------------------------------------------------------------------------
_NUMERICAL = re.compile(r"\bnan\b|\binf\b|infinit|positive.definite|non-?finite|overflow", re.IGNORECASE)


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


def _first_batch(X, y, dataset, loader, batch_size, num_data, dtype, device):
    """A batch ``(X [B, D], y [B, ...])`` of the data source, for :func:`_create_lazy_parameters`."""
    if X is not None:
        return X[:batch_size], y[:batch_size]
    Xb, yb = dataset[torch.arange(min(batch_size, num_data))] if dataset is not None else next(iter(loader))
    return as_tensor(Xb, "X", dtype, device), as_tensor(yb, "y", dtype, device, floating=False)


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


_DEFER_ON_CPU = False  # tests set it to run the deferred checks (every device but the CPU) on the CPU
_MAX_JITTER_TRIES = 6  # tenfold escalations of a redone window's jitter, as linalg.cholesky's max_tries


class _Redo(Exception):
    """A sync found a deferred check's flag raised in the window (``pyro_sparsegp.deferred``): redo the window."""

    def __init__(self, cholesky: bool, inexact: bool):
        super().__init__(f"redo the window (failed factorisation: {cholesky}, inexact kernel: {inexact})")
        self.cholesky, self.inexact = cholesky, inexact


def _batches_from_indices(sampler, fetch):
    for idx in sampler:
        yield fetch(idx)


def fit(
    module,
    X=None,
    y=None,
    *,
    dataset=None,
    loader: DataLoader | None = None,
    num_data: int | None = None,
    num_steps: int = 1000,
    batch_size: int = 1024,
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
    natgrad_warmup: int | str = "auto",  # natsafe (issue #26 items 3-4): pyro_sparsegp/infer/natgrad_options.py
    natgrad_retraction: bool | str = "auto",
    natgrad_layers: str = "auto",
    average: float | None = None,
) -> FitState:
    """Train ``module`` by maximising its ELBO.

    :param module: e.g. :class:`~pyro_sparsegp.SVGP`, :class:`~pyro_sparsegp.SOLVEGP`, or any PyroModule with
        ``model``/``guide`` taking ``(X, y, num_data=N)``.
    :param X: inputs ``[N, D]`` (tensor, numpy array or list), with targets ``y`` ``[N, ...]``; moved once to the
        module's device (floating data to its dtype) and indexed per step. Or pass ``dataset`` or ``loader``.
    :param dataset: an object with ``len(dataset) = N`` whose ``dataset[idx]`` returns ``(X[idx], y[idx])`` for an
        index tensor ``idx [B]`` (e.g. :class:`~pyro_sparsegp.data_stream.MemmapDataset`; a ``TensorDataset`` works
        too): batches are read by index, so the data never has to fit in memory.
    :param loader: any DataLoader of ``(X, y)`` batches, with ``num_data`` the size of the whole data set.
    :param int num_steps: total number of optimisation steps (a resumed run continues up to this number).
    :param int batch_size: minibatch size for ``X, y`` or ``dataset`` (a positive integer).
    :param float lr: Adam learning rate (> 0).
    :param float natgrad_lr: ``"auto"`` (default), for a module trained on its closed-form bound: ``0.1`` with a
        :class:`~pyro_sparsegp.Gaussian` or :class:`~pyro_sparsegp.PolyaGammaLogit` likelihood (conjugate given the
        bound: the plain step is exact and stable); ``0.1`` with any other likelihood (Bernoulli, robust-max,
        softmax) together with the positive-definite step and a 5-step warm-up (``natgrad_retraction``,
        ``natgrad_warmup``): on digits (M = 100, 1,200 / 597, full batch, 100 steps;
        ``benchmarks/natgrad_nonconjugate.py``) robust-max VI reached 0.983 test accuracy (Adam 0.970, EP 0.975)
        and softmax VI 0.966 (Adam 0.945), each in about a sixth of ``fit_ep``'s wall time; the plain step without
        warm-up was as accurate but had to be damped on robust-max. A deep GP's natural steps stay on its last
        layer (``natgrad_layers``: on kin8nm, DGP 2 and 3 at 1,000 steps, 2 seeds, natural steps on every layer
        raised the training bound, -0.25 against -0.30 and -0.37 nats per point, but lowered the test
        log-likelihood by 0.03 and 0.04). With a Pyro ELBO passed as ``elbo``: ``None`` (Adam on everything). If
        set (``0 < natgrad_lr <= 1``), every full-covariance Gaussian variational family
        (q(u); SOLVE-GP's q(v⊥) too) takes natural-gradient steps of this length computed from the same backward
        pass (:func:`~pyro_sparsegp.infer.natgrad.natgrad_from_grads_`; Hensman et al. 2013 section 3.2; with
        ``elbo="analytic"`` a SOLVE-GP's two means move jointly,
        :func:`~pyro_sparsegp.infer.natgrad.solvegp_joint_natgrad_from_grads_`), the
        learnable noise variance of a :class:`~pyro_sparsegp.Gaussian` likelihood takes a Fisher-scoring step of the
        same length from the same gradient (:func:`~pyro_sparsegp.infer.natgrad.noise_step_from_grads_`: a running
        average of the minibatch estimates of its optimum given q(f)), and Adam trains only the other parameters.
        ``0.1`` is a good start: on UCI protein, keggundirected and tamielectric (M = 256, 1024) it was ahead of
        Adam and of GPyTorch at every epoch (``benchmarks/time_to_accuracy.py``).
        ``None`` trains q(u) with Adam like every other parameter. The two differ a lot (natural gradients reach the
        optimum of q(u) in a few steps with a Gaussian likelihood), so ``"auto"`` is not the same as ``None``: pass
        a number to turn natural gradients on for non-conjugate likelihoods, ``None`` to turn them off.
    :param elbo: ``"analytic"`` (the closed-form bound ``module.analytic_elbo``: no sampling at all; the default for
        modules that have it and a likelihood) or a Pyro ELBO (default for other modules: ``TraceMeanField_ELBO()``).
        The closed form integrates ``f`` exactly (in closed form or by Gauss-Hermite quadrature), so a module's
        ``integrate_f`` flag, which chooses between sampling ``f`` and integrating it in ``model``/``guide``, changes
        nothing here; it matters when you pass a Pyro ELBO (or train the model/guide with ``SVI`` yourself).
    :param bool progress: show progress on ``stderr`` (rank 0 only): a bar on a terminal (or a notebook with
        ``ipywidgets``), else (a redirected log, CI) a plain line every 5 % of the steps or every 30 s with the
        step, the running ELBO estimate and the steps per second (:mod:`pyro_sparsegp.infer.progress`). Warnings
        raised during the run are written above the bar, never inside it.
    :param int seed: seeds the minibatch order (and Pyro's RNG at the start of a fresh run).
    :param checkpoint: path written every ``checkpoint_every`` steps and at the end (its folder must exist).
    :param resume: path of a checkpoint to continue from (same module, batch size, data size and seed).
    :param callback: ``callback(step, loss)`` after every step, once its loss is read back (with ``sync_every = k``
        it is called for the ``k`` steps of a window at the window's end, when the module is at the last of them).
    :param int sync_every: how often the loss is read back from the device to check it and show progress (default
        1 on the CPU, where it costs nothing, 20 on a GPU, where each read waits for the device). A numerical failure
        inside a window restores the parameters copied at the start of the window (or of the previous one if the
        first step failed). On every device but the CPU nothing else is read back: the steps' own checks are
        deferred to these reads (:mod:`pyro_sparsegp.deferred`), and a window in which a Cholesky factorisation
        failed (or a kernel's product form was inexact) is redone from its start with ten times the jitter (or the
        exact differences), with a :class:`~pyro_sparsegp.linalg.CholeskyJitterWarning` for the jitter.
    :param natgrad_warmup: steps of a log-linear warm-up of the natural step length from ``1e-4`` to
        ``natgrad_lr`` (Salimbeni, Eleftheriadis, Hensman 2018; :class:`~pyro_sparsegp.infer.schedules.LogLinearWarmup`;
        the schedule counts from step 0, so a resumed run continues it). ``"auto"`` (default): 5 (the paper's)
        where ``"auto"`` turned natural gradients on for a non-conjugate likelihood, else 0.
    :param natgrad_retraction: ``True``: every family takes the positive-definite precision step of Lin, Schmidt,
        Khan (2020) (:func:`~pyro_sparsegp.infer.natgrad.natgrad_from_grads_`; never damped); ``False``: the plain
        step (damped by halving where it would leave the positive-definite cone). ``"auto"`` (default): the
        positive-definite step for a non-conjugate likelihood and for families off the likelihood's layer (a deep
        GP's hidden layers), the plain one for a Gaussian likelihood's own layer (exact there).
    :param str natgrad_layers: ``"all"``: every full-covariance family of the module takes natural steps (every
        layer of a deep GP); ``"last"`` or ``"auto"`` (default): the module's own choice
        (:func:`~pyro_sparsegp.infer.natgrad.natgrad_families`: a DeepGP's last layer).
    :param average: ``None`` (default) or a fraction ``a`` in ``(0, 1]``: keep the Polyak-Ruppert average of the
        families' natural parameters and of a learnable Gaussian noise over the last ``ceil(a * num_steps)`` steps
        and write it into the module at the end (:class:`~pyro_sparsegp.infer.averaging.IterateAverage`), so that
        the final model is the centre of the noisy plateau rather than its last iterate (families are averaged
        whether natural gradients or Adam train them; the kernel hyperparameters are not). A resumed run averages
        the steps it takes itself.
    :returns: :class:`FitState` with the per-step losses (negative ELBO estimates).
    :raises NonFiniteLossError: on a numerical failure (non-finite loss or gradient, or an error from non-finite
        parameters), after restoring the last good parameters that were kept; it names the step.
    """
    # -- arguments --------------------------------------------------------------------------------------------------
    num_steps = _int("num_steps", num_steps, 0)
    batch_size = _int("batch_size", batch_size, 1)
    lr = _positive("lr", lr)
    # natsafe: "auto" per likelihood and layer type, warm-up, positive-definite step, layers, averaging
    natgrad_lr, ng = resolve_natgrad(module, natgrad_lr, elbo, _default_elbo(module), warmup=natgrad_warmup,
                                     retraction=natgrad_retraction, layers=natgrad_layers, average=average,
                                     num_steps=num_steps)
    natgrad_lr = _positive("natgrad_lr", natgrad_lr, allow_none=True, high=1)
    checkpoint_every = _int("checkpoint_every", checkpoint_every, 0)
    seed = _int("seed", seed, 0)
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
    sources = sum(s is not None for s in (X, dataset, loader))
    if sources != 1:
        raise ValueError("fit needs exactly one data source: X and y, dataset=..., or loader=...")
    check_not_superseded(module)
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
    num_data = _int("num_data", num_data, 1)
    if loader is None:
        batch_size = min(batch_size, num_data)
    elbo = _default_elbo(module) if elbo is None else elbo
    if elbo != "analytic" and not hasattr(elbo, "differentiable_loss"):
        raise TypeError('elbo must be a Pyro ELBO with differentiable_loss, or "analytic"')
    if elbo == "analytic" and not hasattr(module, "analytic_elbo"):
        raise TypeError(f'elbo="analytic" needs a module with analytic_elbo; {type(module).__name__} has none')

    if elbo != "analytic":  # a model/guide may create parameters at its first call: create them now
        first = _first_batch(X, y, dataset, loader, batch_size, num_data, dtype, device)
        _create_lazy_parameters(module, *first, num_data)
    families = ng.families() if natgrad_lr else []  # natsafe
    if natgrad_lr and not families:
        raise ValueError("natgrad_lr needs a module with a full-covariance Gaussian variational family (q_u)")
    noise_lik = noise_natgrad_likelihood(module) if families else None
    # SOLVE-GP layers with both q(u) and q(v⊥) in the families move their means jointly (the closed-form bound
    # carries the probe whose gradient couples them; natgrad.solvegp_joint_natgrad_from_grads_)
    pairs = natgrad_pairs(module, families) if elbo == "analytic" else []
    paired = {id(q) for gp in pairs for q in (gp.q_u, gp.q_v)}
    solo = [q for q in families if id(q) not in paired]
    nat_ids = {id(p) for q in families for p in q.parameters()}
    if noise_lik is not None:
        nat_ids.add(id(noise_lik.noise_unconstrained))
    params = [p for p in module.parameters() if id(p) not in nat_ids]
    all_params = list(module.parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    ng.start(families or ng.families(), noise_lik or noise_natgrad_likelihood(module), natgrad_lr)  # natsafe

    rank, world = _dist()
    run_key = {"batch_size": batch_size, "num_data": num_data, "seed": seed, "world_size": world}
    state = FitState()
    if resume is not None:
        state = load_checkpoint(os.fspath(resume), module, optimizer, expect=run_key if loader is None else None)
    else:
        pyro.set_rng_seed(seed + rank)
    if world > 1:  # every rank starts from rank 0's parameters
        with torch.no_grad():
            for p in module.parameters():
                torch.distributed.broadcast(p.data, src=0)

    # -- deferred checks (no host read inside a step on an accelerator: pyro_sparsegp.deferred) -------------------
    checks = DeferredChecks(device) if (device.type != "cpu" or _DEFER_ON_CPU) else None
    if checks is not None and X is not None:  # the value checks the steps skip, once for the whole data
        lik = getattr(module, "likelihood", None)
        if lik is not None and hasattr(lik, "check_y"):
            lik.check_y(y)
    step_context = (lambda: deferred_checks(checks)) if checks is not None else contextlib.nullcontext

    # -- batches ----------------------------------------------------------------------------------------------------
    if loader is None:
        if X is not None:
            def fetch(idx):
                idx = idx.to(device, non_blocking=True)
                return X[idx], y[idx]
        else:
            def fetch(idx):
                Xb, yb = dataset[idx]
                Xb = torch.as_tensor(Xb).to(device=device, dtype=dtype, non_blocking=True)
                yb = torch.as_tensor(yb)
                yb = yb.to(device=device, dtype=dtype if yb.is_floating_point() else yb.dtype, non_blocking=True)
                return Xb, yb
        def batches_from(start):
            sampler = EpochBatchSampler(num_data, batch_size, seed, start_step=start, rank=rank, world_size=world)
            return _batches_from_indices(sampler, fetch)

        batches = batches_from(state.step)
    else:
        def loader_batches():
            while True:
                for Xb, yb in loader:
                    Xb = Xb.to(device=device, dtype=dtype)
                    yield Xb, yb.to(device=device, dtype=dtype if yb.is_floating_point() else yb.dtype)

        batches = loader_batches()
        batches_from = None  # a loader cannot be replayed: a redone window continues with its next batches

    def loss_fn(Xb, yb):
        if elbo == "analytic":
            return -module.analytic_elbo(Xb, yb, num_data=num_data)
        return elbo.differentiable_loss(module.model, module.guide, Xb, yb, num_data=num_data)

    # -- loop -------------------------------------------------------------------------------------------------------
    sync_every = (20 if device.type != "cpu" else 1) if sync_every is None else _int("sync_every", sync_every, 1)
    show = progress and rank == 0
    bar = Progress(num_steps, state.step, enabled=show, desc="fit")
    running = None
    snaps = _Snapshots(module)
    window_start = state.step
    pending = []  # per step since the last sync: [loss, check] (and the deferred flags so far), on the device
    zero = torch.zeros((), dtype=dtype, device=device)

    def sync():
        """Read back the pending losses; returns the index of the first bad step in the window, or None. Raises
        ``_Redo`` when a deferred check's flag was raised at or before the first non-finite loss."""
        nonlocal running, pending
        if not pending:
            return None
        table = torch.stack(pending)
        if checks is not None and world > 1:  # every rank redoes the window if one must
            flags = table[:, 2:].contiguous()
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            table[:, 2:] = flags
        vals = table.tolist()
        pending = []
        bad = next((i for i, row in enumerate(vals) if not (math.isfinite(row[0]) and math.isfinite(row[1]))), None)
        if checks is not None:
            flagged = next((i for i, row in enumerate(vals) if row[2] > 0 or row[3] > 0), None)
            if flagged is not None and (bad is None or flagged <= bad):  # else the non-finite loss came first
                row = vals[-1]
                raise _Redo(row[2 + checks.CHOLESKY] > 0, row[2 + checks.INEXACT] > 0)
        if bad is not None:
            state.losses.extend(row[0] for row in vals[:bad])
            return bad, vals[bad][0]
        state.losses.extend(row[0] for row in vals)
        if show:
            for row in vals:
                running = row[0] if running is None else 0.95 * running + 0.05 * row[0]
            bar.update(len(vals), -running)
        return None

    def fail(step_bad, value, good, exc=None, reason=""):
        restored = snaps.restore(good)
        raise NonFiniteLossError(step_bad, value, restored, state, reason) from exc

    def check_pending(exc=None):
        """Sync; on a bad loss in the window, restore the last good parameters and raise."""
        bad = sync()
        if bad is not None:
            i, value = bad
            fail(window_start + i, value, window_start + i - 1, exc)

    optimizer_copy = None

    def redo(redo_exc):
        """A window whose steps used a failed factorisation or an inexact kernel: back to its start, with the remedy
        (pyro_sparsegp.deferred), on the same minibatches."""
        nonlocal pending, batches
        pending = []
        snaps.restore(window_start)
        ng.rewind()  # natsafe: the window's steps leave the iterate average
        optimizer.load_state_dict(copy.deepcopy(optimizer_copy))  # the copy may serve another redo
        checks.reset()
        if redo_exc.cholesky:
            checks.jitter_scale *= 10.0
            if checks.jitter_scale > 10.0**_MAX_JITTER_TRIES:
                raise torch.linalg.LinAlgError(
                    f"fit: a Cholesky factorisation failed at step {window_start} or the {sync_every - 1} after it "
                    f"even with {checks.jitter_scale / 10:.0e} times the base jitter; check the inputs (duplicate "
                    "points, NaN) and the kernel hyperparameters")
            _warn_once(("fit-jitter", checks.jitter_scale), f"fit: a Cholesky factorisation failed in the window "
                       f"from step {window_start}; the window is redone with the jitter raised to "
                       f"{checks.jitter_scale:.0e} times the base for the rest of the run", CholeskyJitterWarning)
        if redo_exc.inexact:
            checks.exact_kernels = True
        if batches_from is not None:
            batches = batches_from(window_start)
        return window_start

    def one_step(step):
        """One optimisation step, and the sync, callbacks and checkpoint due after it; returns the next step."""
        nonlocal window_start, called, optimizer_copy
        if (step - window_start) % sync_every == 0:
            snaps.take(step)
            ng.mark()  # natsafe
            window_start = step
            if checks is not None:  # a redone window restarts Adam's moments too (one device copy per window)
                optimizer_copy = copy.deepcopy(optimizer.state_dict())
        try:
            Xb, yb = next(batches)
            for p in all_params:
                p.grad = None
            set_natgrad_probes(pairs)
            with step_context():
                loss = loss_fn(Xb, yb)
                loss.backward()
            if world > 1:  # data-parallel: average the loss and the gradients over ranks
                loss = _average(loss.detach().clone().reshape(1))[0]
                for p in all_params + [gp._cross_probe for gp in pairs]:
                    if p.grad is not None:
                        _average(p.grad)
            grads = [p.grad for p in all_params if p.grad is not None]
            check = loss.detach() + (torch.stack(torch._foreach_norm(grads, float("inf"))).sum() * 0
                                     if grads else zero)
            row = torch.stack([loss.detach(), check])
            pending.append(row if checks is None else torch.cat([row, checks.flags.to(row.dtype)]))
            if sync_every == 1 or (step + 1 - window_start) % sync_every == 0 or step + 1 == num_steps:
                check_pending()
            with step_context():
                optimizer.step()
                glr = ng.lr(step) if families else None  # natsafe: the warm-up's step length
                for gp in pairs:
                    if gp._cross_probe.grad is not None:
                        solvegp_joint_natgrad_from_grads_(gp, glr, ng.retract(gp.q_u))
                    else:  # a bound that bypassed the layer's qf: the factors' own natural-gradient steps
                        natgrad_from_grads_(gp.q_u, glr, ng.retract(gp.q_u))
                        natgrad_from_grads_(gp.q_v, glr, ng.retract(gp.q_v))
                for q in solo:
                    natgrad_from_grads_(q, glr, ng.retract(q))
                if noise_lik is not None:  # y [B] or [B, L]: num_data * L observations share the noise
                    noise_step_from_grads_(noise_lik, glr, num_data * (yb.numel() // max(yb.shape[0], 1)))
            ng.after_step(step)  # natsafe: the iterate average
        except (NonFiniteLossError, _Redo):
            raise
        except Exception as exc:  # noqa: BLE001 - classified: only numerical failures are caught
            if not _is_numerical(exc, module):
                raise
            check_pending(exc)
            # the losses up to this step were finite: the parameters of this step are the last good ones
            # unless the failure came from its own loss evaluation (then the previous step's)
            in_update = len(state.losses) > step
            fail(step, float("nan"), step if in_update else step - 1, exc,
                 reason=f"numerical failure ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})")
        finally:
            clear_natgrad_probes(pairs)
        step += 1
        state.step = step
        while callback is not None and called < len(state.losses):  # the steps whose losses are read back
            called += 1
            callback(called, state.losses[called - 1])
        if checkpoint and checkpoint_every and step % checkpoint_every == 0 and rank == 0:
            check_pending()
            save_checkpoint(checkpoint, module, optimizer, state, run_key)
        return step

    step = called = state.step
    try:
        while step < num_steps:
            try:
                step = one_step(step)
            except _Redo as redo_exc:
                step = state.step = redo(redo_exc)
        check_pending()
    finally:
        bar.close()
    ng.finish()  # natsafe: the iterate average into the module
    if checkpoint and rank == 0:
        save_checkpoint(checkpoint, module, optimizer, state, run_key)
    return state
