"""Deep GP builders: :func:`build_deep_gp` initialises a :class:`~pyro_sparsegp.DeepGP` as the anchors do
(Salimbeni & Deisenroth 2017 reference code; GPflux), :func:`init_inducing` its inducing inputs. The model itself
(the doubly stochastic DGP of Salimbeni & Deisenroth 2017 over any stack of layers) is ``ps.DeepGP``, defined in
:mod:`pyro_sparsegp.layers.deep`; :func:`~pyro_sparsegp.saving.save` and :func:`~pyro_sparsegp.saving.load` keep a
trained model with its layout in one file that reloads without the training data (``dgp.save(path)``,
``DeepGP.load(path)``)."""

from __future__ import annotations

import torch
from pyro.contrib.gp import kernels as pk

from .checks.inputs import as_tensor
from .context.naming import unique_name
from .inducing.selection import METHODS, select
from .layers import SOLVEGP, SVGP
from .layers.deep import DeepGP
from .mean_functions import FixedProjection

__all__ = ["build_deep_gp", "init_inducing"]


# -- initialisation -----------------------------------------------------------------------------------------------
def _inputs(X) -> torch.Tensor:
    """``X`` ``[N, D]`` as a tensor in the default dtype (numpy, lists and pandas too, as the layers take them)."""
    X = as_tensor(X, "X")
    if X.dim() != 2:
        hint = " (one input column: X.reshape(-1, 1))" if X.dim() == 1 else ""
        raise ValueError(f"X must be [N, D], one row per input{hint}; got shape {tuple(X.shape)}")
    return X


def init_inducing(X: torch.Tensor, M: int, method: str = "kmeans", seed: int = 0, kernel=None) -> torch.Tensor:
    """``M`` inducing inputs ``[M, D]`` from the data ``X`` ``[N, D]``: k-means centres started from ``M`` random
    points (:func:`pyro_sparsegp.inducing.init.kmeans`, as the reference code of Salimbeni & Deisenroth 2017 does with
    ``scipy.cluster.vq.kmeans2(..., minit="points")``), the rows of the greedy conditional-variance selection of Burt,
    Rasmussen, van der Wilk 2020 under ``kernel`` (``method="greedy_variance"``; ``kernel=None``: an RBF with
    variance 1 and lengthscales 1), or (``method="random"``) a random subset of the rows
    (:func:`pyro_sparsegp.inducing.select`, which runs k-means on 20,000 random rows of a larger ``X`` and the greedy
    selection on a pool of ``4 M`` random rows); with ``M > N`` rows drawn with replacement (repeated inputs, which
    the Cholesky's jitter then has to absorb). ``X``: a tensor, numpy array, list or pandas frame, taken in the default
    dtype."""
    X = _inputs(X)
    N = X.shape[0]
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "random" or M >= N:
        g = torch.Generator().manual_seed(seed)
        cpu = {"generator": g, "device": "cpu"}  # the generator's device, whatever torch's default device
        idx = torch.randperm(N, **cpu)[:M] if M <= N else torch.randint(N, (M,), **cpu)
        idx = idx.to(X.device)
        return X[idx].detach().clone()
    return select(X.detach(), M, kernel, method, seed=seed)


