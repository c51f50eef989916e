r"""Deep Gaussian processes: the doubly stochastic DGP of Salimbeni & Deisenroth (2017) with
:class:`~pyro_sparsegp.SVGP` and :class:`~pyro_sparsegp.SOLVEGP` layers (the deep SOLVE-GP of Shi, Titsias, Mnih
2020, section 4, eq. 11).

Layers ``l = 1..L`` with ``F^0 = X``; layer ``l`` has ``D_l`` outputs, a mean function ``m_l`` and inducing outputs
``U^l = g_l(Z^{l-1})``. The variational family keeps the exact conditionals,
``q({F^l, U^l}) = prod_l p(F^l | U^l; F^{l-1}) q(U^l)``, and the bound is (Salimbeni & Deisenroth 2017, eq. 4)

.. math:: \mathcal{L} = \sum_i \mathbb{E}_{q(f^L_i)}[\log p(y_i \mid f^L_i)] - \sum_l \mathrm{KL}[q(U^l) \| p(U^l)],

where :math:`q(f^L_i)` is reached point by point: given :math:`f^{l-1}_i`, :math:`q(f^l_i \mid f^{l-1}_i)` is the
layer's SVGP marginal at input :math:`f^{l-1}_i` (:meth:`SVGP.qf`; Salimbeni eq. 5-7), sampled by reparameterisation.
With SOLVE-GP layers the marginal is eqs. 37-38 and the KL terms gain ``KL[q(v⊥) || p⊥(v⊥)]`` (Shi eq. 11, eq. 39).

:class:`DeepGP` is that stack as a PyroModule, with these sites:

* ``<layer>.u`` (and ``<layer>.v`` for SOLVE-GP): ``p(u)`` (``p⊥(v⊥)``) in the model, ``q(u)`` (``q(v⊥)``) in the
  guide, outside the data plate;
* ``<layer>.f`` of each hidden layer: ``p(f | u)`` at the sample of the layer below, in model and guide alike (it
  cancels);
* ``y`` (model only): ``E_{q(f^L | f^{L-1})}[log p(y | f^L)]``, a ``MarginalizedLikelihood`` at the last layer's
  ``q(f)`` (its ``u`` integrated out),

so ``Trace_ELBO`` (any number of vectorised particles) is an unbiased estimate of the DGP bound (eq. 11 for
SOLVE-GP layers); prefer ``TraceMeanField_ELBO``, which takes the KL of the ``u`` sites in closed form: a hidden
``q(u)`` started at scale ``1e-5`` soon has a very ill-conditioned Cholesky factor (Adam moves its off-diagonal
entries by ``lr`` per step and its log-parameterised diagonal by a factor ``exp(lr)``), and a sampled ``log q(u)``
then loses its precision. ``marginalize_last=False`` samples the last layer's ``u`` and ``f`` instead (same bound,
higher variance). :meth:`DeepGP.analytic_elbo` is Salimbeni's own estimator (``S`` samples propagated through the
layers' marginals, analytic KL), which ``fit(..., elbo="analytic")`` maximises. Prediction is the mixture of ``S``
Gaussians (Salimbeni section 3.3): :meth:`DeepGP.predictive_log_prob` takes the logsumexp over the samples.

Shapes (``S`` samples, ``B`` points, ``D_l`` outputs of layer ``l``): hidden samples ``[S, B, D_l]`` from
:meth:`DeepGP.propagate` (``[S, 1, B, D_l]`` as the next layer's inputs, see :func:`~pyro_sparsegp.layers.as_inputs`);
the last layer's marginals ``[S, B]`` or ``[S, B, L]``.
"""

from __future__ import annotations

import contextlib
import math

import pyro
import torch
from pyro.contrib.gp import kernels as pk
from pyro.nn import PyroModule

from . import deferred
from .composition import BoundModule, layer_method
from .composition import plate as data_plate
from .distributions import MarginalizedLikelihood
from .inputs import as_targets, as_tensor
from .kmeans import kmeans
from .layers import SVGP, _check_finite, _take, as_inputs
from .mean_functions import FixedProjection
from .naming import register_name, unique_name
from .solvegp import SOLVEGP

