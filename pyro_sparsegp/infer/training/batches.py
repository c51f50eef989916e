"""The minibatches of :func:`~pyro_sparsegp.infer.fit`: a pseudo-random permutation per epoch evaluated at a batch's
positions only (memory ``O(B)``, independent of ``N``), a deterministic function of ``(seed, epoch)`` so that a
resumed or redone window sees the same batches, and :class:`BatchSource`, the batches of one run from tensors
``X, y``, an indexable ``dataset`` or a ``DataLoader``, moved to the module's device and dtype."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Sampler

from ...checks.inputs import as_tensor

__all__ = ["EpochBatchSampler", "permute_positions", "BatchSource"]

_M1, _P = np.uint64(1540483477), np.uint64(4294967291)  # odd multiplier < 2^31, the largest prime < 2^32


def _round_keys(seed: int, epoch: int, rounds: int = 4) -> list:
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randint(0, 2**31 - 1, (rounds,), generator=g, device="cpu").tolist()


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


def _first_batch(X, y, dataset, loader, batch_size, num_data, dtype, device):
    """A batch ``(X [B, D], y [B, ...])`` of the data source, for :func:`_create_lazy_parameters`."""
    if X is not None:
        return X[:batch_size], y[:batch_size]
    Xb, yb = dataset[torch.arange(min(batch_size, num_data))] if dataset is not None else next(iter(loader))
    return as_tensor(Xb, "X", dtype, device), as_tensor(yb, "y", dtype, device, floating=False)


class BatchSource:
    """The minibatches ``(X [B, D], y [B, ...])`` of one :func:`~pyro_sparsegp.infer.fit` run, an endless iterator,
    on ``device`` (floating data in ``dtype``), from exactly one of: tensors ``X [N, D], y [N, ...]`` already on the
    device (indexed ``X[idx]``), a ``dataset`` whose ``dataset[idx]`` returns ``(X[idx], y[idx])`` for an index
    tensor ``idx [B]``, or a ``loader`` of ``(X, y)`` batches. The first two follow :class:`EpochBatchSampler`
    (``seed``; rank ``rank`` of ``world_size``) and can be replayed from any step (:meth:`restart`); a loader cannot:
    it continues with its next batches."""

    def __init__(self, X=None, y=None, dataset=None, loader=None, *, num_data: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, dtype=None, device=None):
        self.X, self.y, self.dataset, self.loader = X, y, dataset, loader
        self.num_data, self.batch_size, self.seed, self.rank, self.world_size = (
            num_data, batch_size, seed, rank, world_size)
        self.dtype, self.device = dtype, device
        self._fetch = self._from_tensors if X is not None else self._from_dataset
        self._batches = None

    def first(self) -> tuple:
        """A first batch ``(X [B, D], y [B, ...])`` outside the run's order (no RNG drawn), to create the parameters
        that a model or guide creates at its first call."""
        return _first_batch(self.X, self.y, self.dataset, self.loader, self.batch_size, self.num_data, self.dtype,
                            self.device)

    def restart(self, step: int) -> None:
        """The batches from step ``step`` of the run on (a loader: from its next batch, whatever ``step``)."""
        if self.loader is None:
            sampler = EpochBatchSampler(self.num_data, self.batch_size, self.seed, start_step=step, rank=self.rank,
                                        world_size=self.world_size)
            self._batches = map(self._fetch, sampler)
        elif self._batches is None:
            self._batches = self._from_loader()

    def one_pass(self):
        """Every row of this rank's share of the data once, in order, as batches ``(X [B, D], y [B, ...])``: rows in
        blocks of ``batch_size``, block ``rank`` of every ``world_size``; a loader's next epoch (a shard per rank).
        For :func:`~pyro_sparsegp.infer.training.exact_finish.exact_finish_`; the run's own order is left as it is."""
        if self.loader is not None:
            for Xb, yb in self.loader:
                yield self._placed(Xb, yb)
            return
        B = self.batch_size
        for start in range(self.rank * B, self.num_data, self.world_size * B):
            yield self._fetch(torch.arange(start, min(start + B, self.num_data)))

    def __iter__(self):
        return self

    def __next__(self) -> tuple:
        return next(self._batches)

    def _from_tensors(self, idx):
        idx = idx.to(self.device, non_blocking=True)
        return self.X[idx], self.y[idx]

    def _placed(self, Xb, yb) -> tuple:
        """``(X [B, D], y [B, ...])`` as tensors on the run's device, ``X`` (and a floating ``y``) in its dtype."""
        Xb, yb = torch.as_tensor(Xb), torch.as_tensor(yb)
        dtype = self.dtype if yb.is_floating_point() else yb.dtype
        return (Xb.to(device=self.device, dtype=self.dtype, non_blocking=True),
                yb.to(device=self.device, dtype=dtype, non_blocking=True))

    def _from_dataset(self, idx):
        return self._placed(*self.dataset[idx])

    def _from_loader(self):
        while True:
            for Xb, yb in self.loader:
                if Xb.shape[0] > self.num_data:  # the likelihood would be scaled by num_data / B < 1
                    raise ValueError(f"the loader gave a batch of {Xb.shape[0]} rows but num_data={self.num_data}: "
                                     "num_data is the size of the whole data set, not of a batch")
                yield self._placed(Xb, yb)
