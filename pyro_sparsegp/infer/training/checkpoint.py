"""Checkpoints of :func:`~pyro_sparsegp.infer.fit`: the whole training state (module parameters, optimiser state,
step, losses, RNG states) in one torch file, written atomically, read back with a named error for a missing, empty,
truncated, foreign or mismatching file; :class:`FitState`, what ``fit`` returns and checkpoints; and
:class:`Checkpoint`, ``fit``'s ``checkpoint=`` (where to write, how often, what to resume from)."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field

import torch

__all__ = ["Checkpoint", "FitState", "save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "pyro_sparsegp.fit/2"


@dataclass(frozen=True)
class Checkpoint:
    """Where :func:`~pyro_sparsegp.infer.fit` writes its checkpoints and what it resumes from:
    ``fit(..., checkpoint=Checkpoint(path, every=0, resume=None))``; ``checkpoint=path`` is ``Checkpoint(path)``.

    :param path: the file written at the end of the run (and every ``every`` steps), from which a run resumes
        identically; ``None``: none written (with ``resume``: resume without writing).
    :param int every: also write it every this many steps (``0``: only at the end).
    :param resume: a checkpoint file to resume from (its step, losses, parameters, optimiser and RNG states), ``True``
        for ``path`` itself, or ``None``: a fresh run.
    """

    path: object = None
    every: int = 0
    resume: object = None

    def __post_init__(self):
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"Checkpoint.path must be a file path or None, got {self.path!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, numbers.Integral) or self.every < 0:
            raise ValueError(f"Checkpoint.every must be an integer >= 0 (steps; 0: only at the end), got "
                             f"{self.every!r}")
        if self.every and self.path is None:
            raise ValueError("Checkpoint.every needs a checkpoint path: Checkpoint(path, every=...)")
        if self.resume is True and self.path is None:
            raise ValueError("Checkpoint.resume=True resumes from path, and path is None: give the path")
        if not (self.resume is None or self.resume is True or isinstance(self.resume, (str, os.PathLike))):
            raise ValueError(f"Checkpoint.resume must be a file path, True (resume from path) or None, got "
                             f"{self.resume!r}")

    @property
    def resume_path(self):
        """The file to resume from (``path`` for ``resume=True``), or ``None``; no tensors, so shapes do not apply."""
        return self.path if self.resume is True else self.resume


def as_checkpoint(checkpoint) -> Checkpoint:
    """``fit``'s ``checkpoint``: ``None`` (no checkpoint), a path (``Checkpoint(path)``) or a :class:`Checkpoint`; any
    other value raises ``ValueError``. No tensors, so shapes do not apply."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    if checkpoint is None or isinstance(checkpoint, (str, os.PathLike)):
        return Checkpoint(checkpoint)
    raise ValueError(f"checkpoint must be a file path, a ps.infer.Checkpoint(path, every=0, resume=None) or None, got "
                     f"{checkpoint!r}")


@dataclass
class FitState:
    """What :func:`fit` returns and checkpoints: the step count and the loss history (one float per step); and, set at
    the end of a run (not checkpointed), the names of the families whose iterate average could not be used
    (``average``: a near-singular average keeps the last iterate)."""

    step: int = 0
    losses: list = field(default_factory=list)
    not_averaged: list = field(default_factory=list)


def save_checkpoint(path, module, optimizer, state: FitState, extra: dict | None = None,
                    loop_state: dict | None = None) -> None:
    """Write the whole training state (module parameters, optimizer state, step, losses, RNG states and ``extra``,
    e.g. fit's batch size) to ``path`` atomically (a temporary file, then a rename). ``loop_state``: the module's
    ``state_dict`` as the training loop left it, where the end of ``fit`` then changed the module (the exact finish,
    the iterate average): ``"module"`` holds the final model and :func:`load_checkpoint` resumes from this one."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": state.step,
        "losses": list(state.losses),
        "torch_rng": torch.get_rng_state(),
        "extra": extra or {},
    }
    if loop_state is not None:
        payload["loop_module"] = loop_state
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


def _check_optimizer_layout(path, optimizer, saved: dict) -> None:
    """A ``ValueError`` naming the file if the checkpoint's optimiser state has other parameter groups than
    ``optimizer`` (a run with natural gradients on against one with them off,
                   another ``NaturalPolicy.layers`` or ``elbo``:
    they hand Adam different parameters), before anything is loaded."""
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", ())) for g in saved.get("param_groups", ())]
    if ours != theirs:
        raise ValueError(
            f"checkpoint {path!r} was written by a run whose Adam trained other parameters (groups of {theirs} "
            f"tensors; this run: {ours}): resume with the same natgrad kind (natural gradients on or off), "
            "NaturalPolicy.layers and elbo as the run that wrote it (or start afresh without Checkpoint.resume)")


def load_checkpoint(path, module, optimizer=None, expect: dict | None = None) -> FitState:
    """Restore what :func:`save_checkpoint` wrote into ``module`` (and ``optimizer``); returns the
    :class:`FitState`. ``expect``: entries that the checkpoint's ``extra`` must match (fit passes its batch size,
    data size, seed and world size). Raises ``ValueError`` naming the file for a missing, empty, truncated,
    foreign or mismatching checkpoint (module layout, or the optimiser's parameter groups); the module is left
    untouched then. The optimiser keeps its own learning rates (a resumed run may continue with another ``lr``; Adam's
    moments come from the file)."""
    payload = _read_checkpoint(path)
    for k, v in (expect or {}).items():
        saved = payload.get("extra", {}).get(k)
        if saved != v:
            raise ValueError(f"checkpoint {path!r} was written with {k}={saved!r}; this run has {k}={v!r}: resume "
                             f"with the same {k} (or start afresh without resume)")
    own = module.state_dict()
    theirs = payload.get("loop_module", payload["module"])  # training continues from the loop's own iterate
    if own.keys() != theirs.keys() or any(own[k].shape != theirs[k].shape for k in own):
        diff = sorted(set(own) ^ set(theirs)) or [k for k in own if own[k].shape != theirs[k].shape]
        raise ValueError(f"checkpoint {path!r} holds another module layout (differing entries: {diff[:6]})")
    if optimizer is not None:
        _check_optimizer_layout(path, optimizer, payload["optimizer"])
    module.load_state_dict(theirs)
    if optimizer is not None:  # Adam's moments and step counts from the file; the learning rates of this run
        rates = [g["lr"] for g in optimizer.param_groups]
        optimizer.load_state_dict(payload["optimizer"])
        for g, lr in zip(optimizer.param_groups, rates, strict=True):
            g["lr"] = lr
    torch.set_rng_state(payload["torch_rng"])
    if "cuda_rng" in payload and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    return FitState(int(payload["step"]), list(payload["losses"]))
