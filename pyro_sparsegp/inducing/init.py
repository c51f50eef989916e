"""One k-means for every initialiser of inducing inputs: dense inputs (:func:`pyro_sparsegp.deep.init_inducing`, as
the reference code of Salimbeni & Deisenroth 2017 does with ``scipy.cluster.vq.kmeans2(..., minit="points")``) and
image patches (:func:`init_patches`, Shi, Titsias, Mnih 2020, appendix G.2). Plain torch, so the
main install needs no scipy; k-means itself implements no paper equation."""

from __future__ import annotations

import torch

from ..kernels.conv import patches

__all__ = ["kmeans", "init_patches"]


def kmeans(X: torch.Tensor, k: int, iters: int = 15, generator: torch.Generator | None = None) -> torch.Tensor:
    """Lloyd's k-means of the rows of ``X`` ``[N, d]`` -> centres ``[k, d]``, started at ``k`` distinct random rows
    (``generator`` draws them) and run for at most ``iters`` assignment/update rounds (it stops early once no point
    changes its cluster: the later rounds would change nothing). An empty cluster keeps its previous centre."""
    if k > X.shape[0]:
        raise ValueError(f"k = {k} centres need at least as many points, got N = {X.shape[0]}")
    device = generator.device if generator is not None else X.device  # a generator draws on its own device
    C = X[torch.randperm(X.shape[0], generator=generator, device=device)[:k].to(X.device)].clone()
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


def init_patches(
    X: torch.Tensor,
    image_shape,
    patch_size,
    M: int,
    stride=1,
    channels_as_patches: bool = False,
    num_images: int = 1000,
    per_centre: int = 100,
    seed: int = 0,
) -> torch.Tensor:
    """Inducing patches ``[M, d]``: k-means centres of ``M * per_centre`` patches drawn from ``num_images`` random
    images of ``X`` ``[N, H*W*C]`` (Shi et al. 2020, app. G.2: ``M x 100`` patches from 1K images)."""
    g = torch.Generator().manual_seed(seed)
    imgs = X[torch.randperm(X.shape[0], generator=g, device="cpu")[:num_images].to(X.device)]
    P = patches(imgs, image_shape, patch_size, stride, channels_as_patches)  # [n, P, d]
    P = P.reshape(-1, P.shape[-1])
    pool = P[torch.randperm(P.shape[0], generator=g, device="cpu")[: M * per_centre].to(P.device)]
    # a little jitter keeps identical (e.g. all-zero background) centres apart, so Kuu stays well conditioned
    C = kmeans(pool, M, generator=g)
    return C + 1e-3 * torch.randn(C.shape, generator=g, dtype=C.dtype, device="cpu").to(C.device)
