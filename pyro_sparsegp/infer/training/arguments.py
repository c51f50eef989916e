"""The arguments of :func:`~pyro_sparsegp.infer.fit`, checked once before anything is touched: a ``ValueError`` or
``TypeError`` that names the first wrong one, the data converted once to the module's device and dtype (``X [N, D]``,
``y [N, ...]``), and the defaults resolved (the natural-gradient plan of :mod:`~pyro_sparsegp.infer.natgrad.policy`,
the exact finish of :mod:`.exact_finish`). Argument checks: no paper equation."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ...checks.inputs import as_tensor
from ...context.composition import sampled_attributes
from ...context.naming import check_not_superseded
from ..natgrad.policy import NatGradPlan, resolve_natgrad
from .checkpoint import _read_checkpoint
from .distributed import _dist
from .natural_finish import resolve_any_finish
from .steps import _default_elbo

__all__ = ["DEFAULT_BATCH_SIZE", "Arguments", "check_arguments", "split_data"]

DEFAULT_BATCH_SIZE = 1024  # minibatch rows of X, y or a dataset when batch_size is not given


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
class Arguments:
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
    finish: str | None  # "exact" (q(u) and the noise at their optimum, exact_finish.py), "natural" (damped full-data
    # natural steps, natural_finish.py) or None
    finish_skipped: str | None  # why "auto" did not finish a module that could be (a progress line)
    finish_passes: int = 0  # the natural finish's passes at most


def _natgrad(module, natgrad_lr, elbo, num_steps, batch_fraction, options: dict):
    """``(natgrad_lr, plan)``: the step length (a float in ``(0, 1]`` or ``None``) and the
    :class:`~pyro_sparsegp.infer.natgrad.policy.NatGradPlan` of fit's natural-gradient ``options`` (``"auto"``
    resolved per likelihood, layer type and ``batch_fraction`` = B / N, ``None`` if unknown)."""
    if callable(natgrad_lr):
        raise ValueError("fit's NaturalPolicy.lr must be a step length in (0, 1], None or 'auto'; a schedule is "
                         "NaturalGradient's (fit builds its own from NaturalPolicy.warmup and cooldown)")
    natgrad_lr, plan = resolve_natgrad(module, natgrad_lr, elbo, _default_elbo(module), num_steps=num_steps,
                                       batch_fraction=batch_fraction, **options)
    return _positive("NaturalPolicy.lr", natgrad_lr, allow_none=True, high=1), plan


def split_data(X, y) -> tuple:
    """``(X, dataset, loader)`` from fit's ``X``: a ``torch.utils.data.DataLoader`` is a loader; a tensor, numpy array,
    list, tuple or pandas object is data (``X [N, D]`` with ``y [N, ...]``); any other object with ``__getitem__`` and
    ``__len__`` is a dataset (``dataset[idx]`` gives ``(X[idx], y[idx])`` for ``idx [B]``). A dataset or a loader
    holds ``y``: ``y`` must then be ``None`` (``ValueError`` otherwise)."""
    if X is None:
        raise ValueError("fit needs data: X and y, or as X a dataset (dataset[idx] gives (X[idx], y[idx])) or a "
                         "DataLoader of (X, y) batches")
    kind = None
    if isinstance(X, DataLoader):
        kind = "a DataLoader"
    elif not (isinstance(X, (torch.Tensor, list, tuple, str, bytes))
              or type(X).__module__.split(".")[0] in ("numpy", "pandas")):
        if hasattr(X, "__getitem__") and hasattr(X, "__len__"):
            kind = "a dataset"
    if kind is None:
        return X, None, None
    if y is not None:
        raise ValueError(f"fit's X is {kind} ({type(X).__name__}), which gives the batches (X, y) itself: pass y=None "
                         "(or pass the tensors X, y)")
    return (None, None, X) if kind == "a DataLoader" else (None, X, None)


def _check_files(checkpoint, resume, num_steps):
    if checkpoint is not None:
        folder = os.path.dirname(os.path.abspath(os.fspath(checkpoint)))
        if not os.path.isdir(folder):
            raise ValueError(f"the folder of checkpoint {os.fspath(checkpoint)!r} does not exist: {folder}")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"the folder of checkpoint {os.fspath(checkpoint)!r} is not writable: {folder}")
    if resume is not None:  # fail now, naming the file, not after building everything
        saved_step = int(_read_checkpoint(os.fspath(resume))["step"])
        if saved_step > num_steps:
            raise ValueError(f"checkpoint {os.fspath(resume)!r} (Checkpoint.resume) is at step {saved_step}, beyond "
                             f"num_steps={num_steps}")


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
            if name == "y" and hasattr(module, "check_inputs"):  # its NaN: missing outputs it allowed (or refused)
                t = t.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
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


def check_arguments(module, data: dict, run: dict, natgrad_options: dict) -> Arguments:
    """fit's arguments checked (a ``ValueError`` or ``TypeError`` naming the first wrong one, before anything is
    touched) and completed with their defaults: ``data`` (``X [N, D]`` and ``y [N, ...]``, a ``dataset`` or a
    ``loader``, ``num_data``), ``run`` (``num_steps``, ``batch_size``, ``lr``, ``natgrad_lr``, ``elbo``, ``seed``,
    ``checkpoint``, ``checkpoint_every``, ``resume``: a :class:`~.checkpoint.Checkpoint`'s fields, ``sync_every``) and
    the natural-gradient ``natgrad_options`` (a :class:`~pyro_sparsegp.infer.NaturalPolicy`'s other fields)."""
    X, y, dataset, loader, num_data = (data[k] for k in ("X", "y", "dataset", "loader", "num_data"))
    num_steps, batch_size, lr, natgrad_lr, elbo, seed = (run[k] for k in (
        "num_steps", "batch_size", "lr", "natgrad_lr", "elbo", "seed"))
    checkpoint, checkpoint_every, resume, sync_every = (run[k] for k in (
        "checkpoint", "checkpoint_every", "resume", "sync_every"))
    num_steps = _int("num_steps", num_steps, 0)
    finish = natgrad_options.pop("finish")
    if not torch.is_grad_enabled():  # else the first backward fails with "element 0 of tensors does not require grad"
        raise RuntimeError("fit needs gradients and was called with them disabled (inside torch.no_grad() or "
                           "torch.inference_mode()): call it outside that block")
    if loader is not None and batch_size is not None:
        raise ValueError("batch_size applies to X, y and a dataset; a DataLoader's batches are its own (set "
                         "batch_size on the DataLoader)")
    batch_size = _int("batch_size", DEFAULT_BATCH_SIZE if batch_size is None else batch_size, 1)
    lr = _positive("lr", lr)
    seed = _int("seed", seed, 0)
    _check_files(checkpoint, resume, num_steps)
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
    finish, skipped, passes = resolve_any_finish(module, finish, elbo, natgrad_lr, loader, clash, num_steps, epochs)
    plan.resolve_average(finish == "exact")
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
    return Arguments(X, y, num_data, num_steps, batch_size, lr, natgrad_lr, elbo, seed, checkpoint_every,
                      sync_every, dtype, device, plan, finish, skipped, passes)
