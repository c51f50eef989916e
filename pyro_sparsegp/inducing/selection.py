r"""Inducing inputs chosen among the training inputs: the greedy conditional-variance selection of Burt, Rasmussen,
van der Wilk (2020, "Convergence of sparse variational inference in Gaussian process regression", JMLR 21(131),
algorithm 1), k-means centres (:func:`~pyro_sparsegp.inducing.init.kmeans`) or random rows, behind one
:func:`select`.

The greedy criterion adds, one at a time, the training input whose prior variance is least explained by the inputs
chosen so far,

.. math::

    z_{m+1} = \arg\max_{x_n} \; k(x_n, x_n) - Q(x_n, x_n), \qquad
    Q = K_{fu} K_{uu}^{-1} K_{uf} \text{ over the } m \text{ inputs chosen},

which is the pivot rule of a partial pivoted Cholesky factorisation of ``Kff`` (the trace ``tr(Kff - Qff)`` that the
Titsias (2009) bound pays for, and that Burt et al. bound, shrinks greedily): ``O(N M^2)`` time, an ``[M, N]`` factor
in memory. Its choice depends on the kernel given (its lengthscales).

The criterion weighs every region of the inputs alike, however few rows lie there, while the bound's trace term sums
over the rows. Where ``M`` points cannot cover the inputs at the kernel's lengthscales (a start from lengthscale 1 in
8 to 20 standardised dimensions) the greedy picks over all rows are the most isolated ones: under that kernel, with
``M = 256``, the mean residual variance ``tr(Kff - Qff) / N`` over the rows was 0.48 for the greedy picks among
20,000 rows of protein (random rows 0.14, k-means 0.10), 0.75 on keggdirected (0.36, 0.29), 0.38 on the flights
(0.20, 0.13). Run on a random pool of ``4 M`` rows (``select``'s ``candidates="auto"``), the greedy picks keep the
data's density (a region is in the pool as often as it is in the data) and spread within it: 0.13, 0.41 and 0.19
there; ``2 M`` rows 0.12, 0.32, 0.17 (``benchmarks/time_to_accuracy.py --starts`` measures what each start does to
training; ``docs/fitting_measurements.md``).
"""

from __future__ import annotations

import math
import warnings

import torch

from ..checks.inputs import as_tensor
from .init import kmeans

__all__ = ["select", "greedy_variance"]

METHODS = ("greedy_variance", "kmeans", "random")
GREEDY_POOL = 4  # candidates="auto": the greedy selection runs on 4 M random rows (module docstring)
KMEANS_CANDIDATES = 20_000  # candidates="auto": k-means runs on at most this many random rows


def _kernel_or_default(kernel, X: torch.Tensor):
    """``kernel``, or for ``None`` an RBF with variance 1 and one lengthscale 1 per input column (the start of
    standardised inputs). No tensors of its own, so shapes do not apply."""
    if kernel is not None:
        if not callable(kernel):
            raise TypeError(f"kernel must be a kernel k(X, Z) (e.g. pyro.contrib.gp.kernels.RBF), got "
                            f"{type(kernel).__name__}")
        return kernel
    from pyro.contrib.gp.kernels import RBF

    D = X.shape[-1]
    return RBF(D, variance=torch.tensor(1.0, dtype=X.dtype, device=X.device),
               lengthscale=torch.ones(D, dtype=X.dtype, device=X.device))


