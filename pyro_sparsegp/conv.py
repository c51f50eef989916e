"""Convolutional GP helpers: :func:`build_deep_conv_gp`, the deep convolutional GP of Shi, Titsias, Mnih 2020
(table 5, appendix G.2) initialised as ``benchmarks/convgp_mnist.py`` trains it, and the evaluation metrics of the
convolutional experiments. The layers it builds are :class:`~pyro_sparsegp.ConvLayer` and
:class:`~pyro_sparsegp.DeepConvGP` (defined in :mod:`pyro_sparsegp.layers.conv`), the inducing-patch initialisation
is :func:`pyro_sparsegp.inducing.init_patches`."""

from __future__ import annotations

import contextlib
import math

import pyro
import torch
from pyro.contrib.gp.kernels import RBF

from . import covariances as cov
from .checks.inputs import as_tensor
from .context.naming import unique_name
from .inducing import IndexedInducingPatches, init_patches
from .kernels import TICK
from .kernels.conv import _image
from .layers import SOLVEGP, SVGP
from .layers.conv import ConvLayer, DeepConvGP
from .likelihoods import RobustMax
from .linalg import cholesky

__all__ = ["TABLE5", "build_deep_conv_gp", "log_likelihood_and_accuracy"]

#: Shi, Titsias, Mnih 2020, table 5 (CIFAR-10): for 2 and 3 layers, the hidden layers' ``(patch, stride,
#: channels)`` and the TICK output layer's ``(patch, stride)``.
TABLE5 = {2: (((5, 1, 10),), (4, 2)), 3: (((5, 1, 10), (4, 2, 10)), (5, 1))}


def _patch_kernel(d: int, variance: float, lengthscale: float) -> RBF:
    return RBF(d, variance=torch.tensor(float(variance)), lengthscale=torch.tensor(float(lengthscale)))


def _provisional(layer, X, n=500):
    """Identity-conv mean feature maps of ``n`` images through ``layer`` (flattened ``[n, H*W*C]``)."""
    with torch.no_grad():
        return layer.mean_function(X[:n]).reshape(len(X[:n]), -1)


def _reinit(gp, before, X, shape, patch, stride, M, solve, per_centre):
    """Inducing patches of the layer's GP ``gp`` (its Z, O) by k-means of patches of samples of the layers ``before``
    at initialisation (Shi et al. 2020, appendix G.2, with samples of the initial model in place of their
    random-filter projections), its patch kernel's lengthscale from their median distance, and q(u) (q(v)) reset to
    the prior."""
    with torch.no_grad(), pyro.poutine.block():
        H = X[torch.randperm(len(X))[:500]]
        for layer in before:
            H = layer.sample(H)
        P = init_patches(H, shape, patch, 2 * M if solve else M, stride=stride, per_centre=per_centre)
        gp.inducing.Z = P[:M]
        base = getattr(gp.kernel, "base_kernel", gp.kernel)  # TICK: its patch kernel
        base.lengthscale = torch.cdist(P, P).median()
        if solve:
            gp.orthogonal.Z = P[M:]
            Luu, Lc, _ = gp.strategy.joint_factors()
            gp.q_v.set(torch.zeros_like(gp.q_v.u_loc), Lc.expand_as(gp.q_v.u_scale_tril))
        else:
            Luu = cholesky(cov.Kuu(gp.inducing, gp.kernel), symmetrize=True)
        gp.q_u.set(torch.zeros_like(gp.q_u.u_loc), Luu.expand_as(gp.q_u.u_scale_tril))


def _first_patches(i, layers, X, shape, patch, stride, n, per_centre):
    """Inducing patches ``[n, d]`` of the layer after ``layers``: of the images (the first layer), of the first
    layer's identity-mean maps (the layer that reads them), random (deeper: :func:`_reinit` replaces both)."""
    if i == 0:
        return init_patches(X, shape, patch, n, stride=stride, per_centre=per_centre)
    if i == 1:
        return init_patches(_provisional(layers[0], X), shape, patch, n, stride=stride, per_centre=10)
    return torch.randn(n, patch * patch * shape[2])


