"""A training loop for the package's modules: minibatches from a DataLoader, Adam on everything (or Adam on
hyperparameters plus natural-gradient steps on q(u)), a progress bar with the running ELBO, a guard against
non-finite losses, and checkpoints that resume training identically.

Data-parallel: run the same script under ``torchrun --nproc_per_node=K`` after
``torch.distributed.init_process_group("gloo")`` (``"nccl"`` on GPUs). ``fit`` then broadcasts rank 0's parameters,
gives each rank its slice of every global minibatch, averages losses and gradients over ranks, and averages the
natural parameters after a natural-gradient step (exact, since the step is linear in the data term), so the ranks
stay identical and memory per rank is independent of N.

Any module with ``model(X, y, num_data=N)`` / ``guide(X, y, num_data=N)`` methods works (``SVGP`` and the later
layers follow that convention).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from torch.utils.data import DataLoader, Sampler, TensorDataset
from tqdm.auto import tqdm

from .natgrad import natgrad_step_for

__all__ = ["fit", "FitState", "NonFiniteLossError", "save_checkpoint", "load_checkpoint", "EpochBatchSampler"]


class NonFiniteLossError(FloatingPointError):
    """Raised by :func:`fit` when the loss or a gradient is not finite. The module has been restored to the
    parameters of the last step whose loss was finite; ``step`` is the step at which it happened."""

    def __init__(self, step: int, loss: float):
        super().__init__(
            f"non-finite loss ({loss}) at step {step}; parameters restored to those of the last finite loss; "
            "lower the learning rate or check the data"
        )
        self.step = step
        self.loss = loss


class EpochBatchSampler(Sampler):
    """Minibatch indices of a random permutation per epoch, a deterministic function of ``(seed, epoch)``, so that
    a resumed run sees the same batches as an uninterrupted one.

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
        if self.world_size == 1:
            return math.ceil(self.num_data / self.batch_size)
        return self.num_data // (self.batch_size * self.world_size)

    def __iter__(self):
        step = self.start_step
        while True:
            epoch, pos = divmod(step, self.steps_per_epoch)
            g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            perm = torch.randperm(self.num_data, generator=g)
            start = (pos * self.world_size + self.rank) * self.batch_size
            yield perm[start : start + self.batch_size].tolist()
            step += 1


@dataclass
class FitState:
    """What :func:`fit` returns and checkpoints: the step count and the loss history (one float per step)."""

    step: int = 0
    losses: list = field(default_factory=list)


