"""Data-parallel pieces of :func:`~pyro_sparsegp.infer.fit` under an initialised ``torch.distributed`` process group
(``gloo`` on CPUs, ``nccl`` on GPUs): every rank starts from rank 0's parameters, losses and gradients are averaged
over ranks after each backward pass (so every rank takes the same step), and the deferred checks' flags are combined
so that every rank redoes a window if one must. Without a process group: one rank, nothing to do."""

from __future__ import annotations

import torch

__all__ = ["rank_and_world_size", "broadcast_parameters", "average_loss_and_gradients", "max_over_ranks_"]


def _dist():
    """``(rank, world_size)`` of an initialised ``torch.distributed`` process group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


rank_and_world_size = _dist


def _average(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t.div_(torch.distributed.get_world_size())


def broadcast_parameters(module) -> None:
    """Overwrite every parameter of ``module`` (any shapes, in place) with rank 0's."""
    with torch.no_grad():
        for p in module.parameters():
            torch.distributed.broadcast(p.data, src=0)


def average_loss_and_gradients(loss: torch.Tensor, tensors) -> torch.Tensor:
    """The loss ``()`` averaged over ranks (a new tensor, detached), after averaging in place the ``.grad`` of each
    of ``tensors`` that has one (any shapes)."""
    loss = _average(loss.detach().clone().reshape(1))[0]
    for p in tensors:
        if p.grad is not None:
            _average(p.grad)
    return loss


def max_over_ranks_(table: torch.Tensor, start: int) -> None:
    """Replace the columns ``start:`` of ``table`` ``[S, C]`` (in place) by their maximum over ranks."""
    flags = table[:, start:].contiguous()
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    table[:, start:] = flags
