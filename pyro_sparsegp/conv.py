"""Convolutional GP helpers: the evaluation metrics of the convolutional experiments. Importable from here as well:
the inducing-patch initialisation :func:`~pyro_sparsegp.inducing.init.init_patches` and the layers
(:class:`~pyro_sparsegp.layers.conv.ConvLayer`, :class:`~pyro_sparsegp.layers.conv.DeepConvGP`)."""

from __future__ import annotations

import math

import torch

from .inducing import init_patches, kmeans
from .layers.conv import ConvLayer, DeepConvGP

__all__ = ["ConvLayer", "DeepConvGP", "init_patches", "kmeans", "log_likelihood_and_accuracy"]


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

