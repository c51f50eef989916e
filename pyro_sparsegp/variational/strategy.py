r"""The SVGP variational strategy: how a layer's ``q(u)`` and the prior of its inducing variables become ``p(f | u)``,
the marginals of ``q(f)`` and the KL term (Hensman, Fusi, Lawrence 2013; Hensman, Matthews, Ghahramani 2015).

A :class:`Strategy` computes; it owns no parameter. It reads the layer's ``kernel``, ``inducing``, ``q_u``,
``whiten``, ``jitter`` and ``num_outputs`` when it runs (so a module swapped on the layer is never stale), and keeps
the factors of one ELBO evaluation in its :class:`~pyro_sparsegp.variational.cache.FactorCache`. Layers
(:mod:`pyro_sparsegp.layers`) hold a strategy and add the Pyro sites, plates, the mean function and prediction on
top; :class:`~pyro_sparsegp.variational.orthogonal.OrthogonalStrategy` (SOLVE-GP) is the same interface over two
sets of inducing variables. Covariances come from :mod:`pyro_sparsegp.covariances` (dispatched on the pair
(inducing variables, kernel)).

Shapes: ``X`` ``[..., B, D]`` laid out against ``f`` (a 2-D ``X`` of a layer with ``L`` outputs gets a singleton
at dim -3: :meth:`Strategy.align`); ``u`` ``[..., M]`` or ``[..., L, 1, M]``; marginals ``[..., B]`` or
``[..., L, B]``; ``Kuu``/``Luu`` ``[(L,) M, M]``; ``W = Luu^{-1} Kuf`` ``[..., (L|1,) M, B]``.
"""

from __future__ import annotations

import pyro.distributions as dist
import torch

from .. import conditionals as cond
from .. import covariances as cov
from ..context.composition import layer_method, values_key
from ..distributions.kl import ConditionalNormal
from ..linalg import KUU_ADVICE, cholesky, project_chol, whitened_marginals
from .cache import FactorCache, XKey

__all__ = ["Strategy", "Factors"]

in_layer = layer_method(owner="layer")  # a strategy's method runs in its layer's Pyro context (PyroSample values)


class Factors:
    """The factors of a layer at a set of inputs: ``Kuu`` ``[(L,) M, M]``, its Cholesky factor ``Luu``, ``Kuf``
    ``[..., (L|1,) M, B]``, ``kdiag`` (``diag Kff``, ``[..., (1,) B]``) and the projection ``W = Luu^{-1} Kuf``,
    formed on first use by :func:`~pyro_sparsegp.linalg.project_chol` (the marginals of ``q(f)`` do not need it:
    :func:`~pyro_sparsegp.linalg.whitened_marginals` forms it inside a fused function). Unpacks as
    ``(Luu, W, kdiag)``. These are the terms of ``p(f | u)`` (Hensman, Fusi, Lawrence 2013, eq. 2)."""

    __slots__ = ("Kuu", "Luu", "Kuf", "kdiag", "_W")

    def __init__(self, Kuu, Luu, Kuf, kdiag):
        self.Kuu, self.Luu, self.Kuf, self.kdiag, self._W = Kuu, Luu, Kuf, kdiag, None

    @property
    def W(self) -> torch.Tensor:
        """``Luu^{-1} Kuf`` ``[..., (L|1,) M, B]``, gradient straight to ``Kuu`` (:func:`project_chol`)."""
        if self._W is None:
            (self._W,) = project_chol(self.Kuu, self.Luu, self.Kuf)
        return self._W

    def __iter__(self):
        return iter((self.Luu, self.W, self.kdiag))


