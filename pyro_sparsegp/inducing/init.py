"""One k-means for every initialiser of inducing inputs: dense inputs (:func:`pyro_sparsegp.deep.init_inducing`, as
the reference code of Salimbeni & Deisenroth 2017 does with ``scipy.cluster.vq.kmeans2(..., minit="points")``) and
image patches (:func:`pyro_sparsegp.conv.init_patches`, Shi, Titsias, Mnih 2020, appendix G.2). Plain torch, so the
main install needs no scipy; k-means itself implements no paper equation."""

from __future__ import annotations

import torch

__all__ = ["kmeans"]


def kmeans(X: torch.Tensor, k: int, iters: int = 15, generator: torch.Generator | None = None) -> torch.Tensor:
    """Lloyd's k-means of the rows of ``X`` ``[N, d]`` -> centres ``[k, d]``, started at ``k`` distinct random rows
    (``generator`` draws them) and run for at most ``iters`` assignment/update rounds (it stops early once no point
    changes its cluster: the later rounds would change nothing). An empty cluster keeps its previous centre."""
    if k > X.shape[0]:
        raise ValueError(f"k = {k} centres need at least as many points, got N = {X.shape[0]}")
    C = X[torch.randperm(X.shape[0], generator=generator)[:k].to(X.device)].clone()
    x2 = X.pow(2).sum(-1, keepdim=True)
    assign = None
    for _ in range(iters):
        new = (x2 - 2 * X @ C.T + C.pow(2).sum(-1)).argmin(-1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        sums = torch.zeros_like(C).index_add_(0, assign, X)
        counts = torch.bincount(assign, minlength=k).to(X.dtype).unsqueeze(-1)
        C = torch.where(counts > 0, sums / counts.clamp(min=1), C)
    return C
