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
:meth:`DeepGP.propagate` (``[S, 1, B, D_l]`` as the next layer's inputs, see
:func:`~pyro_sparsegp.layers.base.as_inputs`);
the last layer's marginals ``[S, B]`` or ``[S, B, L]``.
"""

from __future__ import annotations

import contextlib

import pyro
import torch
from pyro.nn import PyroModule

from ..checks.inputs import as_targets, as_tensor
from ..context.composition import BoundModule, layer_method
from ..context.naming import register_name, unique_name
from ..distributions import MarginalizedLikelihood
from ..likelihoods import _check_finite
from ..saving import Saveable
from ..variational.cache import take
from .base import named_data_plate, qf_points, sample_marginal
from .deep_prediction import DeepPrediction
from .outputs import check_targets, masked, masked_sum
from .svgp import SVGP

__all__ = ["DeepGP", "sample_marginal", "check_layer", "LAYER_PROTOCOL"]

#: What a hidden layer of a :class:`DeepGP` provides (SVGP, SOLVE-GP and convolutional layers do).
LAYER_PROTOCOL = ("name", "input_dim", "output_dim", "sample_u", "sample_hidden", "propagate_marginal",
                  "kl_divergence", "clear_cache")


def check_layer(i: int, layer, nxt) -> None:
    """Raise unless ``layer`` (number ``i``) can be a hidden layer feeding ``nxt``: it speaks
    :data:`LAYER_PROTOCOL`, has no likelihood, and gives as many features as ``nxt`` takes. Modules, not tensors,
    so shapes do not apply; argument checks: implements no paper equation."""
    missing = [a for a in LAYER_PROTOCOL if not hasattr(type(layer), a) and not hasattr(layer, a)]
    if missing:
        raise TypeError(f"layer {i} is a {type(layer).__name__}, which lacks {missing} of the hidden-layer protocol "
                        "(SVGP, SOLVEGP and ConvLayer provide it)")
    if getattr(layer, "likelihood", None) is not None:
        raise ValueError(f"hidden layer {layer.name!r} has a likelihood; only the last layer has one")
    if layer.output_dim is None:
        raise ValueError(f"hidden layer {layer.name!r} needs num_outputs (its width D_l, 1 included)")
    if nxt.input_dim != layer.output_dim:
        raise ValueError(f"layer {nxt.name!r} takes {nxt.input_dim} features but {layer.name!r} gives "
                         f"{layer.output_dim}")


class DeepGP(DeepPrediction, Saveable, PyroModule):
    """A doubly stochastic deep GP (Salimbeni & Deisenroth 2017) built from layers.

    :param layers: hidden layers that speak the layer protocol (:data:`LAYER_PROTOCOL`:
        :class:`~pyro_sparsegp.SVGP`, :class:`~pyro_sparsegp.SOLVEGP`, :class:`~pyro_sparsegp.ConvLayer`; distinct
        names, no likelihood, ``output_dim`` features each, usually a mean function), then an
        :class:`~pyro_sparsegp.SVGP` or :class:`~pyro_sparsegp.SOLVEGP` last layer that carries the likelihood
        (Gaussian, Bernoulli, PolyaGammaLogit, RobustMax, Softmax) and the number of outputs it needs.
    :param int num_samples: ``S``, samples propagated by :meth:`analytic_elbo` (the model/guide pair draws one per
        Pyro particle: use ``Trace_ELBO(num_particles=S, vectorize_particles=True)``).
    :param bool marginalize_last: observe ``y`` under the last layer's ``q(f)`` at the sample of the layer below
        (its ``u`` integrated out, the expectation analytic or by Gauss-Hermite: lower variance; default); ``False``
        samples the last layer's ``u`` and ``f`` (or, if the layer has ``integrate_f``, integrates ``f`` given
        ``u``).
    :param str name: prefix of the data plate.

    Shapes: ``X`` ``[..., N, D_0]``; hidden layer ``l`` gives ``f`` ``[..., D_l, B]``, passed on as inputs
    ``[..., 1, B, D_l]`` (:func:`~pyro_sparsegp.layers.base.as_inputs`); ``y`` as the last layer's ``model`` takes
    it (``[..., N]``, or ``[..., N, L]`` for ``L`` outputs).
    """

    def __init__(self, layers, num_samples: int = 5, marginalize_last: bool = True, name: str | None = None):
        name = unique_name("dgp") if name is None else name
        super().__init__(name=name)
        register_name(self, name)
        layers = list(layers)
        if not layers:
            raise ValueError("a DeepGP needs at least one layer")
        if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples}")
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"the layers' names must be distinct (they name the sample sites), got {names}")
        if not isinstance(layers[-1], SVGP):
            raise TypeError(f"the last layer is a {type(layers[-1]).__name__}, not an SVGP or SOLVEGP")
        for i, layer in enumerate(layers[:-1]):
            check_layer(i, layer, layers[i + 1])
        if layers[-1].likelihood is None:
            raise ValueError(f"the last layer {layers[-1].name!r} needs a likelihood")
        # a plain ModuleList: each layer keeps its own Pyro context and parameter names (``<layer>.Z``, ...), so
        # layers built, initialised or trained on their own before join a DeepGP as they are
        self.layers = torch.nn.ModuleList(layers)
        self.__dict__["_stack"] = layers  # a plain list too: PyroModule attribute look-ups cost ~10 us each
        self.num_samples = int(num_samples)
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
        """The variational families that natural-gradient steps should train by default: the last layer's only
        (Salimbeni et al. 2018 found natural gradients on inner layers unstable), i.e. its ``q(u)`` and, for a
        SOLVE-GP last layer, its full-covariance ``q(v⊥)`` too. A list of modules (``u_loc [..., M]``,
        ``u_scale_tril [..., M, M]``). Here natural steps on every layer
        (``fit(natgrad=NaturalPolicy(layers="all"))``: the hidden layers from half the steps on, their iterates
        averaged at the end) did not fail on kin8nm, and their test log-likelihood depends on that average
        (:mod:`~pyro_sparsegp.infer.natgrad.policy`)."""
        return self.last.strategy.natgrad_families()

    def check_inputs(self, X, y=None):
        """The data as tensors, checked (:mod:`pyro_sparsegp.checks.inputs`, as :meth:`SVGP.check_inputs`): ``X``
        ``[..., N, D_0]``, ``y`` ``[..., N]`` (``[N, 1]`` taken as ``[N]``) or ``[..., N, L]``; returns ``(X, y)``."""
        first, ref = self._stack[0], self.last.inducing
        X = as_tensor(X, "X", ref.dtype, ref.device)
        D = first.input_dim
        if X.dim() < 2 or X.shape[-1] != D:
            raise ValueError(f"X must be [N, D] with D = {D} features (the first layer's inputs), got shape "
                             f"{tuple(X.shape)}")
        _check_finite("X", X)
        if y is not None:
            last, lik = self.last, self.likelihood
            y = as_tensor(y, "y", X.dtype, X.device, floating=False)
            per_output = bool(last.num_outputs) and lik.latent_dim == 1
            y = as_targets(y, X.shape[-2], last.num_outputs, per_output, lik)
            check_targets(lik, y, per_output)  # NaN: a missing output (masked), else an error
        return X, y

    # -- the Pyro program ---------------------------------------------------------------------------------------
    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The data plate ``"<name>.data"`` (``dim=-1``) that :meth:`model` opens for these arguments, drawn from
        this call's own ``X`` ``[..., N, D]``: ``AutoGuideList(dgp.model, create_plates=dgp.create_plates)``."""
        X = X if isinstance(X, torch.Tensor) else self.check_inputs(X)[0]
        return self._plate(X.shape[-2], subsample_size, num_data, X.device)

    def _plate(self, N, subsample_size, num_data, device):
        return named_data_plate(self.name, N, subsample_size, num_data, device)

    def _batch(self, X, y, idx, subsample_size, num_data):
        if num_data is not None or subsample_size is None:
            return X, y
        return take(X, idx), (None if y is None else y[idx])

    def _outputs_ctx(self):
        return self.last._outputs_plate() if self.likelihood.latent_dim == 1 else contextlib.nullcontext()

    @layer_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """Generative model: ``u`` of every layer outside the data plate, then inside it each hidden layer's sample
        at the sample of the layer below (``sample_hidden``: the site ``<layer>.f`` of an SVGP layer) and ``y``
        (module docstring). ``num_data``: ``X`` is a minibatch of a data set of that size; ``subsample_size``: the
        plate draws a minibatch of ``X``. ``X`` ``[..., N, D_0]``, ``y`` as in the class docstring; returns the
        observed ``y`` site's value."""
        X, y = self.check_inputs(X, y)
        us = [layer.sample_u() for layer in self._stack]
        last, lik = self.last, self.likelihood
        with self._plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            h, yb = self._batch(X, y, idx, subsample_size, num_data)
            for layer, u in zip(self.hidden, us[:-1], strict=True):
                h = layer.sample_hidden(h, u)
            yt, mask = self._targets(yb)
            with self._outputs_ctx(), masked(mask):
                if self.marginalize_last or last.integrate_f:
                    q = last.qf(h, consume=True) if self.marginalize_last else last.moments(h, us[-1], True)
                    return pyro.sample("y", MarginalizedLikelihood(BoundModule(lik), *q), obs=yt)
                f = last.sample_f(h, us[-1])
                return lik(f, yt, prefix=last.name)

    @layer_method
    def guide(self, X, y=None, *, subsample_size=None, num_data=None):
        """Variational distribution ``prod_l q(u_l) p(f_l | u_l, f_{l-1})``; returns the drawn latent values by site
        name (a dict, so that it can be a part of ``AutoGuideList``). ``X`` ``[..., N, D_0]``; hidden ``f`` values
        ``[..., D_l, B]`` (``[..., B]`` for a single output). Hidden layers whose samples are no sites (convolutional
        layers) are not propagated here: the model draws its own."""
        X, y = self.check_inputs(X, y)
        out = {}
        for layer in self._stack:
            u = layer.sample_u(guide=True)
            out.update(zip((f"{layer.name}.{s}" for s in layer.strategy.sites), u if isinstance(u, tuple) else (u,),
                           strict=True))
        if not all(isinstance(layer, SVGP) for layer in self.hidden):
            return out
        us = [out[f"{layer.name}.u"] if len(layer.strategy.sites) == 1 else
              tuple(out[f"{layer.name}.{s}"] for s in layer.strategy.sites) for layer in self._stack]
        last = self.last
        with self._plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            h, yb = self._batch(X, y, idx, subsample_size, num_data)
            for layer, u in zip(self.hidden, us[:-1], strict=True):
                f = out[f"{layer.name}.f"] = layer.sample_f(h, u, guide=True)
                h = layer.as_next_inputs(f)
            if self.marginalize_last or last.integrate_f:
                last.strategy.factors(h, consume=False)  # factors for the model's q(f) / p(f | u)
            else:
                out[f"{last.name}.f"] = last.sample_f(h, us[-1], guide=True)
                with self._outputs_ctx(), masked(self._targets(yb)[1]):  # masked where y is missing, as in the model
                    self.likelihood.guide(lambda: last.qf(h), prefix=last.name)
        return out

    # -- Salimbeni's estimator ------------------------------------------------------------------------------------
    def propagate(self, X: torch.Tensor, num_samples: int | None = None):
        """Propagate ``S`` samples through the hidden layers' marginals (reparameterised, Salimbeni eq. 7) and return
        ``(hidden, loc, var)``: the hidden samples ``[S, B, D_l]`` per layer, and the last layer's marginals at the
        last sample, ``[S, B]`` (one output) or ``[S, L, B]`` (``L`` outputs or classes, laid out like ``f``)."""
        S = num_samples or self.num_samples
        h, hidden = X, []
        for i, layer in enumerate(self.hidden):
            h = layer.propagate_marginal(h, S if i == 0 else None)
            hidden.append(h.squeeze(-3))
        loc, var = qf_points(self.last, h)
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
        if y is None:
            raise ValueError("the bound needs the observations: pass y (analytic_elbo(X, y))")
        X, y = self.check_inputs(X, y)
        _, loc, var = self.propagate(X, num_samples)
        S = loc.shape[0]
        yt, mask = self._targets(y)
        ell = masked_sum(self.likelihood.expected_log_prob(yt, loc, var), mask) / S
        kl = sum(layer.kl_divergence(consume=True).sum() for layer in self._stack)
        self.clear_cache()
        return (num_data or X.shape[-2]) / X.shape[-2] * ell - kl
