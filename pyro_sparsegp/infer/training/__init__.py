"""The training loop :func:`fit` (in :mod:`.loop`) and its parts, one module each: :mod:`.batches` (the batch source),
:mod:`.steps` (one step: loss, gradients, update), :mod:`.guard` (non-finite losses, deferred device checks, a window
redone with more jitter), :mod:`.checkpoint`, :mod:`.distributed` (data-parallel under ``torchrun``),
:mod:`.exact_finish` (q(u) and the Gaussian noise at their optimum on all the data at the end) and :mod:`.progress`
(a bar on a terminal, a line every 5 % in a log)."""

from .batches import EpochBatchSampler
from .checkpoint import Checkpoint, FitState, load_checkpoint, save_checkpoint
from .exact_finish import exact_finish_
from .guard import NonFiniteLossError
from .loop import fit

__all__ = ["fit", "Checkpoint", "FitState", "NonFiniteLossError", "save_checkpoint", "load_checkpoint",
           "EpochBatchSampler",
           "exact_finish_"]