def save_checkpoint(path, module, optimizer, state: FitState, extra: dict | None = None) -> None:
    """Write the whole training state (module parameters, optimizer state, step, losses, RNG states) to ``path``."""
    payload = {
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


def load_checkpoint(path, module, optimizer=None) -> FitState:
    """Restore what :func:`save_checkpoint` wrote into ``module`` (and ``optimizer``); returns the :class:`FitState`."""
    payload = torch.load(path, weights_only=False)
    module.load_state_dict(payload["module"])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    if "cuda_rng" in payload and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    return FitState(payload["step"], payload["losses"])


def _dist():
    """``(rank, world_size)`` of an initialised ``torch.distributed`` process group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _average(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t.div_(torch.distributed.get_world_size())


def _qu_params(module):
    q = getattr(module, "q_u", None)
    return set() if q is None else {id(p) for p in q.parameters()}


def fit(
    module,
    X: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    loader: DataLoader | None = None,
    num_data: int | None = None,
    num_steps: int = 1000,
    batch_size: int = 1024,
    lr: float = 0.01,
    natgrad_lr: float | None = None,
    elbo=None,
    seed: int = 0,
    progress: bool = True,
    checkpoint: str | None = None,
    checkpoint_every: int = 0,
    resume: str | None = None,
    callback=None,
) -> FitState:
    """Train ``module`` by maximising its ELBO.

    :param module: e.g. :class:`~pyro_sparsegp.SVGP`.
    :param X: inputs ``[N, D]`` (with ``y`` ``[N, ...]``); or pass ``loader`` (any DataLoader of ``(X, y)``
        batches) and ``num_data``.
    :param int num_steps: total number of optimisation steps (a resumed run continues up to this number).
    :param int batch_size: minibatch size when ``X, y`` are given.
    :param float lr: Adam learning rate.
    :param float natgrad_lr: if set, q(u) is updated by natural-gradient steps of this length (closed form for a
        Gaussian likelihood, Hensman 2013 section 3.2, and for the Pólya-Gamma logit likelihood, Wenzel et al.
        2019; by automatic differentiation otherwise) and Adam trains only the other parameters.
    :param elbo: a Pyro ELBO (default ``TraceMeanField_ELBO()``: analytic KL), or ``"analytic"`` to maximise the
        module's closed-form bound (``module.analytic_elbo``: no sampling at all).
    :param int seed: seeds the minibatch order (and Pyro's RNG at the start of a fresh run).
    :param checkpoint: path written every ``checkpoint_every`` steps and at the end.
    :param resume: path of a checkpoint to continue from (same module layout).
    :param callback: ``callback(step, loss)`` after every step.
    :returns: :class:`FitState` with the per-step losses (negative ELBO estimates).
    :raises NonFiniteLossError: on a non-finite loss or gradient, after restoring the last finite parameters.
    """
    if loader is None:
        if X is None or y is None:
            raise ValueError("fit needs X and y, or a DataLoader")
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"X and y have different numbers of rows: {X.shape[0]} and {y.shape[0]}")
        num_data = X.shape[0]
        batch_size = min(batch_size, num_data)
    elif num_data is None:
        raise ValueError("fit with a DataLoader needs num_data (the size of the whole data set)")
    elbo = elbo or TraceMeanField_ELBO()
    if elbo != "analytic" and not hasattr(elbo, "differentiable_loss"):
        raise TypeError('elbo must be a Pyro ELBO with differentiable_loss, or "analytic"')

    ref = next(module.parameters())
    qu_ids = _qu_params(module) if natgrad_lr else set()
    if natgrad_lr and not qu_ids:
        raise ValueError("natgrad_lr needs a module with a q_u variational family")
    if natgrad_lr and hasattr(module, "q_v"):
        raise ValueError("natural-gradient steps are implemented for SVGP's q(u) only; train SOLVE-GP with Adam")
    params = [p for p in module.parameters() if id(p) not in qu_ids]
    optimizer = torch.optim.Adam(params, lr=lr)

    rank, world = _dist()
    state = FitState()
    if resume is not None:
        state = load_checkpoint(resume, module, optimizer)
    else:
        pyro.set_rng_seed(seed + rank)
    if world > 1:  # every rank starts from rank 0's parameters
        with torch.no_grad():
            for p in module.parameters():
                torch.distributed.broadcast(p.data, src=0)
    if loader is None:
        sampler = EpochBatchSampler(num_data, batch_size, seed, start_step=state.step, rank=rank, world_size=world)
        # its own generator: creating the iterator then draws no number from the global RNG (which Pyro's
        # sampling uses), so a resumed run draws the same particles as an uninterrupted one
        loader = DataLoader(TensorDataset(X, y), batch_sampler=sampler, generator=torch.Generator())

    nat = natgrad_step_for(getattr(module, "likelihood", None)) if natgrad_lr else None

    bar = tqdm(total=num_steps, initial=state.step, disable=not progress or rank > 0, desc="fit", dynamic_ncols=True)
    running = None
    last_finite = None  # parameters at which the loss was last finite
    it = iter(loader)
    try:
        while state.step < num_steps:
            try:
                Xb, yb = next(it)
            except StopIteration:
                it = iter(loader)
                Xb, yb = next(it)
            Xb = Xb.to(device=ref.device, dtype=ref.dtype)
            yb = yb.to(device=ref.device, dtype=ref.dtype if yb.is_floating_point() else yb.dtype)
            optimizer.zero_grad(set_to_none=True)
            try:
                if elbo == "analytic":
                    loss = -module.analytic_elbo(Xb, yb, num_data=num_data)
                else:
                    loss = elbo.differentiable_loss(module.model, module.guide, Xb, yb, num_data=num_data)
            except ValueError:
                # with validation on, a distribution refuses NaN parameters before the loss can be NaN
                if all(bool(torch.isfinite(p).all()) for p in module.parameters()):
                    raise
                loss = torch.tensor(float("nan"))
            else:
                loss.backward()
            if world > 1:  # data-parallel: average the loss and the gradients over ranks
                loss = _average(loss.detach().clone().reshape(1))[0]
                for p in params:
                    if p.grad is not None:
                        _average(p.grad)
            value = loss.item()
            finite = math.isfinite(value) and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
            if not finite:
                if last_finite is not None:
                    module.load_state_dict(last_finite)
                raise NonFiniteLossError(state.step, value)
            last_finite = {k: v.detach().clone() for k, v in module.state_dict().items()}
            optimizer.step()
            if nat is not None:
                nat(module, Xb, yb, lr=natgrad_lr, num_data=num_data)
            state.step += 1
            state.losses.append(value)
            running = value if running is None else 0.95 * running + 0.05 * value
            bar.update(1)
            if progress and (state.step % 10 == 0 or state.step == num_steps):
                bar.set_postfix(elbo=f"{-running:.4g}")
            if callback is not None:
                callback(state.step, value)
            if checkpoint and checkpoint_every and state.step % checkpoint_every == 0 and rank == 0:
                save_checkpoint(checkpoint, module, optimizer, state)
    finally:
        bar.close()
    if checkpoint and rank == 0:
        save_checkpoint(checkpoint, module, optimizer, state)
    return state
