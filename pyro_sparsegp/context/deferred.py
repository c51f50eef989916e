"""Deferred numerical checks: training steps on an accelerator without host synchronisation.

On the CPU every check of the package reads its answer at once (a read costs nothing there). On a GPU a read waits
for the device to finish everything queued before it, so a step with a dozen checks cannot overlap the host's work
with the device's. Inside :func:`deferred_checks` (which :func:`~pyro_sparsegp.infer.fit` enters on every device but
the CPU) the checks that guard a training step do not read anything back:

* :func:`~pyro_sparsegp.linalg.cholesky` factorises once, with the run's jitter (the base jitter times
  :attr:`DeferredChecks.jitter_scale`), and records a failed factorisation in a device flag instead of escalating at
  once;
* the kernels' exactness test of the product form of squared distances (``kernels._gemm_is_exact``) takes the product
  form and records an inexact evaluation in a device flag (once :attr:`DeferredChecks.exact_kernels` is set, every
  evaluation takes the exact differences);
* value checks of the data (finite, in the likelihood's support, float precision) are skipped: ``fit`` checks the
  whole ``X, y`` once before the first step, and a non-finite batch from a ``dataset``/``loader`` gives a non-finite
  loss, which ``fit``'s guard names;
* torch's distributions skip their argument validation (their arguments are computed by the package);
* a natural-gradient step that needs damping (:func:`~pyro_sparsegp.infer.natgrad.from_grads.natgrad_from_grads_`:
  its new precision has no Cholesky factor) records that in a device flag and leaves that output's q as it was (the
  window is redone) instead of halving the step with host reads.

``fit`` reads the flags with the losses, every ``sync_every`` steps. A window with a flag set is **redone**: the
parameters go back to the copy taken at its start, the jitter is raised tenfold (a
:class:`~pyro_sparsegp.linalg.CholeskyJitterWarning`, as the immediate escalation reports) or the kernels switch to
the exact differences for the rest of the run, or the natural-gradient steps damp at once (with host reads) for the
rest of the run, as they do on the CPU, and the window's steps run again on the same minibatches (a
``loader`` continues with its next batches; Adam's moments keep the discarded steps). So no step that used a failed
factor or an inexact kernel survives, and the only reads are ``fit``'s own, at its sync points.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DeferredChecks", "deferred_checks", "active", "tracing", "skip_reads"]

_ACTIVE: DeferredChecks | None = None


class DeferredChecks:
    """Device flags of the checks deferred to ``fit``'s sync points, and the run-level remedies they lead to.

    :param device: where the flags live (the module's device).
    :ivar flags: ``[3]`` float tensor on ``device``: ``flags[0] > 0`` if a Cholesky factorisation failed,
        ``flags[1] > 0`` if a kernel took the inexact product form, ``flags[2] > 0`` if a natural-gradient step
        needed damping, since the last :meth:`reset`.
    :ivar float jitter_scale: multiplies :func:`~pyro_sparsegp.linalg.cholesky`'s base jitter (raised tenfold per
        failed window).
    :ivar bool exact_kernels: every kernel evaluation takes the exact differences.
    :ivar bool damp_at_once: natural-gradient steps damp with host reads, as on the CPU.
    """

    CHOLESKY, INEXACT, DAMPING = 0, 1, 2

    def __init__(self, device):
        self.flags = torch.zeros(3, device=device)
        self.jitter_scale = 1.0
        self.exact_kernels = False
        self.damp_at_once = False

    @torch.no_grad()
    def record(self, which: int, failed: torch.Tensor) -> None:
        """Raise flag ``which`` where ``failed`` (a boolean tensor of any shape) has a true entry; no host read."""
        flag = self.flags[which : which + 1]
        torch.maximum(flag, failed.detach().any().reshape(1).to(flag), out=flag)

    def reset(self) -> None:
        """Clear the flags (on the device; no host read); ``flags`` keeps its shape ``[3]``."""
        self.flags.zero_()


def active() -> DeferredChecks | None:
    """The :class:`DeferredChecks` of the innermost :func:`deferred_checks` context, or ``None`` (checks read at
    once). Takes and returns no tensor, so shapes do not apply."""
    return _ACTIVE


def tracing() -> bool:
    """Whether a compiler is tracing the running code: ``torch.export`` (strict or not), ``torch.compile`` or
    ``torch.jit.trace``. The compiler's own predicates, never a tensor's value; no tensors, so shapes do not apply."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def skip_reads() -> bool:
    """Whether the checks that read a tensor's value back are skipped: inside :func:`deferred_checks` (``fit`` on an
    accelerator checked the data once) or while a compiler traces (:func:`tracing`; module docstring). No tensors, so
    shapes do not apply."""
    return _ACTIVE is not None or tracing()


@contextlib.contextmanager
def deferred_checks(checks: DeferredChecks):
    """Within the context the step's checks record into ``checks`` instead of reading back (module docstring), and
    torch's distributions do not validate their arguments. Takes no tensor, so shapes do not apply."""
    global _ACTIVE
    previous, validate = _ACTIVE, torch.distributions.Distribution._validate_args
    _ACTIVE = checks
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield checks
    finally:
        _ACTIVE = previous
        torch.distributions.Distribution.set_default_validate_args(validate)
