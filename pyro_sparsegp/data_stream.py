"""Data sets larger than memory: a batch-reading :class:`MemmapDataset` over a ``.npy`` file on disk, for
:func:`pyro_sparsegp.infer.fit` (``fit(gp, MemmapDataset(path))``).

``fit`` draws the indices of each minibatch (``idx`` ``[B]``, a random permutation per epoch) and calls
``dataset[idx]``; the dataset reads those rows, and nothing else, from the memory-mapped file. Resident memory is
therefore that of the model plus ``O(B D)`` for a batch, independent of ``N`` (``benchmarks/memory_flat.py`` prints
the peak for 10^6 and 10^7 rows). The file is memory-mapped (``numpy.load(mmap_mode="r")``) for its shape and
layout, but the rows are read with one positional read (``os.pread``) each where the platform has it: random rows read
through the mapping make the kernel map whole page-cache folios into the process (measured on Linux 6.18: 1,024 random
rows of a 343 MB file put 334 MB in the resident set, and took ten times longer), whereas ``pread`` copies just the
rows. The page cache keeps what it likes of the file, outside the process and reclaimable. ``fit`` draws the
batches of an epoch from a permutation computed per batch, so it holds no ``O(N)`` index either.
"""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["MemmapDataset", "write_npy"]


class MemmapDataset:
    """Rows ``[X | y]`` of a two-dimensional ``.npy`` file ``[N, D + 1]`` (inputs in the first ``D`` columns, the
    target in the last), read by batches of indices.

    :param path: a ``.npy`` file written by ``numpy.save`` / :func:`write_npy` (float32 or float64, C order).
    :param dtype: dtype of the returned tensors (default ``torch.get_default_dtype()``); ``fit`` converts to the
        module's dtype anyway.
    :param bool integer_targets: return ``y`` as ``int64`` (class labels) instead of floats.

    ``len(ds) = N``; ``ds[idx]`` for an index tensor or array ``idx`` ``[B]`` returns ``(X [B, D], y [B])``, reading
    those ``B`` rows and nothing else (module docstring). The indices are sorted before the read (monotone access)
    and the rows come back in sorted order, ``X`` and ``y`` alike: the bound is a sum over the batch, so the order
    within a batch does not matter.
    """

    def __init__(self, path, dtype: torch.dtype | None = None, integer_targets: bool = False):
        self.path = os.fspath(path)
        try:
            self.data = np.load(self.path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise ValueError(f"MemmapDataset: {self.path!r} is not a readable .npy file ({exc})") from exc
        if self.data.ndim != 2 or self.data.shape[1] < 2:
            raise ValueError(f"MemmapDataset: {self.path!r} must hold a [N, D + 1] array, got {self.data.shape}")
        if self.data.dtype.kind != "f":
            raise ValueError(f"MemmapDataset: {self.path!r} must hold floats, got {self.data.dtype}")
        if not self.data.flags.c_contiguous:
            raise ValueError(f"MemmapDataset: {self.path!r} must be stored in C order")
        self._row_bytes = self.data.shape[1] * self.data.itemsize
        self._fd = os.open(self.path, os.O_RDONLY) if hasattr(os, "pread") else None
        self.dtype = dtype or torch.get_default_dtype()
        self.integer_targets = integer_targets

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __getstate__(self):  # picklable (DataLoader workers): the file is reopened
        state = dict(self.__dict__)
        state.pop("_fd", None)
        state.pop("data", None)
        return state

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"], state["integer_targets"])

    def __len__(self) -> int:
        return self.data.shape[0]

    @property
    def num_features(self) -> int:
        """``D``, the number of input columns (the file's shape is ``[N, D + 1]``); an ``int``."""
        return self.data.shape[1] - 1

    def __getitem__(self, idx):
        idx = np.sort(np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1))
        if idx.size and (idx[0] < 0 or idx[-1] >= len(self)):
            raise IndexError(f"MemmapDataset: indices must be in [0, {len(self)}), got {idx[0]}..{idx[-1]}")
        if self._fd is not None:  # one positional read per row: nothing of the file enters the resident set
            rb, off = self._row_bytes, self.data.offset
            buf = b"".join([os.pread(self._fd, rb, off + i * rb) for i in idx.tolist()])
            rows = torch.from_numpy(np.frombuffer(buf, dtype=self.data.dtype).reshape(idx.size, -1).copy())
        else:
            rows = torch.from_numpy(np.array(self.data[idx]))  # [B, D + 1]
        X = rows[:, :-1].to(self.dtype)
        y = rows[:, -1].to(torch.int64 if self.integer_targets else self.dtype)
        return X, y


def write_npy(path, X, y, chunk: int = 1_000_000) -> None:
    """Write ``[X | y]`` (``X [N, D]``, ``y [N]``, tensors or arrays) to ``path`` as a float ``.npy`` file, in
    chunks of rows through a memory map (so the data can be produced and written piecewise)."""
    X, y = (np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a) for a in (X, y))  # GPU tensors too
    dtype = np.result_type(X.dtype, y.dtype, np.float32)
    out = np.lib.format.open_memmap(os.fspath(path), mode="w+", dtype=dtype, shape=(X.shape[0], X.shape[1] + 1))
    for s in range(0, X.shape[0], chunk):
        out[s : s + chunk, :-1] = X[s : s + chunk]
        out[s : s + chunk, -1] = y[s : s + chunk]
    out.flush()
    del out