def build_deep_conv_gp(images, image_shape, num_classes: int = 10, *, num_layers: int = 2, solve: bool = False,
                       num_inducing=(384, 1000), hidden=None, output=None, likelihood=None, variance: float = 5.0,
                       lengthscale: float = 1.0, location_lengthscale: float = 3.0, per_centre: int = 100,
                       num_samples: int = 1, seed: int | None = None, name: str | None = None) -> DeepConvGP:
    """The deep convolutional GP of Shi, Titsias, Mnih 2020 (table 5, appendix G.2), initialised from ``images``:
    hidden :class:`ConvLayer` s with identity-convolution means (``num_layers=2``: 5x5 stride 1, 10 channels;
    ``3``: then 4x4 stride 2, 10 channels), a :class:`~pyro_sparsegp.kernels.TICK` output layer (4x4 stride 2;
    ``3``: 5x5 stride 1) with a robust-max likelihood, no whitening; SVGP layers, or SOLVE-GP layers of ``M + M``
    inducing patches (``solve=True``, the paper's eq. 11). The first layer's inducing patches are k-means centres of
    image patches; every later layer's are k-means centres of patches of samples of the layers below it, its patch
    lengthscale their median distance, and its ``q(u)`` (``q(v⊥)``) the prior. The model of
    ``benchmarks/convgp_mnist.py``, with its defaults (patch RBF variance 5, lengthscale 1 for pixels in ``[0, 1]``,
    TICK location lengthscale 3).

    :param images: ``[N, H*W*C]`` flattened training images (500 of them initialise the layers after the first).
    :param image_shape: ``(H, W, C)`` (or ``(H, W)``). :param int num_classes: ``K``, the robust-max classes.
    :param num_inducing: ``(M_hidden, M_output)``, or one ``M`` for every layer (the paper: 384 and 1000).
    :param hidden: ``[(patch, stride, channels), ...]`` instead of table 5's hidden layers; :param output:
        ``(patch, stride)`` of the output layer instead of table 5's.
    :param likelihood: default ``RobustMax(num_classes)``. :param int per_centre: k-means on ``M * per_centre``
        patches. :param int num_samples: ``S`` propagated by ``analytic_elbo``.
    :param seed: draw the random parts (inducing locations, the images and samples that initialise the deeper
        layers) from ``torch.manual_seed(seed)`` without touching the global random state; ``None``: from the
        global random state, as the benchmark does after ``pyro.set_rng_seed``.

    ``dgp = build_deep_conv_gp(X, (28, 28, 1), 10)``, ``fit(dgp, X, y, batch_size=64)``, ``dgp.predict_proba(Xt)``
    ``[N, K]``."""
    if num_layers not in TABLE5 and (hidden is None or output is None):
        raise ValueError(f"num_layers must be one of {sorted(TABLE5)} (table 5), or give hidden and output")
    shape = _image(image_shape)
    X = as_tensor(images, "images")
    if X.dim() != 2 or X.shape[-1] != math.prod(shape):
        raise ValueError(f"images must be [N, H*W*C] = [N, {math.prod(shape)}] for image_shape {shape}, got shape "
                         f"{tuple(X.shape)}")
    spec = TABLE5.get(num_layers, (None, None))
    hidden, output = list(hidden or spec[0]), tuple(output or spec[1])
    M_h, M_o = (num_inducing, num_inducing) if isinstance(num_inducing, int) else tuple(num_inducing)
    n = 2 if solve else 1
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        layers = []
        for i, (patch, stride, channels) in enumerate(hidden):
            P = _first_patches(i, layers, X, shape, patch, stride, n * M_h, per_centre)
            layers.append(ConvLayer(_patch_kernel(P.shape[-1], variance, lengthscale), shape, patch, stride,
                                    channels, P[:M_h], P[M_h:] if solve else None, name=unique_name(f"conv{i}")))
            shape = layers[-1].output_image_shape
        patch, stride = output
        P = _first_patches(len(layers), layers, X, shape, patch, stride, n * M_o, 10)
        k = TICK(_patch_kernel(P.shape[-1], variance, lengthscale), shape, patch, stride,
                 location_lengthscale=location_lengthscale)
        lik = RobustMax(num_classes) if likelihood is None else likelihood
        Z = IndexedInducingPatches(P[:M_o], grid=k.grid)
        kw = dict(num_outputs=num_classes, whiten=False, integrate_f=True, name=unique_name("out"))
        if solve:
            out = SOLVEGP(k, Z, IndexedInducingPatches(P[M_o:], grid=k.grid), lik, **kw)
        else:
            out = SVGP(k, Z, lik, **kw)
        gp = DeepConvGP(layers, out, num_samples=num_samples, name=name)
        for i in range(1, len(layers)):
            (patch_i, stride_i, _), before = hidden[i], layers[:i]
            _reinit(layers[i].gp, before, X, before[-1].output_image_shape, patch_i, stride_i, M_h, solve, per_centre)
        _reinit(out, layers, X, shape, patch, stride, M_o, solve, per_centre)
    return gp


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

