r"""High-level PyroModules. :class:`SVGP` wraps the site contract of ``DESIGN.md``:

=================  ======================================  ==========================================
site               model                                   guide
=================  ======================================  ==========================================
``<name>.u``       ``N(0, Kuu)`` (``N(0, I)`` whitened)    ``q(u) = N(u_loc, u_scale_tril u_scale_tril^T)``
``<name>.f``       ``p(f | u)``                            the same ``p(f | u)``
``y``              ``likelihood.distribution(f)``          —
=================  ======================================  ==========================================

Because the guide samples ``f`` from the same conditional as the model, ``log p(f|u) - log q(f|u)`` cancels and
``Trace_ELBO`` is an unbiased estimate of Hensman, Matthews, Ghahramani (2015) eq. 21 (Hensman 2013 L3 for a
Gaussian likelihood); ``TraceMeanField_ELBO`` makes the KL analytic.
"""

from __future__ import annotations

import pyro
import torch
from pyro.nn import PyroModule

from .. import covariances as cov
from ..checks.program import record_layer
from ..context.composition import draw_hyperparameters, layer_method, sampled_attributes
from ..context.naming import KeepsOwnName, claim_name, unique_name
from ..likelihoods import Likelihood
from ..linalg import KUU_ADVICE, cholesky
from ..variational import GaussianQ, LMCStrategy, Strategy
from ..variational.cache import take
from .base import LayerData, as_inputs, layer_arguments
from .outputs import Outputs, as_kernel, masked_sum, mixing_matrix, targets
from .prediction import Prediction

__all__ = ["SVGP"]


