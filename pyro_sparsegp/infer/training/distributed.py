"""Data-parallel pieces of :func:`~pyro_sparsegp.infer.fit` under an initialised ``torch.distributed`` process group
(``gloo`` on CPUs, ``nccl`` on GPUs): every rank starts from rank 0's parameters, losses and gradients are averaged
over ranks after each backward pass (so every rank takes the same step), and the deferred checks' flags are combined
so that every rank redoes a window if one must. Without a process group: one rank, nothing to do."""

from __future__ import annotations

import torch

__all__ = ["rank_and_world_size", "broadcast_parameters", "average_loss_and_gradients", "max_over_ranks_",
           "check_same_data"]


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


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of ``t [N, ...]`` in float64 (``()``): differs for other rows or another order."""
    rows = t.detach().reshape(t.shape[0], -1).to(torch.float64).sum(-1)
    weights = torch.arange(1, t.shape[0] + 1, dtype=torch.float64, device=t.device) / t.shape[0]
    return (rows * weights).sum()


def check_same_data(X, y, num_data: int, device) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ``num_data`` and, for tensors ``X [N, D],
    y [N, ...]`` (``None`` for a dataset), the same rows in the same order: ``fit`` gives each rank its slice of every
    global minibatch of the one data set, so ranks that hold shards (or unequal data) would train a wrong bound (or
    drift apart) without an error. One ``all_reduce`` each of the minimum and the maximum of three numbers."""
    fp = torch.tensor([float(num_data), 0.0, 0.0], dtype=torch.float64, device=device)
    if X is not None:
        fp[1], fp[2] = _checksum(X).to(device), _checksum(y).to(device)
    low, high = fp.clone(), fp.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    if not torch.equal(low, high):
        what = (f"between {int(low[0])} and {int(high[0])} points" if low[0] != high[0]
                else "the same number of points but different rows (or another order)")
        raise ValueError(
            f"data-parallel fit: the ranks passed different data ({what}). With X, y or a dataset every rank must "
            "hold the whole data set in the same order: fit gives each rank its slice of every global minibatch. "
            "For a shard per rank pass a DataLoader as X (each rank's own batches) and num_data= the total size."
        )