class Strategy:
    """``q(u) = N(m, S)`` over one set of inducing variables ``u`` (``M`` per output), prior ``N(0, Kuu)``
    (``N(0, I)`` on ``Luu^{-1} u`` when the layer whitens): the SVGP of Hensman, Fusi, Lawrence 2013, section 3 and
    Hensman, Matthews, Ghahramani 2015, section 4. ``m`` ``[(L,) M]``, ``S`` ``[(L,) M, M]``; the other shapes are
    in the module docstring. Its sample sites are named ``sites = ("u",)``."""

    sites = ("u",)

    def __init__(self, layer):
        self.layer = layer  # read at each call: kernel, inducing, q_u, whiten, jitter, num_outputs
        self.cache = FactorCache()
        self.cross_probe = None  # only the orthogonal strategy reads it (a joint natural-gradient step)

    # -- the layer's pieces, read when used -------------------------------------------------------------------------
    @property
    def whiten(self) -> bool:
        """The layer's ``whiten`` flag: when set, ``q`` and the prior ``N(0, I)`` are over ``Luu^{-1} u``. A bool,
        so shapes do not apply."""
        return self.layer.whiten

    @property
    def num_outputs(self):
        """The independent GPs it computes: the layer's ``L`` outputs (``f`` ``[..., L, B]``), or its ``Q`` latent GPs
        (``g`` ``[..., Q, B]``) when a linear mixing (:mod:`~pyro_sparsegp.variational.lmc`) makes the outputs of
        them; ``None`` for a single output (``f`` ``[..., B]``)."""
        return self.layer.num_latent_gps

    # -- the outputs from the GPs it computes: the identity here, f = W g under a linear mixing ------------------------
    def mix(self, loc: torch.Tensor, var: torch.Tensor):
        """Marginals of the outputs from those of the GPs, each ``[..., L, B]`` (or ``[..., B]``): independent outputs
        are the GPs themselves (Hensman, Matthews, Ghahramani 2015, eq. 19 per output)."""
        return loc, var

    def mix_sample(self, g: torch.Tensor) -> torch.Tensor:
        """The outputs' values from a sample ``g`` of the GPs, ``[..., L, B]``: ``g`` itself here."""
        return g

    def mix_cov(self, var: torch.Tensor) -> torch.Tensor:
        """The outputs' covariance at each point, ``[..., B, L, L]``, from the GPs' marginal variances ``var``
        ``[..., L, B]``: diagonal for independent outputs (Hensman, Matthews, Ghahramani 2015, eq. 19 per output)."""
        return torch.diag_embed(var.movedim(-2, -1))

    def key(self) -> tuple:
        """The parameter part of a cache key (storage, versions, sampled hyperparameters: ``values_key``). A
        tuple of identities and versions, not a tensor, so shapes do not apply."""
        return values_key(self.layer)

    def align(self, X: torch.Tensor) -> torch.Tensor:
        """Inputs laid out against ``f``: ``X [..., B, D]``'s batch dimensions broadcast like any Pyro batch, so X's
        dim -3 stands at f's dim -2, the outputs dimension of a layer with ``L`` outputs; a 2-D ``X`` gets that
        singleton here (``[1, B, D]``)."""
        if self.num_outputs is not None and X.dim() == 2:
            return X.unsqueeze(-3)
        return X

    def natgrad_families(self) -> list:
        """The full-covariance Gaussian families a natural-gradient step trains: ``[q_u]``."""
        return [self.layer.q_u]

    def clear(self) -> None:
        """Drop the cached factors (after a closed-form bound or a prediction). No tensors, so shapes do not
        apply."""
        self.cache.clear()

    # -- covariances, computed once per ELBO evaluation -------------------------------------------------------------
    @in_layer
    def kuu_chol(self, consume: bool, leave: bool = False):
        """``(Kuu, Luu)``, each ``[M, M]`` or ``[L, M, M]``; cached like :meth:`factors` (``leave``: see
        :meth:`~pyro_sparsegp.variational.cache.FactorCache.once`)."""
        layer = self.layer

        def compute():
            Kuu = cov.Kuu(layer.inducing, layer.kernel)
            return Kuu, cholesky(Kuu, layer.jitter, warn_singular=not layer.whiten and KUU_ADVICE,
                                 symmetrize=True)

        return self.cache.once(("luu", self.key()), consume, compute, reset=True, leave=leave)

    def luu(self, consume: bool) -> torch.Tensor:
        """``Luu = chol(Kuu)`` ``[(L,) M, M]`` (cached like :meth:`kuu_chol`)."""
        return self.kuu_chol(consume)[1]

    @in_layer
    def factors(self, X: torch.Tensor, consume: bool) -> Factors:
        """:class:`Factors` (``Kuu``, ``Luu``, ``Kuf``, ``kff_diag``, and ``W`` on first use) for inputs ``X``
        ``[..., B, D]``; it unpacks as ``(Luu, W, kff_diag)``.

        One-shot cache: the guide (``consume=False``) always computes them afresh and keeps them; the model
        (``consume=True``), which Pyro runs after the guide with the same parameters, takes them out if the key
        (inputs, parameter storage and versions, grad mode) matches, else computes its own. So each ELBO
        evaluation pays for one Cholesky and one solve, and nothing stale is ever read twice."""
        layer = self.layer

        def compute():
            Kuu, Luu = self.kuu_chol(consume)
            Xk = self.align(X)
            Kuf = cov.Kuf(layer.inducing, layer.kernel, Xk)  # [..., (L|1,) M, B]
            return Factors(Kuu, Luu, Kuf, cov.Kdiag(layer.kernel, Xk))  # kdiag [..., (1,) B]

        return self.cache.once(("stats", XKey(X), self.key()), consume, compute)

    # -- distributions ----------------------------------------------------------------------------------------------
    def _zeros(self, inducing):
        batch = () if self.num_outputs is None else (self.num_outputs, 1)
        return torch.zeros(batch + (inducing.num_inducing,), dtype=inducing.dtype, device=inducing.device)

    def _gaussian(self, zeros, L):
        """``N(0, I)`` (whitened) or ``N(0, L L^T)``, batch shape ``()`` or ``[L, 1]``."""
        if self.whiten:
            return dist.Normal(zeros, 1.0).to_event(1)
        if self.num_outputs is not None or L.dim() > 2:  # the data plate's singleton (and the outputs')
            L = L.unsqueeze(-3)
            L = L.expand(torch.broadcast_shapes(L.shape[:-2], zeros.shape[:-1]) + L.shape[-2:])
        return dist.MultivariateNormal(zeros, scale_tril=L)

    @in_layer
    def prior(self, Luu: torch.Tensor | None = None) -> dist.Distribution:
        """``p(u) = N(0, Kuu)`` (``N(0, I)`` when whitened), batch shape ``()`` or ``[L, 1]``."""
        if not self.whiten and Luu is None:
            Luu = self.luu(consume=False)
        return self._gaussian(self._zeros(self.layer.inducing), Luu)

    @in_layer
    def posterior(self) -> dist.MultivariateNormal:
        """``q(u)``, batch shape ``()`` or ``[L, 1]``."""
        return self.layer.q_u()

    def site_distributions(self, guide: bool) -> list:
        """The distributions of the sites :attr:`sites`, in order: ``q`` (guide) or the prior (model, which takes
        the factor that the guide left); batch shape ``()`` or ``[L, 1]``, event shape ``[M]``."""
        if guide:
            return [self.posterior()]
        return [self.prior(None if self.whiten else self.kuu_chol(consume=True, leave=True)[1])]

    # -- p(f | u) and q(f) ------------------------------------------------------------------------------------------
    def moments(self, X: torch.Tensor, u, consume: bool):
        """Mean and variance of ``p(f | u)`` at ``X`` without the mean function, each ``[..., B]`` or
        ``[..., L, B]`` (Hensman, Fusi, Lawrence 2013, eq. 2): :meth:`latent_moments` through :meth:`mix`."""
        return self.mix(*self.latent_moments(X, u, consume))

    def latent_moments(self, X: torch.Tensor, u, consume: bool):
        """Mean and variance of the conditional of the GPs it computes given ``u`` at ``X``, each ``[..., B]`` or
        ``[..., L|Q, B]`` (Hensman, Fusi, Lawrence 2013, eq. 2)."""
        Luu, W, kdiag = self.factors(X, consume)
        loc = cond.conditional_loc(u, W, None if self.whiten else Luu)
        return loc, cond.conditional_var(kdiag, W).expand_as(loc)

    def conditional(self, X: torch.Tensor, u, consume: bool, mean) -> ConditionalNormal:
        """``p(f | u)`` at ``X`` as a Normal of batch shape ``[..., B]`` or ``[..., L, B]``, ``mean(X)`` (the
        layer's mean function, laid out like ``f``) added; under a linear mixing, the latent GPs' ``p(g | u)``
        ``[..., Q, B]`` (the site's distribution, before the mixing). The guide builds it and keeps it; the model,
        which Pyro replays with the guide's ``u``, takes the same object: the two sites cost one evaluation."""
        us = u if isinstance(u, tuple) else (u,)

        def compute():
            loc, var = self.latent_moments(X, u, consume)
            return ConditionalNormal(loc + mean(X), var.sqrt())

        key = ("cond", XKey(X), tuple((id(t), t._version) for t in us), self.key())
        return self.cache.once(key, consume, compute)

    def qf(self, X: torch.Tensor, consume: bool = False):
        """Marginals of ``q(f)`` at ``X`` without the mean function (Hensman 2015 eq. 19, diagonal): ``(loc,
        var)``, each ``[..., B]`` or ``[..., L, B]``: :meth:`latent_qf` through :meth:`mix`."""
        return self.mix(*self.latent_qf(X, consume))

    def latent_qf(self, X: torch.Tensor, consume: bool = False):
        """Marginals of the ``q`` of the GPs it computes at ``X`` (Hensman 2015 eq. 19, diagonal): ``(loc, var)``,
        each ``[..., B]`` or ``[..., L|Q, B]``."""
        st = self.factors(X, consume)
        q = self.layer.q_u
        m, C = cond.whitened_q(q.u_loc, q.u_scale_tril, None if self.whiten else st.Luu)
        loc, dvar = whitened_marginals(st.Kuf, m, C, st.Kuu, st.Luu)  # W = Luu^{-1} Kuf formed inside
        return loc, cond.clamp_var(st.kdiag + dvar)

    def kl(self, consume: bool = False) -> torch.Tensor:
        """KL[q(u) || p(u)] (registered closed forms), batch shape ``()`` or ``[L, 1]``. ``consume=True`` reuses the
        Cholesky factor that the last :meth:`qf` computed (one factorisation for the whole closed-form bound)."""
        prior = self.prior(None if self.whiten else self.luu(consume))
        return torch.distributions.kl_divergence(self.posterior(), prior)

    @in_layer
    def predictive_terms(self):
        r"""The constants of ``q(f*)`` for a program without the library (:mod:`pyro_sparsegp.deploy`):
        ``(inducing, Lj, m, C)``: the inducing variables (a list; their ``Z`` ``[(L,) M_i, D]`` stacked along ``M``),
        the lower factor ``Lj`` ``[(L,) M, M]`` of their prior covariance (this strategy's jitter), ``q`` in the
        whitened ``Lj^{-1} u``: ``m`` ``[(L,) M]``, scale ``C`` ``[(L,) M, M]``. With ``w = Lj^{-1} k(Z, x)`` the
        marginal is ``N(w^T m, k(x, x) - |w|^2 + |C^T w|^2)`` (Hensman, Matthews, Ghahramani 2015, eq. 19)."""
        _, Luu = self.kuu_chol(consume=False)
        self.clear()
        m, C = cond.whitened_q(self.layer.q_u.u_loc, self.layer.q_u.u_scale_tril, None if self.whiten else Luu)
        return [self.layer.inducing], Luu, m, C

    def full_terms(self, X: torch.Tensor):
        """``([(W, m, S^{1/2}, L or None)], [W])``: each set of inducing variables' projection ``[(L|1,) M, N]``,
        mean, scale and (un-whitened) prior factor, and the projections whose Gram matrices the prior covariance
        loses (the full covariance of ``q(f*)``, Hensman, Matthews, Ghahramani 2015, eq. 19)."""
        Luu, W, _ = self.factors(X, consume=False)
        q = self.layer.q_u
        return [(W, q.u_loc, q.u_scale_tril, None if self.whiten else Luu)], [W]