class SVGP(Outputs, LayerData, Prediction, KeepsOwnName, PyroModule):
    r"""Sparse variational GP (Hensman, Fusi, Lawrence 2013; Hensman, Matthews, Ghahramani 2015).

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel` (its hyperparameters are trained), shared by the
        outputs (latent GPs); or a list of kernels, one per output (``L``) or per latent GP (``Q``), which becomes a
        :class:`~pyro_sparsegp.kernels.Separate` kernel.
    :param Z: initial inducing inputs ``[M, D]`` (shared) or ``[L, M, D]`` (one set per output), or any
        :class:`~pyro_sparsegp.inducing.InducingVariables` (e.g. inducing patches of a convolutional kernel); read
        back as ``gp.Z`` (the tensor) and ``gp.inducing`` (the module).
    :param likelihood: a :class:`~pyro_sparsegp.likelihoods.Likelihood`, or ``None`` for a hidden layer.
    :param int num_outputs: ``L`` independent outputs (``None``: a single output, or, for a likelihood of ``K``
        latent functions such as :class:`~pyro_sparsegp.RobustMax` ``(K)``, ``K``: it is inferred).
    :param bool whiten: put the prior ``N(0, I)`` on ``v = Luu^{-1} u`` instead of ``N(0, Kuu)`` on ``u``.
    :param str name: prefix of the sample sites (and, under Pyro's global parameter store, of the parameters).
        ``None`` (default): ``"gp"``, or ``"gp_2"``, ``"gp_3"``, ... while a module of that name is alive, so that
        two modules never share parameters (:mod:`pyro_sparsegp.context.naming`).
    :param bool integrate_f: observe ``y`` from :class:`MarginalizedLikelihood` (``f`` integrated out given ``u``;
        same bound, lower variance) instead of sampling the ``<name>.f`` site. The default (``None``) integrates for
        likelihoods that are piecewise constant in ``f``, such as robust-max, whose sampled ``f`` site carries no
        gradient (``False`` warns for them), and samples ``f`` otherwise.
    :param mean_function: a :class:`~pyro_sparsegp.mean_functions.MeanFunction` ``m`` (default: zero): the layer
        models ``f = m(X) + g`` with ``g ~ GP(0, k)`` and ``u = g(Z)``, so ``m(X)`` ``[..., B, L]`` is added, per
        output, to the mean of ``p(f | u)`` and of ``q(f)`` (Salimbeni & Deisenroth 2017, section 3).
    :param int num_latents: ``Q``: the ``L = num_outputs`` outputs are ``f = W g`` of ``Q`` independent latent GPs
        ``g`` (the linear model of coregionalisation, Álvarez, Rosasco, Lawrence 2012, section 4.2; an element-wise
        likelihood), with ``q(u)`` over the latents' inducing values (``Z`` ``[M, D]`` or ``[Q, M, D]``) and the
        sites of :mod:`~pyro_sparsegp.layers.outputs`. ``None`` (default): independent outputs.
    :param W: the initial mixing ``W`` ``[L, Q]``, trained as the ``PyroParam`` ``gp.W`` (default: entries drawn
        ``N(0, 1/Q)``); only with ``num_latents``.

    The computation lives in ``gp.strategy`` (:class:`~pyro_sparsegp.variational.Strategy`; SOLVE-GP's
    :class:`~pyro_sparsegp.variational.OrthogonalStrategy`); the layer adds the sites, plates, mean function and
    prediction. Shapes (``B`` points, ``L`` outputs):

    ==================  ====================  =====================================
    method              input                 output
    ==================  ====================  =====================================
    ``model/guide``     ``X [N, D]``, y       ``f [B]`` or ``f [L, B]``
    ``sample_f``        ``X [..., B, D]``     ``f [..., B]`` or ``[..., L, B]``
    ``predict``         ``X [..., N, D]``     ``(mean, var)`` each ``[..., N]`` or ``[..., N, L]``
    ==================  ====================  =====================================

    ``y`` is ``[N]`` for one output, ``[N, L]`` for ``L`` outputs of an element-wise likelihood (``NaN`` where an
    output is missing: masked out of the bound) and ``[N]`` for a likelihood of ``L`` latent functions
    (``likelihood.latent_dim == L``, e.g. robust-max).
    """
    _saving_aliases = {"Z": "inducing"}  # constructor arguments kept elsewhere: read by saving.describe

    def __init__(self, kernel, Z: torch.Tensor, likelihood: Likelihood | None = None, num_outputs: int | None = None,
                 whiten: bool = True, name: str | None = None, integrate_f: bool | None = None,
                 jitter: float | None = None, mean_function=None, num_latents: int | None = None, W=None):
        name = unique_name("gp") if name is None else name
        super().__init__(name=name)  # parameters are "<name>.inducing.Z", "<name>.q_u.u_loc", ... in Pyro's store
        kernel = as_kernel(kernel)
        inducing, num_outputs, integrate_f = layer_arguments(kernel, Z, likelihood, num_outputs, integrate_f, jitter,
                                                             mean_function, num_latents)
        claim_name(self, name)
        self.kernel, self.inducing, self.likelihood, self.mean_function = kernel, inducing, likelihood, mean_function
        self.num_outputs, self.whiten, self.name, self.integrate_f, self.jitter = (num_outputs, whiten, name,
                                                                                  integrate_f, jitter)
        self.num_latents = num_latents
        scale_tril = None
        if not whiten and not sampled_attributes(kernel, names=False):  # start at q(u) = p(u) (unless theta is sampled)
            with torch.no_grad():
                # the bound's advice
                scale_tril = cholesky(cov.Kuu(inducing, kernel), jitter, warn_singular=KUU_ADVICE, symmetrize=True)
        self.q_u = GaussianQ(inducing.num_inducing, self.num_latent_gps, scale_tril)
        self.W = mixing_matrix(W, num_outputs, num_latents, inducing)  # None without num_latents
        self.strategy = (Strategy if num_latents is None else LMCStrategy)(self)

    @property
    def Z(self) -> torch.Tensor:
        """The inducing inputs (or inducing patches) ``[M, d]`` or ``[L, M, d]``: ``self.inducing.Z``."""
        return self.inducing.Z

    @Z.setter
    def Z(self, value):
        self.inducing.Z = value

    @Z.deleter
    def Z(self):
        del self.inducing.Z

    # -- distributions (the strategy's, in the layer's Pyro context) --------------------------------------------
    @layer_method
    def prior(self, Luu: torch.Tensor | None = None):
        """``p(u) = N(0, Kuu)`` (``N(0, I)`` when whitened), batch shape ``()`` or ``[L, 1]``."""
        return self.strategy.prior(Luu)

    @layer_method
    def posterior(self):
        """``q(u)``, batch shape ``()`` or ``[L, 1]``."""
        return self.strategy.posterior()

    @layer_method
    def conditional(self, X: torch.Tensor, u: torch.Tensor, consume: bool = False):
        """``p(f | u)`` at inputs ``X`` ``[..., B, D]``: a Normal with batch shape ``[..., B]`` or ``[..., L, B]``
        (the mean function added); for an LMC layer the latent GPs' ``p(g | u)`` ``[..., Q, B]``. The guide builds
        it and keeps it; the model, which Pyro replays with the guide's ``u``, takes the same object, so the two
        sites cost one evaluation."""
        return self.strategy.conditional(X, u, consume, self._site_mean)

    @layer_method
    def moments(self, X: torch.Tensor, u, consume: bool = False):
        """Mean (mean function included) and variance of ``p(f | u)`` at ``X`` ``[..., B, D]``, each ``[..., B]`` or
        ``[..., L, B]``; ``consume`` as in :meth:`~pyro_sparsegp.variational.Strategy.factors`."""
        loc, var = self.strategy.moments(X, u, consume)
        return loc + self._mean(X), var

    @layer_method
    def qf(self, X: torch.Tensor, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Marginals of ``q(f)`` at ``X`` ``[..., B, D]`` (Hensman 2015 eq. 19, diagonal): ``(mean, var)``, each
        ``[..., B]`` for a single output or ``[..., L, B]`` for ``L`` outputs (the mean function added to the mean)."""
        loc, var = self.strategy.qf(X, consume)
        return loc + self._mean(X), var

    def kl_divergence(self, consume: bool = False) -> torch.Tensor:
        """KL of the inducing variables (the strategy's), batch shape ``()`` or ``[L, 1]``. ``consume=True`` reuses
        the Cholesky factor that the last :meth:`qf` computed (one factorisation for the whole closed-form bound)."""
        return self.strategy.kl(consume)

    # -- sites --------------------------------------------------------------------------------------------------
    @layer_method(guide_arg="guide")
    def sample_u(self, guide: bool = False):
        """Sample site ``<name>.u`` (and each further site of the strategy, e.g. SOLVE-GP's ``<name>.v``) from the
        prior (model) or ``q`` (guide). Call outside the data plate. Returns ``u`` ``[..., M]`` (single output) or
        ``[..., L, 1, M]`` (one row per output: the outputs plate is at ``dim=-2`` of the batch shape, so a singleton
        precedes the event dimension ``M``), or the tuple of the strategy's sites; with ``whiten=True`` the site is
        the whitened ``v`` with prior ``N(0, I)``. An LMC layer's ``u`` is ``[..., Q, 1, M]``, in its latents plate.
        The inducing variables of Hensman, Fusi, Lawrence 2013 (section 3.1, with :math:`q(u) = N(m, S)`)."""
        draw_hyperparameters(self)  # PyroSample hyperparameters are sites here, outside the data plate
        record_layer(self, guide)  # the trace under construction, for a check at an optimiser's first step
        with self._latents_plate(new=True):
            dists = self.strategy.site_distributions(guide)
            out = tuple(pyro.sample(f"{self.name}.{s}", d) for s, d in zip(self.strategy.sites, dists, strict=True))
        return out[0] if len(out) == 1 else out

    @layer_method
    def sample_f(self, X: torch.Tensor, u, guide: bool = False) -> torch.Tensor:
        """Sample site ``<name>.f`` from ``p(f | u)`` at ``X`` ``[..., B, D]`` and return ``f`` ``[..., (L,) B]``.
        Call inside the data plate. An LMC layer's site holds the latents ``g`` ``[..., Q, B]`` (in its latents
        plate) and the return is ``f = W g + m(X)`` (Álvarez, Rosasco, Lawrence 2012, section 4.2)."""
        return self._sample_site(X, u, guide)[1]

    def sample_hidden(self, X: torch.Tensor, u, guide: bool = False) -> torch.Tensor:
        """:meth:`sample_f`, laid out as the next layer's inputs: ``f [..., L, B]`` becomes ``[..., 1, B, L]``
        (``[B, L]`` when ``f`` is ``[L, B]``; a single output ``[..., B]`` becomes ``[..., B, 1]``): the outputs move
        to the feature dimension and their plate dimension stays as a singleton, so particle and plate dimensions
        keep their places (see :func:`~pyro_sparsegp.layers.base.as_inputs`). Call inside the data plate."""
        return as_inputs(self.sample_f(X, u, guide=guide), self.num_outputs)

    @layer_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """Generative model. ``subsample_size``: the plate draws a minibatch of ``X``; ``num_data``: ``X`` already
        is a minibatch of a data set of that size (the likelihood is scaled by ``num_data / len(X)``).
        ``X`` ``[..., N, D]``; ``y`` ``[..., N]`` (single output) or ``[..., N, L]``; returns ``f`` ``[..., B]`` or
        ``[..., L, B]`` (the moments ``(loc, var)`` when ``integrate_f``). With :meth:`guide`, ``Trace_ELBO``
        estimates the bound of Hensman, Matthews, Ghahramani 2015, eq. 21."""
        X, y = self.check_inputs(X, y, subsample_size, num_data)
        u = self.sample_u()
        with self._data_plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            Xb = X if num_data is not None or subsample_size is None else take(X, idx)
            yb = y if y is None or num_data is not None or subsample_size is None else y[idx]
            f = self.moments(Xb, u, consume=True) if self.integrate_f else self.sample_f(Xb, u)
            self._observe(f, yb)
        return f

    @layer_method
    def guide(self, X, y=None, *, subsample_size=None, num_data=None):
        """Variational distribution: ``q(u) p(f | u)``. Returns the drawn latent values by site name (a dict, as
        Pyro's autoguides do, so that it can be a part of ``AutoGuideList``). ``X`` ``[..., N, D]``, ``y`` as in
        :meth:`model`; ``u`` ``[..., M]`` or ``[..., L, 1, M]``, ``f`` ``[..., B]`` or ``[..., L, B]`` (Hensman,
        Matthews, Ghahramani 2015, eqs. 18 and 21: :math:`q(f) = \\int p(f|u) q(u) du`)."""
        X, y = self.check_inputs(X, y, subsample_size, num_data)
        u = self.sample_u(guide=True)
        out = dict(zip((f"{self.name}.{s}" for s in self.strategy.sites), u if isinstance(u, tuple) else (u,),
                       strict=True))
        with self._data_plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            Xb = X if num_data is not None or subsample_size is None else take(X, idx)
            if self.integrate_f:
                self.strategy.factors(Xb, consume=False)
            else:
                out[f"{self.name}.f"] = self._sample_site(Xb, u, True)[0]
            self._observe_guide(Xb, y if y is None or num_data is not None or subsample_size is None else y[idx])
        return out

    @layer_method
    def analytic_elbo(self, X, y, num_data: int | None = None) -> torch.Tensor:
        """The bound in closed form on a minibatch, without sampling (Hensman 2015 eq. 21; for
        :class:`~pyro_sparsegp.PolyaGammaLogit` the augmented bound of Wenzel et al. 2019 at the optimal ``c``):
        ``num_data / B * sum_n E_q[log p(y_n | f_n)] - KL[q || p]``, an unbiased estimate of the full-data bound.
        Missing outputs (``NaN`` in ``y``) drop out of the sum. This is what ``fit(..., elbo="analytic")``
        maximises."""
        X, y = self.check_inputs(X, y, purpose="elbo")
        loc, var = self.qf(X)  # factorises once and keeps the factors for the KL
        kl = self.kl_divergence(consume=True)
        self.strategy.clear()
        yt, mask = targets(y, self._per_output())  # [L, B] and the observed entries' mask, or y [B]
        scale = (num_data or X.shape[-2]) / X.shape[-2]
        return scale * masked_sum(self.likelihood.expected_log_prob(yt, loc, var), mask) - kl.sum()
