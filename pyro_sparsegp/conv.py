"""Convolutional GP helpers: inducing-patch initialisation and the evaluation metrics of the convolutional
experiments. The layers themselves (:class:`~pyro_sparsegp.layers.conv.ConvLayer`,
:class:`~pyro_sparsegp.layers.conv.DeepConvGP`) live in :mod:`pyro_sparsegp.layers.conv` and are importable from
here as well."""

from __future__ import annotations

import math

import torch

from .inducing import kmeans
from .kernels.conv import patches
from .layers.conv import ConvLayer, DeepConvGP

__all__ = ["ConvLayer", "DeepConvGP", "init_patches", "kmeans", "log_likelihood_and_accuracy"]


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
    imgs = X[torch.randperm(X.shape[0], generator=g)[:num_images]]
    P = patches(imgs, image_shape, patch_size, stride, channels_as_patches)  # [n, P, d]
    P = P.reshape(-1, P.shape[-1])
    pool = P[torch.randperm(P.shape[0], generator=g)[: M * per_centre]]
    # a little jitter keeps identical (e.g. all-zero background) centres apart, so Kuu stays well conditioned
    C = kmeans(pool, M, generator=g)
    return C + 1e-3 * torch.randn(C.shape, generator=g, dtype=C.dtype).to(C.device)


def log_likelihood_and_accuracy(probs: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test log-likelihood and accuracy of a predictive mixture ``probs`` ``[S, N, K]`` (or ``[N, K]``): mean over
    ``n`` of ``log (1/S) sum_s p_s(y_n)``, and the accuracy of the argmax of the mixture. Evaluation metrics:
    implements no paper equation."""
    if probs.dim() == 2:
        probs = probs.unsqueeze(0)
    p = probs.gather(-1, y.long().expand(probs.shape[:-1]).unsqueeze(-1)).squeeze(-1)  # [S, N]
    ll = (torch.logsumexp(p.clamp(min=1e-300).log(), 0) - math.log(p.shape[0])).mean()
    acc = (probs.mean(0).argmax(-1) == y.long()).to(probs.dtype).mean()
    return float(ll), float(acc)