def build_deep_gp(
    X: torch.Tensor,
    hidden_dims,
    likelihood,
    *,
    num_outputs: int | None = None,
    num_inducing: int = 100,
    num_orthogonal: int = 0,
    kernel: str = "rbf",
    lengthscale: float = 1.0,
    variance: float = 1.0,
    whiten: bool = True,
    hidden_scale: float = 1e-5,
    init: str = "kmeans",
    num_samples: int = 5,
    seed: int = 0,
    name: str | None = None,
) -> DeepGP:
    """A :class:`DeepGP` initialised as the anchors do (Salimbeni & Deisenroth 2017 reference code; GPflux):

    * inducing inputs of every layer: k-means of ``X`` (``init="kmeans"``), the rows of the greedy
      conditional-variance selection of Burt, Rasmussen, van der Wilk 2020 under the first layer's initial kernel
      (``init="greedy_variance"``) or a random subset (``init="random"``) (:func:`init_inducing`), propagated through
      the hidden layers' fixed mean functions (``Z_running <- m(Z_running)``, ``X_running <- m(X_running)``);
    * hidden layer mean functions: identity when the width is kept, PCA of the running inputs when it shrinks, zero
      padding when it grows (:meth:`FixedProjection.between`); the last layer has a zero mean;
    * RBF (ARD) kernels with the given ``lengthscale``/``variance`` (``kernel="matern32"`` etc. also work);
    * ``q(u) = N(0, hidden_scale^2 * prior covariance)`` in hidden layers ("start things deterministic": each hidden
      layer starts as its mean function), the prior in the last layer.

    :param X: training inputs ``[N, D]`` (standardised; a tensor, numpy array, list or pandas frame, in the default
        dtype).
    :param hidden_dims: widths ``D_1 .. D_{L-1}`` of the hidden layers (``[]``: a one-layer model, an SVGP).
    :param likelihood: of the last layer.
    :param num_outputs: of the last layer (``None``: one output; ``K`` for a ``K``-class likelihood).
    :param num_inducing: ``M`` per layer.
    :param num_orthogonal: ``M2`` orthogonal inducing points per layer: ``> 0`` makes every layer a
        :class:`~pyro_sparsegp.SOLVEGP` (the deep SOLVE-GP of Shi et al. 2020, section 4), whose ``M + M2`` initial
        points are one k-means run split in two.
    :param init: ``"kmeans"``, ``"greedy_variance"`` or ``"random"`` (:func:`init_inducing`).
    """
    kernels = {"rbf": pk.RBF, "matern32": pk.Matern32, "matern52": pk.Matern52}
    if kernel not in kernels:
        raise ValueError(f"kernel must be one of {sorted(kernels)}, got {kernel!r}")
    M, M2 = num_inducing, num_orthogonal
    X_run = _inputs(X).detach()
    if M + M2 > X_run.shape[0]:
        raise ValueError(f"num_inducing + num_orthogonal = {M + M2} inducing inputs per layer from N = "
                         f"{X_run.shape[0]} training inputs would repeat inputs (k-means has at most N distinct "
                         f"centres); use at most {X_run.shape[0]}")
    first = kernels[kernel](input_dim=X_run.shape[-1], variance=torch.tensor(float(variance)),
                            lengthscale=torch.full((X_run.shape[-1],), float(lengthscale)))  # init="greedy_variance"
    Z_run = init_inducing(X_run, M + M2, init, seed, kernel=first)
    dims = list(hidden_dims) + [num_outputs]
    layers = []
    for i, D_out in enumerate(dims):
        last = i == len(dims) - 1
        D = X_run.shape[-1]
        k = kernels[kernel](input_dim=D, variance=torch.tensor(float(variance)),
                            lengthscale=torch.full((D,), float(lengthscale)))
        mean = None if last else FixedProjection.between(X_run, D_out)
        kwargs = dict(likelihood=likelihood if last else None, num_outputs=D_out, whiten=whiten,
                      name=unique_name(f"layer{i}"), mean_function=mean)
        if M2 > 0:
            layer = SOLVEGP(k, Z_run[:M].clone(), Z_run[M:].clone(), **kwargs)
        else:
            layer = SVGP(k, Z_run.clone(), **kwargs)
        if not last:
            with torch.no_grad():
                layer.q_u.u_scale_tril = layer.q_u.u_scale_tril.detach() * hidden_scale
                if M2 > 0 and layer.q_v.learn_scale:
                    layer.q_v.u_scale_tril = layer.q_v.u_scale_tril.detach() * hidden_scale
                X_run, Z_run = mean(X_run), mean(Z_run)
        layers.append(layer)
    return DeepGP(layers, num_samples=num_samples, name=name)
