"""Kernel evaluation with leading batch dimensions.

We reuse :mod:`pyro.contrib.gp.kernels` (their hyperparameters are ``PyroParam`` s, so SVI trains them), but Pyro's
kernels accept only 2-D inputs. Deep GP layers receive sample-batched inputs ``[..., N, D]`` and per-output inducing
points ``[L, M, D]``, so this module evaluates the stationary kernels (``RBF``, ``Matern32``, ``Matern52``,
``Exponential``, ``RationalQuadratic``) directly from their hyperparameters with full broadcasting, and falls back to
the Pyro kernel itself (by flattening ``X``) for any other kernel.

Shapes: ``X`` ``[..., N, D]``, ``Z`` ``[..., M, D]`` (leading dimensions broadcast) ->  ``K`` ``[..., N, M]``.
"""

from __future__ import annotations

import math

import torch
from pyro.contrib.gp import kernels as pk

__all__ = ["kernel_matrix", "kernel_diag", "expected_input_dim"]


def expected_input_dim(kernel) -> int | None:
    """Number of input features a kernel takes, or ``None`` when it selects features with ``active_dims``."""
    ad = kernel.active_dims
    if ad is None or (isinstance(ad, slice) and ad == slice(kernel.input_dim)):
        return kernel.input_dim
    if isinstance(ad, (list, tuple)) and list(ad) == list(range(kernel.input_dim)):
        return kernel.input_dim  # Pyro's default: every feature
    return None


def _slice(kernel, X):
    if expected_input_dim(kernel) is not None:
        return X
    return X[..., kernel.active_dims]


def _scaled_sqdist(kernel, X, Z):
    ls = kernel.lengthscale
    Xs = X / ls
    Zs = Z / ls
    x2 = (Xs * Xs).sum(-1, keepdim=True)  # [..., N, 1]
    z2 = (Zs * Zs).sum(-1, keepdim=True)  # [..., M, 1]
    r2 = x2 - 2.0 * (Xs @ Zs.mT) + z2.mT  # [..., N, M]
    return r2.clamp(min=0)


def _isotropic(kernel, r2):
    var = kernel.variance
    if isinstance(kernel, pk.RBF):
        return var * torch.exp(-0.5 * r2)
    if isinstance(kernel, pk.RationalQuadratic):
        return var * (1 + 0.5 / kernel.scale_mixture * r2).pow(-kernel.scale_mixture)
    r = (r2 + torch.finfo(r2.dtype).tiny).sqrt() * (r2 > 0)  # zero gradient at r = 0
    if isinstance(kernel, pk.Matern32):
        s = math.sqrt(3) * r
        return var * (1 + s) * torch.exp(-s)
    if isinstance(kernel, pk.Matern52):
        s = math.sqrt(5) * r
        return var * (1 + s + s * s / 3) * torch.exp(-s)
    if isinstance(kernel, pk.Exponential):
        return var * torch.exp(-r)
    return None


_ISOTROPIC = (pk.RBF, pk.RationalQuadratic, pk.Matern32, pk.Matern52, pk.Exponential)


def _check(kernel, X, Z):
    expected = expected_input_dim(kernel)
    if expected is not None and X.shape[-1] != expected:
        raise ValueError(
            f"kernel expects inputs with {kernel.input_dim} features, got X with {X.shape[-1]} (shape {tuple(X.shape)})"
        )
    if Z is not None and Z.shape[-1] != X.shape[-1]:
        raise ValueError(
            f"inputs have different numbers of features: {X.shape[-1]} and {Z.shape[-1]} "
            f"(shapes {tuple(X.shape)} and {tuple(Z.shape)})"
        )


def _rbf(kernel, X, Z):
    """``var * exp(-|x - z|^2 / (2 l^2))`` as one matrix product and one ``exp``: the bias
    ``log var - |x|^2/2 - |z|^2/2`` is folded into ``addmm``'s input, which saves four elementwise passes over the
    ``[N, M]`` matrix (forward and backward) compared with forming the squared distances first."""
    ls = kernel.lengthscale
    Xs = X / ls
    Zs = Z / ls
    bias = (kernel.variance.log() - 0.5 * (Xs * Xs).sum(-1, keepdim=True)) - 0.5 * (Zs * Zs).sum(-1).unsqueeze(-2)
    if bias.dim() == 2 and Xs.dim() == 2 and Zs.dim() == 2:
        return torch.addmm(bias, Xs, Zs.mT).exp()
    return (Xs @ Zs.mT + bias).exp()


def kernel_matrix(kernel, X: torch.Tensor, Z: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-covariance ``k(X, Z)`` with broadcasting leading dimensions.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`.
    :param X: ``[..., N, D]``.
    :param Z: ``[..., M, D]`` or ``None`` (then ``Z = X``).
    :returns: ``[..., N, M]``.
    """
    _check(kernel, X, Z)
    Zi = X if Z is None else Z
    if type(kernel) is pk.RBF:
        return _rbf(kernel, _slice(kernel, X), _slice(kernel, Zi))
    if type(kernel) in _ISOTROPIC:
        return _isotropic(kernel, _scaled_sqdist(kernel, _slice(kernel, X), _slice(kernel, Zi)))
    # generic fallback: Pyro kernels take 2-D inputs only
    if Zi.dim() > 2:
        batch = torch.broadcast_shapes(X.shape[:-2], Zi.shape[:-2])
        Xb = X.expand(batch + X.shape[-2:]).reshape(-1, *X.shape[-2:])
        Zb = Zi.expand(batch + Zi.shape[-2:]).reshape(-1, *Zi.shape[-2:])
        K = torch.stack([kernel(x, z) for x, z in zip(Xb, Zb, strict=True)])
        return K.reshape(batch + K.shape[-2:])
    K = kernel(X.reshape(-1, X.shape[-1]), Zi)
    return K.reshape(X.shape[:-1] + Zi.shape[-2:-1])


def kernel_diag(kernel, X: torch.Tensor) -> torch.Tensor:
    """Diagonal ``k(x_n, x_n)``: ``X`` ``[..., N, D]`` -> ``[..., N]``."""
    _check(kernel, X, None)
    if type(kernel) in _ISOTROPIC:
        return kernel.variance.expand(X.shape[:-1])
    return kernel(X.reshape(-1, X.shape[-1]), diag=True).reshape(X.shape[:-1])