__all__ = ["DeepGP", "build_deep_gp", "init_inducing", "sample_marginal"]


def sample_marginal(layer: SVGP, X: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
    r"""A reparameterised draw from the layer's marginal :math:`q(f_n \mid x_n)` at every point of ``X`` (``u``
    integrated out; Salimbeni & Deisenroth 2017, eq. 7), laid out as the next layer's inputs.

    :param X: ``[..., B, D]`` (``[S, 1, B, D]`` for samples of the layer below).
    :param num_samples: ``S`` draws when ``X`` carries no sample dimension (``X`` ``[B, D]``), else ``None``.
    :returns: ``[..., 1, B, L]`` (``[S, 1, B, L]`` from a 2-D ``X`` with ``num_samples``).
    """
    if layer.num_outputs is None:
        raise ValueError(f"layer {layer.name!r} is a hidden layer: give it num_outputs (its width, 1 included)")
    loc, var = _qf_points(layer, X)  # [..., L, B]
    shape = loc.shape if num_samples is None else (num_samples,) + loc.shape
    eps = torch.randn(shape, dtype=loc.dtype, device=loc.device)
    return as_inputs(loc + var.sqrt() * eps, layer.num_outputs)


def _qf_points(layer: SVGP, X: torch.Tensor):
    """``layer.qf(X)`` for sample-batched inputs ``[..., 1, B, D]``, computed on the points flattened to
    ``[P B, D]``: the marginals are point-wise, and one ``[M, P B]`` projection is one large BLAS call instead of
    ``P`` broadcast ones (the inducing inputs, shared by the samples, are never expanded). Same values and shapes
    (``[..., L, B]`` or ``[..., 1, B]``) as ``layer.qf(X)``."""
    if X.dim() <= 2 or X.shape[-3] != 1:
        return layer.qf(X)
    lead, B = X.shape[:-3], X.shape[-2]
    loc, var = layer.qf(X.reshape(-1, X.shape[-1]))  # [(L,) P B]
    if layer.num_outputs is None:
        return loc.reshape(lead + (1, B)), var.reshape(lead + (1, B))
    L = loc.shape[-2]

    def back(t):
        return t.reshape((L,) + lead + (B,)).movedim(0, -2)

    return back(loc), back(var)


class DeepGP(PyroModule):
    """A doubly stochastic deep GP (Salimbeni & Deisenroth 2017) built from layers.

    :param layers: :class:`~pyro_sparsegp.SVGP` / :class:`~pyro_sparsegp.SOLVEGP` layers, any mix, with distinct
        names. Hidden layers have no likelihood and ``num_outputs = D_l`` (usually a mean function,
        :mod:`~pyro_sparsegp.mean_functions`); the last layer carries the likelihood (Gaussian, Bernoulli,
        PolyaGammaLogit, RobustMax, Softmax) and the number of outputs it needs. Layer ``l + 1``'s inducing inputs
        have ``D_l`` features.
    :param int num_samples: ``S``, samples propagated by :meth:`analytic_elbo` (the model/guide pair draws one per
        Pyro particle: use ``Trace_ELBO(num_particles=S, vectorize_particles=True)``).
    :param bool marginalize_last: observe ``y`` under the last layer's ``q(f)`` at the sample of the layer below
        (its ``u`` integrated out, the expectation analytic or by Gauss-Hermite: lower variance; default); ``False``
        samples the last layer's ``u`` and ``f`` (or, if the layer has ``integrate_f``, integrates ``f`` given
        ``u``).
    :param str name: prefix of the data plate.

    Shapes: ``X`` ``[..., N, D_0]``; hidden layer ``l`` gives ``f`` ``[..., D_l, B]``, passed on as inputs
    ``[..., 1, B, D_l]`` (:func:`~pyro_sparsegp.layers.as_inputs`); ``y`` as the last layer's ``model`` takes it
    (``[..., N]``, or ``[..., N, L]`` for ``L`` outputs).
    """

    def __init__(self, layers, num_samples: int = 5, marginalize_last: bool = True, name: str | None = None):
        name = unique_name("dgp") if name is None else name
        super().__init__(name=name)
        register_name(self, name)
        layers = list(layers)
        if not layers:
            raise ValueError("a DeepGP needs at least one layer")
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"the layers' names must be distinct (they name the sample sites), got {names}")
        for i, layer in enumerate(layers):
            if not isinstance(layer, SVGP):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not an SVGP or SOLVEGP")
            if i < len(layers) - 1:
                if layer.likelihood is not None:
                    raise ValueError(f"hidden layer {layer.name!r} has a likelihood; only the last layer has one")
                if layer.num_outputs is None:
                    raise ValueError(f"hidden layer {layer.name!r} needs num_outputs (its width D_l, 1 included)")
                nxt = layers[i + 1].inducing.input_dim(layers[i + 1].kernel)
                if nxt != layer.num_outputs:
                    raise ValueError(f"layer {layers[i + 1].name!r} takes {nxt} features but {layer.name!r} gives "
                                     f"{layer.num_outputs}")
        if layers[-1].likelihood is None:
            raise ValueError(f"the last layer {layers[-1].name!r} needs a likelihood")
        # a plain ModuleList: each layer keeps its own Pyro context and parameter names (``<layer>.Z``, ...), so
        # layers built, initialised or trained on their own before join a DeepGP as they are
        self.layers = torch.nn.ModuleList(layers)
        self.__dict__["_stack"] = layers  # a plain list too: PyroModule attribute look-ups cost ~10 us each
        self.num_samples = num_samples
        self.marginalize_last = marginalize_last
        self.name = name

    # -- accessors ----------------------------------------------------------------------------------------------
    @property
    def likelihood(self):
        """The last layer's likelihood (a module, not a tensor, so shapes do not apply)."""
        return self._stack[-1].likelihood

    @property
    def hidden(self) -> list:
        """The hidden layers, first to last (a list of modules, not tensors, so shapes do not apply)."""
        return self._stack[:-1]

    @property
    def last(self) -> SVGP:
        """The last layer, which carries the likelihood (a module, not a tensor, so shapes do not apply)."""
        return self._stack[-1]

    def natgrad_families(self) -> list:
        """The variational families that natural-gradient steps should train: the last layer's only (Salimbeni et al.
        2018 found natural gradients on inner layers unstable), i.e. its ``q(u)`` and, for a SOLVE-GP last layer,
        its full-covariance ``q(v⊥)`` too (both are Gaussian factors of the same layer's posterior; leaving q(v⊥) to
        Adam would train half of the deep SOLVE-GP's last layer more slowly than the DGP's). Returns a list of
        modules, not tensors, so shapes do not apply."""
        q_v = getattr(self.last, "q_v", None)
        return [self.last.q_u] + ([q_v] if q_v is not None and q_v.learn_scale else [])

    def check_inputs(self, X, y=None):
        """The data as tensors, checked (:mod:`pyro_sparsegp.inputs`, as :meth:`SVGP.check_inputs`): ``X``
        ``[..., N, D_0]``, ``y`` ``[..., N]`` (``[N, 1]`` taken as ``[N]``) or ``[..., N, L]``; returns ``(X, y)``."""
        first = self._stack[0]
        X = as_tensor(X, "X", first.inducing.dtype, first.inducing.device)
        D = first.inducing.input_dim(first.kernel)
        if X.dim() < 2 or X.shape[-1] != D:
            raise ValueError(f"X must be [N, D] with D = {D} features (the first layer's inputs), got shape "
                             f"{tuple(X.shape)}")
        _check_finite("X", X)
        if y is not None:
            last, lik = self.last, self.likelihood
            y = as_tensor(y, "y", X.dtype, X.device, floating=False)
            y = as_targets(y, X.shape[-2], last.num_outputs, bool(last.num_outputs) and lik.latent_dim == 1)
            if deferred.active() is None:  # else fit checked y once (deferred.py)
                lik.check_y(y)
        return X, y

    def _targets(self, y):
        if y is not None and self.last.num_outputs is not None and self.likelihood.latent_dim == 1:
            return y.mT  # [L, B]
        return y

    # -- the Pyro program ---------------------------------------------------------------------------------------
    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The data plate ``"<name>.data"`` (``dim=-1``) that :meth:`model` opens for these arguments, drawn from
        this call's own ``X`` ``[..., N, D]``: ``AutoGuideList(dgp.model, create_plates=dgp.create_plates)``."""
        X = X if isinstance(X, torch.Tensor) else self.check_inputs(X)[0]
        return self._plate(X.shape[-2], subsample_size, num_data, X.device)

    def _plate(self, N, subsample_size, num_data, device):
        if num_data is None:
            return data_plate(f"{self.name}.data", N, subsample_size=subsample_size, dim=-1, device=device)
        return data_plate(f"{self.name}.data", num_data, subsample=torch.arange(N, device=device), dim=-1)

    def _batch(self, X, y, idx, subsample_size, num_data):
        if num_data is not None or subsample_size is None:
            return X, y
        return _take(X, idx), (None if y is None else y[idx])

    def _outputs_ctx(self):
        return self.last._outputs_plate() if self.likelihood.latent_dim == 1 else contextlib.nullcontext()

    @layer_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """Generative model: ``u`` of every layer outside the data plate, then inside it each hidden layer's ``f`` at
        the sample of the layer below (``sample_hidden``) and ``y`` (module docstring). ``num_data``: ``X`` is a
        minibatch of a data set of that size; ``subsample_size``: the plate draws a minibatch of ``X``. ``X``
        ``[..., N, D_0]``, ``y`` as in the class docstring; returns the observed ``y`` site's value."""
        X, y = self.check_inputs(X, y)
        us = [layer.sample_u() for layer in self._stack]
        last, lik = self.last, self.likelihood
        with self._plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            h, yb = self._batch(X, y, idx, subsample_size, num_data)
            for layer, u in zip(self.hidden, us[:-1], strict=True):
                h = layer.sample_hidden(h, u)
            yt = self._targets(yb)
            with self._outputs_ctx():
                if self.marginalize_last or last.integrate_f:
                    q = last.qf(h, consume=True) if self.marginalize_last else last._moments(h, us[-1], True)
                    return pyro.sample("y", MarginalizedLikelihood(BoundModule(lik), *q), obs=yt)
                f = last.sample_f(h, us[-1])
                return lik(f, yt, prefix=last.name)

    @layer_method
    def guide(self, X, y=None, *, subsample_size=None, num_data=None):
        """Variational distribution ``prod_l q(u_l) p(f_l | u_l, f_{l-1})``; returns the drawn latent values by site
        name (a dict, so that it can be a part of ``AutoGuideList``). ``X`` ``[..., N, D_0]``; hidden ``f`` values
        ``[..., D_l, B]`` (``[..., B]`` for a single output)."""
        X, y = self.check_inputs(X, y)
        us = [layer.sample_u(guide=True) for layer in self._stack]
        out = {}
        for layer, u in zip(self._stack, us, strict=True):
            if isinstance(u, tuple):
                out[f"{layer.name}.u"], out[f"{layer.name}.v"] = u
            else:
                out[f"{layer.name}.u"] = u
        last = self.last
        with self._plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            h, _ = self._batch(X, None, idx, subsample_size, num_data)
            for layer, u in zip(self.hidden, us[:-1], strict=True):
                f = out[f"{layer.name}.f"] = layer.sample_f(h, u, guide=True)
                h = as_inputs(f, layer.num_outputs)
            if self.marginalize_last or last.integrate_f:
                last._stats(h, consume=False)  # factors for the model's q(f) / p(f | u)
            else:
                out[f"{last.name}.f"] = last.sample_f(h, us[-1], guide=True)
                with self._outputs_ctx():
                    self.likelihood.guide(lambda: last.qf(h), prefix=last.name)
        return out

    # -- Salimbeni's estimator and prediction -------------------------------------------------------------------
    def propagate(self, X: torch.Tensor, num_samples: int | None = None):
        """Propagate ``S`` samples through the hidden layers' marginals (reparameterised, Salimbeni eq. 7) and return
        ``(hidden, loc, var)``: the hidden samples ``[S, B, D_l]`` per layer, and the last layer's marginals at the
        last sample, ``[S, B]`` (one output) or ``[S, L, B]`` (``L`` outputs or classes, laid out like ``f``)."""
        S = num_samples or self.num_samples
        h, hidden = X, []
        for i, layer in enumerate(self.hidden):
            h = sample_marginal(layer, h, S if i == 0 else None)
            hidden.append(h.squeeze(-3))
        loc, var = _qf_points(self.last, h)
        if not self.hidden:  # one layer: every sample is the same
            loc, var = loc.expand((S,) + loc.shape), var.expand((S,) + var.shape)
        elif self.last.num_outputs is None:
            loc, var = loc.squeeze(-2), var.squeeze(-2)  # [S, 1, B] -> [S, B]
        return hidden, loc, var

    @layer_method
    def analytic_elbo(self, X, y, num_data: int | None = None, num_samples: int | None = None) -> torch.Tensor:
        """Salimbeni & Deisenroth's doubly stochastic estimate of the bound (eq. 8; Shi eq. 11 for SOLVE-GP layers)
        on a minibatch: ``num_data / B * 1/S * sum_s sum_n E_{q(f^L_n | f^{L-1}_n(s))}[log p(y_n | f^L_n)]
        - sum_l KL_l`` with ``S = num_samples`` (default ``self.num_samples``) samples propagated through the hidden
        layers' marginals, the last expectation analytic (Gaussian) or by Gauss-Hermite, and the KL terms in closed
        form. Differentiable and unbiased; ``fit(..., elbo="analytic")`` maximises it."""
        X, y = self.check_inputs(X, y)
        _, loc, var = self.propagate(X, num_samples)
        S = loc.shape[0]
        yt = self._targets(y)
        ell = self.likelihood.expected_log_prob(yt, loc, var).sum() / S
        kl = sum(layer.kl_divergence(consume=True).sum() for layer in self._stack)
        for layer in self._stack:
            layer._cache.clear()
        return (num_data or X.shape[-2]) / X.shape[-2] * ell - kl

    @torch.no_grad()
    def predict(self, X: torch.Tensor, num_samples: int = 100):
        """The predictive mixture's components: mean and variance of ``f*`` per sample, ``[S, N]`` or ``[S, N, L]``
        each (``q(f* | x*) ≈ 1/S sum_s N(mu_s, var_s)``, Salimbeni & Deisenroth 2017, section 3.3)."""
        X, _ = self.check_inputs(X)
        _, loc, var = self.propagate(X, num_samples)
        for layer in self._stack:
            layer._cache.clear()
        if self.last.num_outputs is not None:
            return loc.mT, var.mT
        return loc, var

    @torch.no_grad()
    def predictive_log_prob(self, X: torch.Tensor, y: torch.Tensor, num_samples: int = 100,
                            return_se: bool = False):
        """Test log-likelihood per point ``[N]``: ``log 1/S sum_s p(y_n | mu_s, var_s)`` (logsumexp over the mixture's
        ``S = num_samples`` components; a vector ``y_n`` of ``L`` outputs is scored jointly within each component).

        How many samples suffice: the estimate is a log of a Monte Carlo mean, so it is biased low and its error is
        about ``se_n = std_s(w_s) / (sqrt(S) mean_s(w_s))`` with ``w_s = p(y_n | mu_s, var_s)`` (the delta method).
        Where the hidden layers put the point on either side of a sharp change (a step, a discontinuity), a few
        components carry all the mass and ``S = 100`` can be off by several nats for that point, which then dominates
        a mean over points. ``return_se=True`` also returns ``se`` ``[N]``: raise ``S`` until ``se`` is small (e.g.
        below 0.05) for the points you average, or report the median over points beside the mean."""
        X, y = self.check_inputs(X, y)
        _, loc, var = self.propagate(X, num_samples)
        for layer in self._stack:
            layer._cache.clear()
        lp = self.likelihood.predictive_log_prob(self._targets(y), loc, var)  # [S, (L,) N]
        if lp.dim() == 3:
            lp = lp.sum(-2)
        out = torch.logsumexp(lp, 0) - math.log(lp.shape[0])
        if not return_se:
            return out
        w = (lp - lp.max(0).values).exp()  # weights relative to the largest, [S, N]
        se = w.std(0) / (w.mean(0) * math.sqrt(lp.shape[0]))
        return out, se

    @torch.no_grad()
    def predict_proba(self, X: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Class probabilities, the mixture's average: ``[N]`` (``p(y=1)``, Bernoulli) or ``[N, K]`` (multi-class)."""
        X, _ = self.check_inputs(X)
        _, loc, var = self.propagate(X, num_samples)
        for layer in self._stack:
            layer._cache.clear()
        d = self.likelihood.predictive(loc, var)
        if not hasattr(d, "probs"):
            raise ValueError(f"predict_proba needs a classification likelihood, not {type(self.likelihood).__name__}")
        p = d.probs.mean(0)
        return p.squeeze(-2) if p.dim() == 2 and self.likelihood.latent_dim == 1 and p.shape[-2] == 1 else p


# -- initialisation -----------------------------------------------------------------------------------------------
def init_inducing(X: torch.Tensor, M: int, method: str = "kmeans", seed: int = 0) -> torch.Tensor:
    """``M`` inducing inputs ``[M, D]`` from the data ``X`` ``[N, D]``: k-means centres started from ``M`` random
    points (:func:`pyro_sparsegp.kmeans.kmeans`, as the reference code of Salimbeni & Deisenroth 2017 does with
    ``scipy.cluster.vq.kmeans2(..., minit="points")``), or (``method="random"``) a random subset of the rows."""
    N = X.shape[0]
    g = torch.Generator().manual_seed(seed)
    if method == "random" or M >= N:
        idx = torch.randperm(N, generator=g)[:M] if M <= N else torch.randint(N, (M,), generator=g)
        return X[idx].detach().clone()
    if method != "kmeans":
        raise ValueError(f"method must be 'kmeans' or 'random', got {method!r}")
    return kmeans(X.detach(), M, iters=50, generator=g)


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

    * inducing inputs of every layer: k-means (or a random subset, ``init="random"``) of ``X``, propagated through
      the hidden layers' fixed mean functions (``Z_running <- m(Z_running)``, ``X_running <- m(X_running)``);
    * hidden layer mean functions: identity when the width is kept, PCA of the running inputs when it shrinks, zero
      padding when it grows (:meth:`FixedProjection.between`); the last layer has a zero mean;
    * RBF (ARD) kernels with the given ``lengthscale``/``variance`` (``kernel="matern32"`` etc. also work);
    * ``q(u) = N(0, hidden_scale^2 * prior covariance)`` in hidden layers ("start things deterministic": each hidden
      layer starts as its mean function), the prior in the last layer.

    :param X: training inputs ``[N, D]`` (standardised).
    :param hidden_dims: widths ``D_1 .. D_{L-1}`` of the hidden layers (``[]``: a one-layer model, an SVGP).
    :param likelihood: of the last layer.
    :param num_outputs: of the last layer (``None``: one output; ``K`` for a ``K``-class likelihood).
    :param num_inducing: ``M`` per layer.
    :param num_orthogonal: ``M2`` orthogonal inducing points per layer: ``> 0`` makes every layer a
        :class:`~pyro_sparsegp.SOLVEGP` (the deep SOLVE-GP of Shi et al. 2020, section 4), whose ``M + M2`` initial
        points are one k-means run split in two.
    """
    kernels = {"rbf": pk.RBF, "matern32": pk.Matern32, "matern52": pk.Matern52}
    if kernel not in kernels:
        raise ValueError(f"kernel must be one of {sorted(kernels)}, got {kernel!r}")
    M, M2 = num_inducing, num_orthogonal
    X_run = X.detach()
    Z_run = init_inducing(X_run, M + M2, init, seed)
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
