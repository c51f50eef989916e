"""The input checks of :func:`pyro_sparsegp.linalg.cholesky`, kept out of ``linalg.py`` (which is at the house's size
limit): a matrix of the right shape, and symmetric, since a Cholesky factorisation reads one triangle only and would
otherwise factorise another matrix without a word (the fuzz suite's non-symmetric ``A``: ``|L L^T - A| = 99``).

The symmetry test is cheap: it compares every entry of ``A`` with its transpose's up to ``M = _FULL`` (512; ``O(M^2)``
per matrix against the factorisation's ``O(M^3 / 3)``), and the rows of about ``_ROWS`` (64) evenly spaced indices
with the matching columns beyond (``O(64 M)``: an asymmetric pair between two unsampled indices goes unseen there);
it reads back two numbers. The tolerance is relative, ``sqrt(eps)`` of the largest diagonal entry (the largest entry
of a positive semi-definite matrix; ``1.5e-8`` in float64, ``3.5e-4`` in float32): the package's own matrices
(kernel Gram matrices, ``I + W W^T``, ``Kvv - A^T A``, precisions) are symmetric to a few ``eps`` (at most ``8 eps``
in float64 over the test suite), while a matrix that is not symmetric at all differs by a fraction of its entries."""

from __future__ import annotations

import math

import torch

_FULL, _ROWS = 512, 64


def _check_factorisable(A) -> None:
    """Raise ``ValueError`` (naming ``A``, its shape and the fix) unless ``A`` is a batch of square matrices
    ``[..., M, M]`` that is symmetric on the sampled rows (module docstring). Reads one boolean back: the caller
    skips it where nothing may be read (``fit``'s deferred checks on an accelerator)."""
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"cholesky: A must be a torch.Tensor [..., M, M], got {type(A).__name__}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"cholesky: A must be a square matrix or a batch of them, [..., M, M], got shape "
                         f"{tuple(A.shape)}" + ("; for a scalar variance v, chol is v.sqrt()" if A.dim() < 2 else ""))
    M = A.shape[-1]
    if M < 2 or A.numel() == 0:
        return
    with torch.no_grad():
        step = 1 if M <= _FULL else M // _ROWS  # every row, or about _ROWS of them (views: no copy)
        rows, cols = A[..., ::step, :], A[..., :, ::step].mT  # [..., k, M]: rows i and columns i, i sampled
        size = float(A.diagonal(dim1=-2, dim2=-1).abs().amax())  # the largest entry of a PSD matrix
        if not math.isfinite(size):  # NaN or inf: cholesky's own check names it
            return
        tol = torch.finfo(A.dtype).eps ** 0.5 * size
        if torch.allclose(rows, cols, rtol=0.0, atol=tol, equal_nan=True):
            return
        diff = (rows - cols).abs().reshape(-1, rows.shape[-2], M).amax(0)  # [k, M]
        k, j = divmod(int(torch.argmax(diff)), M)
        gap = float(diff[k, j])
    i = k * step
    raise ValueError(
        f"cholesky: A ({tuple(A.shape)}) is not symmetric: |A[{i}, {j}] - A[{j}, {i}]| = {gap:.3g}, "
        f"{gap / max(size, 1e-300):.2g} of its largest diagonal entry. A Cholesky factorisation reads one triangle "
        "only, so it would factorise another matrix; pass a symmetric A (0.5 * (A + A.mT) where the difference is "
        "round-off)")