def _cross(kernel, X: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``k(X, x)`` ``[N]`` for one input ``x`` ``[1, D]``, in ``X``'s dtype (a 2-D kernel output is required)."""
    col = kernel(X, x)
    if col.dim() != 2 or col.shape != (X.shape[0], 1):
        raise ValueError(f"kernel(X, Z) must return one [N, M] matrix, got shape {tuple(col.shape)} for N = "
                         f"{X.shape[0]}, M = 1 (a batched or multi-output kernel: select per output)")
    return col[:, 0].to(X.dtype)


@torch.no_grad()
def greedy_variance(X, M: int, kernel=None, *, tol: float | None = None, seed: int = 0):
    r"""The greedy conditional-variance selection of Burt, Rasmussen, van der Wilk (2020, algorithm 1): row indices
    ``[M]`` of ``X`` ``[N, D]`` picked one at a time, each the row of largest residual prior variance
    ``d_n = k(x_n, x_n) - Q(x_n, x_n)`` given those picked before (a partial pivoted Cholesky factorisation of
    ``Kff``), and that residual variance at each pick ``[M]`` (non-increasing; its first value is the largest
    ``k(x, x)``).

    :param X: inputs ``[N, D]`` (tensor, numpy array, list or pandas frame; a tensor keeps its dtype, others take the
        default dtype).
    :param M: how many rows, ``1 <= M <= N``.
    :param kernel: any kernel with the Pyro interface (``kernel(X, Z)`` ``[N, M]``, ``kernel(X, diag=True)``
        ``[N]``), e.g. ``pyro.contrib.gp.kernels.RBF``; ``None``: an RBF with variance 1 and lengthscales 1.
    :param tol: residual variance at or below which a row is taken as explained (default ``sqrt(eps)`` times the
        largest ``k(x, x)``, about ``1.5e-8`` of it in float64 and ``3.5e-4`` in float32: rounding in the
        running update is below it). Once every unpicked row is explained (``M`` above the numerical rank of
        ``Kff``, or repeated inputs) the remaining picks are distinct random unpicked rows, with a ``UserWarning``.
    :param seed: seeds those random picks (the greedy ones are deterministic).
    :returns: ``(indices [M], residual [M])``.

    Memory: the ``[M, N]`` Cholesky factor in ``X``'s dtype (``8 M N`` bytes in float64: 450 MB for ``M = 256``,
    ``N = 218,230``); time ``O(N M^2)``.
    """
    X = _checked(X, M)
    N = X.shape[0]
    kernel = _kernel_or_default(kernel, X)
    d = kernel(X, diag=True).to(X.dtype).clone()  # [N] residual variances k(x, x) - Q(x, x)
    if d.shape != (N,):
        raise ValueError(f"kernel(X, diag=True) must return [N] = [{N}], got shape {tuple(d.shape)}")
    tol = math.sqrt(torch.finfo(X.dtype).eps) * float(d.max()) if tol is None else float(tol)
    L = X.new_zeros(M, N)  # [M, N] rows of the partial Cholesky factor: Qff = L^T L
    picked = torch.zeros(N, dtype=torch.bool, device=X.device)
    idx = torch.empty(M, dtype=torch.long, device=X.device)
    residual = X.new_zeros(M)
    m = 0
    while m < M:
        p = int(torch.argmax(torch.where(picked, -math.inf, d)))
        if not float(d[p]) > tol:  # the rest is explained: no pivot left
            break
        idx[m], residual[m], picked[p] = p, d[p], True
        # column p of Kff - L[:m]^T L[:m], scaled by its pivot: the next row of the factor   [N]
        col = (_cross(kernel, X, X[p : p + 1]) - L[:m].T @ L[:m, p]) / d[p].sqrt()
        L[m] = col
        d = (d - col.square()).clamp_(min=0.0)
        d[p] = 0.0
        m += 1
    if m < M:
        warnings.warn(f"greedy_variance: only {m} of M = {M} inducing inputs reduce the residual variance above tol "
                      f"= {tol:.3g} (Kff has numerical rank {m} for this kernel, or X repeats rows); the other "
                      f"{M - m} are random unpicked rows, which make Kuu near-singular: use M = {m}", UserWarning,
                      stacklevel=3)
        g = torch.Generator().manual_seed(seed)
        rest = torch.nonzero(~picked).squeeze(-1).cpu()
        idx[m:] = rest[torch.randperm(len(rest), generator=g, device="cpu")[: M - m]].to(X.device)
        residual[m:] = d[idx[m:]]
    return idx, residual


def _checked(X, M) -> torch.Tensor:
    """``X`` as an ``[N, D]`` tensor (a tensor keeps its dtype) and ``M`` checked against ``N``."""
    X = as_tensor(X, "X", dtype=X.dtype if torch.is_tensor(X) and X.is_floating_point() else None)
    if X.dim() != 2:
        hint = " (one input column: X.reshape(-1, 1))" if X.dim() == 1 else ""
        raise ValueError(f"X must be [N, D], one row per input{hint}; got shape {tuple(X.shape)}")
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"M must be a positive integer (the number of inducing inputs), got {M!r}")
    if M > X.shape[0]:
        raise ValueError(f"M = {M} inducing inputs cannot be chosen among N = {X.shape[0]} rows of X: use M <= "
                         f"{X.shape[0]} (or repeat rows yourself)")
    return X.detach()


def select(X, M: int, kernel=None, method: str = "greedy_variance", *, seed: int = 0,
           candidates: int | str | None = "auto", kmeans_iters: int = 50, tol: float | None = None) -> torch.Tensor:
    r"""``M`` inducing inputs ``[M, D]`` from the training inputs ``X`` ``[N, D]``, the recommended start of an SVGP
    (``docs/fitting.md``, "Where to start the inducing inputs"):

    * ``method="greedy_variance"`` (default): the rows of the greedy conditional-variance selection of Burt,
      Rasmussen, van der Wilk (2020, algorithm 1; :func:`greedy_variance`) under ``kernel`` (``None``: an RBF with
      variance 1 and lengthscales 1, for standardised inputs);
    * ``"kmeans"``: Lloyd's k-means centres started from ``M`` random rows, at most ``kmeans_iters`` rounds
      (:func:`~pyro_sparsegp.inducing.init.kmeans`; Salimbeni & Deisenroth 2017's start);
    * ``"random"``: ``M`` distinct random rows.

    ``X``: a tensor (keeps its dtype), numpy array, list or pandas frame (in the default dtype). ``M`` at most
    ``N``. ``candidates``: where ``N`` is larger, the greedy selection and k-means run on this many random rows
    (``None``: on all ``N``; ``"auto"``: ``4 M`` rows for the greedy selection, the pool of the module docstring,
    and 20,000 for k-means): greedy variance costs ``O(candidates M^2)`` time and an ``[M, candidates]`` factor,
    k-means ``O(candidates M D)`` per round (``M`` at most ``candidates``). ``seed`` makes every method
    deterministic. Returns a new tensor (no gradient), on ``X``'s device.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    X = _checked(X, M)
    g = torch.Generator().manual_seed(seed)
    if isinstance(candidates, str) and candidates == "auto":
        candidates = GREEDY_POOL * M if method == "greedy_variance" else max(M, KMEANS_CANDIDATES)
    if candidates is not None:
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < M:
            raise ValueError(f"candidates must be an integer >= M = {M} (rows to choose among), 'auto' or None (all "
                             f"rows), got {candidates!r}")
        if method != "random" and X.shape[0] > candidates:
            X = X[torch.randperm(X.shape[0], generator=g, device="cpu")[:candidates].to(X.device)]
    if method == "greedy_variance":
        idx, _ = greedy_variance(X, M, kernel, tol=tol, seed=seed)
        return X[idx].clone()
    if method == "kmeans":
        return kmeans(X, M, iters=kmeans_iters, generator=g)
    return X[torch.randperm(X.shape[0], generator=g, device="cpu")[:M].to(X.device)].clone()
