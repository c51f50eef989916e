"""Dense linear algebra shared by every bound: a Cholesky factorisation with documented jitter escalation, and
Gauss-Hermite quadrature nodes.

Jitter policy (one place, used everywhere):

* ``cholesky(A)`` first factorises ``A + base_jitter * I`` with ``base_jitter = 1e-6`` in float32 and ``1e-10``
  in float64, times the mean of ``diag(A)`` so that it is scale-free.
* If that fails it retries with the jitter multiplied by 10, at most ``max_tries`` times, and emits a
  :class:`CholeskyJitterWarning` saying which jitter succeeded.
* If every try fails it raises :class:`torch.linalg.LinAlgError` naming the largest jitter tried. It never returns
  NaN silently.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import torch

__all__ = [
    "CholeskyJitterWarning",
    "cholesky",
    "default_jitter",
    "gauss_hermite",
    "solve_lower",
    "add_diag",
]


class CholeskyJitterWarning(UserWarning):
    """Emitted when :func:`cholesky` had to raise the jitter above its base value to factorise a matrix."""


def default_jitter(dtype: torch.dtype) -> float:
    """Base relative jitter: ``1e-6`` for float32 (and lower precisions), ``1e-10`` for float64."""
    return 1e-10 if dtype == torch.float64 else 1e-6


def add_diag(A: torch.Tensor, value) -> torch.Tensor:
    """Return ``A + value * I`` without modifying ``A`` (``value`` broadcasts against ``A.shape[:-2]``)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    if isinstance(value, torch.Tensor):
        value = value[..., None, None]
    return A + value * eye


def cholesky(A: torch.Tensor, jitter: float | None = None, max_tries: int = 6) -> torch.Tensor:
    """Lower Cholesky factor of a batch of symmetric positive-definite matrices with jitter escalation.

    :param A: ``[..., M, M]`` symmetric matrices.
    :param jitter: base relative jitter (default :func:`default_jitter`), scaled by the mean diagonal of ``A``.
    :param max_tries: how many tenfold escalations to try after the first attempt.
    :returns: ``L`` ``[..., M, M]`` with ``L @ L.mT = A + jitter * mean(diag A) * I``.
    :raises torch.linalg.LinAlgError: if the matrix is not positive definite even with the largest jitter.
    """
    if jitter is None:
        jitter = default_jitter(A.dtype)
    scale = A.diagonal(dim1=-2, dim2=-1).mean(-1).detach().abs().clamp(min=torch.finfo(A.dtype).tiny)
    if not torch.isfinite(scale).all():
        raise ValueError("cholesky: the matrix contains NaN or inf entries")
    eps = jitter
    for attempt in range(max_tries + 1):
        L, info = torch.linalg.cholesky_ex(add_diag(A, eps * scale))
        if not bool((info > 0).any()):
            if attempt > 0:
                warnings.warn(
                    f"cholesky: matrix of size {A.shape[-1]} was not numerically positive definite; "
                    f"succeeded with relative jitter {eps:.1e} (base {jitter:.1e})",
                    CholeskyJitterWarning,
                    stacklevel=2,
                )
            return L
        eps *= 10.0
    raise torch.linalg.LinAlgError(
        f"cholesky: matrix of size {A.shape[-1]} is not positive definite even with relative jitter "
        f"{eps / 10:.1e}; check the inputs (duplicate points, NaN) and the kernel hyperparameters"
    )


def solve_lower(L: torch.Tensor, B: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``L^{-1} B`` (or ``L^{-T} B`` when ``transpose``) for lower-triangular ``L`` ``[..., M, M]``, ``B`` ``[..., M, K]``."""
    if transpose:
        return torch.linalg.solve_triangular(L.mT, B, upper=True)
    return torch.linalg.solve_triangular(L, B, upper=False)


@functools.lru_cache(maxsize=64)
def _gh_numpy(n: int):
    x, w = np.polynomial.hermite_e.hermegauss(n)  # probabilists' Hermite: weight exp(-x^2 / 2)
    return x, w / math.sqrt(2 * math.pi)


def gauss_hermite(n: int, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights for :math:`\\mathbb{E}_{z\\sim N(0,1)}[g(z)] \\approx \\sum_i w_i g(x_i)`.

    Hensman, Matthews, Ghahramani (2015), section 4: one-dimensional Gauss-Hermite quadrature of the expected
    log-likelihood under each marginal :math:`q(f_n) = N(\\mu_n, \\sigma_n^2)`, with ``f = mu + sigma * x``.

    :returns: ``(x, w)``, each ``[n]``; the weights sum to one.
    """
    if n < 1:
        raise ValueError(f"gauss_hermite: need at least one node, got {n}")
    x, w = _gh_numpy(int(n))
    dtype = dtype or torch.get_default_dtype()
    return torch.as_tensor(x, dtype=dtype, device=device), torch.as_tensor(w, dtype=dtype, device=device)
