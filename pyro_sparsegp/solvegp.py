r"""SOLVE-GP: sparse orthogonal variational inference (Shi, Titsias, Mnih 2020), with ODVGP (Salimbeni et al. 2018)
as the restriction :math:`S_v = C_{vv}`.

The prior is decomposed as :math:`f = K_{fu}K_{uu}^{-1}u + f_\perp` with :math:`u = f(Z)` and the orthogonal process
:math:`f_\perp` summarised by :math:`v_\perp = f_\perp(O)`:

=================  ================================================  =========================================
site               model                                             guide
=================  ================================================  =========================================
``<name>.u``       ``N(0, Kuu)`` (``N(0, I)`` whitened)               ``q(u) = N(m_u, S_u)``
``<name>.v``       ``p(v⊥) = N(0, Cvv)`` (``N(0, I)`` whitened)        ``q(v⊥) = N(m_v, S_v)`` (ODVGP: ``S_v = Cvv``)
``<name>.f``       ``p(f | u, v⊥)``                                   the same conditional
=================  ================================================  =========================================

or, with the decomposition written out (section 3.2, eqs. 4-5): ``f = Kfu Kuu⁻¹ u + f⊥`` with the site
``<name>.f_perp ~ p⊥(f⊥ | v⊥)`` in model and guide (:meth:`SOLVEGP.project`, :meth:`SOLVEGP.sample_f_perp`)::

    def model(X, y):
        u, v = gp.sample_u()                                   # gp.u ~ p(u), gp.v ~ p⊥(v⊥) = N(0, Cvv)
        with pyro.plate("data", len(X)):
            f = gp.project(X, u) + gp.sample_f_perp(X, v)      # Kfu Kuu⁻¹ u + f⊥,  gp.f_perp ~ p⊥(f⊥ | v⊥)
            pyro.sample("y", dist.Normal(f, 0.1), obs=y)

    def guide(X, y):
        u, v = gp.sample_u(guide=True)                         # q(u) q(v⊥)
        with pyro.plate("data", len(X)):
            gp.sample_f_perp(X, v, guide=True)                 # the same p⊥(f⊥ | v⊥): it cancels

with :math:`C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}`. ``Trace_ELBO`` then estimates eq. 8 of the paper. The
computation follows algorithm 1 of appendix D: Choleskys of ``Kuu`` ``[M, M]`` and ``Cvv`` ``[M2, M2]`` only, never
of the ``(M + M2)``-square joint matrix. Whitening follows appendix F: ``u = L_u u'``, ``v⊥ = L_c v'`` with
``L_c = chol(Cvv)``.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from . import conditionals as cond
from . import inducing as ind
from .composition import draw_hyperparameters, layer_method, sampled_attributes
from .distributions.kl import ConditionalNormal
from .layers import SVGP, _XKey
from .linalg import KUU_ADVICE, cholesky, gram, project_chol, solve_lower
from .validation import check_orthogonal_inputs
from .variational import GaussianQ

__all__ = ["SOLVEGP"]

#: The advice of IllConditionedWarning for Cvv = Kvv - Kvu Kuu^{-1} Kuv of an un-whitened SOLVE-GP layer.
CVV_ADVICE = (
    "This is Cvv = Kvv - Kvu Kuu^-1 Kuv, the prior covariance of the orthogonal inducing variables, whose inverse the "
    "un-whitened bound uses: orthogonal inducing inputs O that (nearly) duplicate each other or lie on top of the "
    "inducing inputs Z make it singular. Use whiten=True (the default), or spread O away from Z and from each other."
)


class OrthogonalInputs:
    """``O``, the orthogonal inducing inputs (or patches) ``[(L,) M2, d]`` of a layer with an ``orthogonal``
    inducing variable (SOLVE-GP, ODVGP): ``self.orthogonal.Z`` under the papers' name."""

    @property
    def O(self) -> torch.Tensor:  # noqa: E743 (the paper's name)
        return self.orthogonal.Z

    @O.setter
    def O(self, value):  # noqa: E743
        self.orthogonal.Z = value

    @O.deleter
    def O(self):  # noqa: E743
        del self.orthogonal.Z


class SOLVEGP(OrthogonalInputs, SVGP):
    r"""SVGP with ``M`` inducing points ``Z`` plus ``M2`` orthogonal inducing points ``O``.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`.
    :param torch.Tensor Z: ``[M, D]`` or ``[L, M, D]``.
    :param O: ``[M2, D]`` or ``[L, M2, D]`` (same sharing as ``Z``), or inducing variables of the same kind as ``Z``
        (e.g. :class:`~pyro_sparsegp.inducing.InducingPatches`: both sets are patches).
    :param bool odvgp: restrict ``q(v⊥)`` to the prior covariance (``S_v = C_vv``; only ``m_v`` is learnt):
        the orthogonally decoupled method of Salimbeni et al. (2018), a special case (section 3.3 of the paper).

    The other arguments, the sites' methods, ``predict`` (eqs. 37-38) and the shapes are those of
    :class:`~pyro_sparsegp.SVGP`; ``sample_u`` returns the pair ``(u, v)``.
    """

    def __init__(
        self,
        kernel,
        Z,
        O,
        likelihood=None,
        num_outputs=None,
        whiten=True,
        name=None,
        integrate_f=None,
        jitter=None,
        odvgp=False,
        mean_function=None,
    ):
        super().__init__(kernel, Z, likelihood, num_outputs, whiten, name, integrate_f, jitter, mean_function)
        if torch.is_tensor(O) and isinstance(self.inducing, ind.InducingPoints):
            check_orthogonal_inputs(O, self.Z)
        orthogonal = ind.as_inducing(O)  # O: a tensor (inducing points) or inducing variables like Z's
        self.inducing.check_like(orthogonal)
        orthogonal.check(kernel)
        self.orthogonal = orthogonal
        self.odvgp = odvgp
        M2 = orthogonal.num_inducing
        scale_tril = None
        if not whiten and not odvgp and not sampled_attributes(kernel, names=False):  # start at the prior q(v⊥) = p(v⊥)
            with torch.no_grad():
                scale_tril = self._factors()[1]  # not the layer method: the module may still be nested
        self.q_v = GaussianQ(M2, num_outputs, scale_tril, learn_scale=not odvgp)
        self._cross_probe = None  # set by the joint natural-gradient step (see _cross_var)

    @torch.no_grad()
    def to_svgp(self, name: str | None = None) -> SVGP:
        r"""The :class:`~pyro_sparsegp.SVGP` over the union of the inducing sets, ``Z' = [Z; O]`` ``[(L,) M + M2,
        d]``, whose ``q(u, v)`` is this layer's ``q(u) q(v⊥)`` seen through :math:`v = v_\perp + K_{vu}K_{uu}^{-1}u`
        (Shi, Titsias, Mnih 2020, section 3.3, "Structured Covariance"): the same ``q(f)``, the same KL, hence the
        same bound (eq. 8), with the SOLVE-GP restriction on the covariance lifted for further training.

        Whitened, the map is the identity: ``chol(K_{Z'Z'}) = [[Luu, 0], [A^T, Lc]]`` with ``A = Luu^{-1} Kuv`` and
        ``Lc = chol(Cvv)`` (algorithm 1's factors), so ``q(u')`` is ``N([m_u; m_v], blockdiag(L_u, L_v))``
        (``L_v = I`` for ODVGP). Un-whitened it is
        :func:`~pyro_sparsegp.bounds.solvegp.structured_svgp_params`. The two agree up to the jitter of the
        factorisations (the SVGP factorises ``K_{Z'Z'}`` with its own). Kernel, likelihood and mean function are
        copied (the new layer shares no parameter with this one); its name is ``name``, by default this layer's with
        ``_svgp`` appended (two live modules of one name would share Pyro's parameter store entries).

        ``ValueError`` for ``PyroSample`` hyperparameters (fix them first: the map depends on their values)."""
        import copy

        from .structured import structured_svgp_params

        if sampled_attributes(self, names=False):
            raise ValueError("to_svgp: the layer has PyroSample hyperparameters; the map depends on their values, so "
                             "set them to fixed values (PyroParam or tensors) before converting")
        if isinstance(self.inducing, ind.InducingSum):
            raise ValueError("to_svgp: not available for an InducingSum (the union orders the inducing variables by "
                             "part, which breaks the block-triangular Cholesky factor the map relies on)")
        twin = copy.deepcopy(self)
        twin._cache = {}
        u, v = twin.inducing, twin.orthogonal
        union = copy.deepcopy(u)
        union.Z = torch.cat([u.Z, v.Z], -2)
        if hasattr(u, "locations"):  # inducing patches with locations (TICK)
            union.locations = torch.cat([u.locations, v.locations], -2)
        gp = SVGP(twin.kernel, union, twin.likelihood, twin.num_outputs, twin.whiten, name or f"{twin.name}_svgp",
                  twin.integrate_f, twin.jitter, twin.mean_function)
        Lc = twin._factors()[1]  # chol(Cvv): ODVGP's plain scale of q(v⊥)
        m_u, L_u = twin.q_u.u_loc, twin.q_u.u_scale_tril
        m_v, L_v = twin.q_v.u_loc, twin._v_scale(Lc)
        if twin.whiten:
            M, M2 = m_u.shape[-1], m_v.shape[-1]
            batch = torch.broadcast_shapes(L_u.shape[:-2], L_v.shape[:-2])
            L = torch.zeros(batch + (M + M2, M + M2), dtype=m_u.dtype, device=m_u.device)
            L[..., :M, :M] = L_u
            L[..., M:, M:] = L_v
            m = torch.cat([m_u, m_v], -1)
        else:
            Kuu, Kuv = ind.Kuu(u, twin.kernel), ind.Kuu(u, twin.kernel, v)
            m, L = structured_svgp_params(Kuu, Kuv, m_u, L_u, m_v, L_v, return_scale_tril=True, jitter=twin.jitter)
        gp.q_u.set(m, L.expand(gp.q_u.u_scale_tril.shape))
        return gp

    # -- covariances (algorithm 1, lines 1-2 and 3-4) -----------------------------------------------------------
    def _factors(self, Xk=None):
        """Algorithm 1 of appendix D, lines 1-4 (and the projections of the inputs ``Xk``, if given):
        ``Luu = chol(Kuu)``, ``A = Luu^{-1} Kuv`` ``[M, M2]``, ``Lc = chol(Kvv - A^T A)``, and with inputs
        ``B = Luu^{-1} Kuf``, ``D = Lc^{-1} (Kvf - A^T B)``. ``A`` and ``B`` are one :func:`project_chol` call, so
        the backward pass solves against ``Luu`` once for both; ``A^T A`` is a :func:`gram`."""
        k, u, v = self.kernel, self.inducing, self.orthogonal
        Kuu = ind.Kuu(u, k)
        Luu = cholesky(Kuu, self.jitter, warn_singular=not self.whiten and KUU_ADVICE)  # [(L,) M, M]
        Kuv = ind.Kuu(u, k, v)
        if Xk is None:
            (A,) = project_chol(Kuu, Luu, Kuv)
        else:
            A, B = project_chol(Kuu, Luu, Kuv, ind.Kuf(u, k, Xk))  # [(L,) M, M2], [..., (L,) M, B]
        Cvv = ind.Kuu(v, k) - gram(A)
        # [(L,) M2, M2]; the factorisation reads the lower triangle only
        Lc = cholesky(Cvv, self.jitter, warn_singular=not self.whiten and CVV_ADVICE)
        if Xk is None:
            return Luu, Lc, A
        (D,) = project_chol(Cvv, Lc, ind.Kuf(v, k, Xk) - A.mT @ B)  # [..., (L,) M2, B]
        return Luu, Lc, A, B, D

    @layer_method
    def _joint_chol(self, consume: bool):
        """``(Luu, Lc, A)`` (:meth:`_factors`); cached like :meth:`_stats`, which also leaves them for a consumer."""
        key = ("chol2", self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        out = self._factors()
        if not consume:
            self._cache = {key: out}
        return out

    def _luu(self, consume: bool):
        return self._joint_chol(consume)[0]

    @layer_method
    def _stats(self, X, consume):
        """``(Luu, Lc, B, D, kff_diag)`` with ``B = Luu^{-1} Kuf``, ``D = Lc^{-1}(Kvf - A^T B)`` (algorithm 1)."""
        key = ("stats", _XKey(X), self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        Xk = self._align(X)
        Luu, Lc, A, B, D = self._factors(Xk)
        kdiag = ind.Kff_diag(self.kernel, Xk)  # [..., (1,) B]
        stats = (Luu, Lc, B, D, kdiag)
        if not consume:  # the factors are left for the model's priors / the KL (one factorisation per evaluation)
            self._cache = {("chol2", self._param_key()): (Luu, Lc, A), key: stats}
        return stats

    # -- distributions ------------------------------------------------------------------------------------------
    @layer_method
    def prior_v(self, Lc=None):
        """``p(v⊥) = N(0, Cvv)`` (``N(0, I)`` whitened), batch shape ``()`` or ``[L, 1]``."""
        M2 = self.orthogonal.num_inducing
        batch = () if self.num_outputs is None else (self.num_outputs, 1)
        zeros = torch.zeros(batch + (M2,), dtype=self.orthogonal.dtype, device=self.orthogonal.device)
        if self.whiten:
            return dist.Normal(zeros, 1.0).to_event(1)
        if Lc is None:
            Lc = self._joint_chol(consume=False)[1]
        if self.num_outputs is not None or Lc.dim() > 2:  # the data plate's singleton (and the outputs')
            Lc = Lc.unsqueeze(-3)
            Lc = Lc.expand(torch.broadcast_shapes(Lc.shape[:-2], batch) + (M2, M2))
        return dist.MultivariateNormal(zeros, scale_tril=Lc)

    def _v_scale(self, Lc):
        """Scale of q(v⊥): learnt, or (ODVGP) the prior's: ``I`` whitened, ``Lc`` plain."""
        if self.q_v.learn_scale:
            return self.q_v.u_scale_tril
        if self.whiten:
            return torch.eye(self.orthogonal.num_inducing, dtype=self.orthogonal.dtype, device=self.orthogonal.device)
        return Lc

    @layer_method
    def posterior_v(self, Lc=None):
        """``q(v⊥)``, batch shape ``()`` or ``[L, 1]``."""
        if self.q_v.learn_scale:
            return self.q_v()
        if Lc is None and not self.whiten:
            Lc = self._joint_chol(consume=False)[1]
        return self.q_v(self._v_scale(Lc))

    def _perp_moments(self, stats, v):
        """Mean and variance of ``p⊥(f⊥ | v⊥)`` (the variance is also that of ``p(f | u, v⊥)``)."""
        Luu, Lc, B, D, kdiag = stats
        loc = cond.conditional_loc(v, D, None if self.whiten else Lc)
        return loc, cond.clamp_var(kdiag - B.pow(2).sum(-2) - D.pow(2).sum(-2)).expand_as(loc)

    def _moments(self, X, uv, consume):
        u, v = uv
        stats = self._stats(X, consume)
        loc_perp, var = self._perp_moments(stats, v)
        loc = cond.conditional_loc(u, stats[2], None if self.whiten else stats[0]) + loc_perp + self._mean(X)
        return loc, var.expand_as(loc)

    @layer_method
    def project(self, X, u, consume=True):
        """``Kfu Kuu⁻¹ u`` at ``X`` ``[..., B, D]`` (plus the mean function ``m(X)``, if any): the part of ``f`` in
        the span of the inducing points (eq. 4),
        ``[..., B]`` or ``[..., L, B]``; ``u`` as returned by :meth:`sample_u` (whitened: ``Luu⁻¹ u``). Called in the
        model, it takes the factors that the guide's :meth:`sample_f_perp` left for these inputs (one factorisation
        per ELBO evaluation), and computes them otherwise."""
        Luu, Lc, B, D, kdiag = self._stats(X, consume)
        return cond.conditional_loc(u, B, None if self.whiten else Luu) + self._mean(X)

    @layer_method
    def orthogonal_conditional(self, X, v, consume=False) -> ConditionalNormal:
        """``p⊥(f⊥ | v⊥)`` at ``X``: marginals ``N(Cfv Cvv⁻¹ v⊥, k_nn - Q_nn - [Cfv Cvv⁻¹ Cvf]_nn)`` (the likelihood
        factorises, so marginals are all the bound needs), batch shape ``[..., B]`` or ``[..., L, B]``. Built by the
        guide and taken by the model, like :meth:`conditional`."""
        key = ("perp", _XKey(X), id(v), v._version, self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        loc, var = self._perp_moments(self._stats(X, consume), v)
        fn = ConditionalNormal(loc, var.sqrt())
        if not consume:
            self._cache[key] = fn
        return fn

    @layer_method
    def sample_f_perp(self, X, v, guide: bool = False):
        """Sample site ``<name>.f_perp ~ p⊥(f⊥ | v⊥)`` at ``X`` ``[..., B, D]``; call inside the data plate, in model
        and guide. ``v`` is ``v⊥`` ``[..., M2]`` (``[..., L, 1, M2]`` for ``L`` outputs); returns ``f⊥`` ``[..., B]``
        (``[..., L, B]``). The factor :math:`p_\\perp(f_\\perp | v_\\perp)` of the variational distribution
        :math:`q(u) q(v_\\perp) p_\\perp(f_\\perp | v_\\perp)` of Shi, Titsias, Mnih 2020, section 3.3 (it cancels in
        the bound, eq. 8)."""
        with self._outputs_plate():
            return pyro.sample(f"{self.name}.f_perp", self.orthogonal_conditional(X, v, consume=not guide))

    @layer_method
    def qf(self, X, consume=False):
        """Marginals of q(f) at ``X`` ``[..., B, D]``: eqs. 37-38 (diagonal), i.e. algorithm 1 lines 5-7 (Shi, Titsias,
        Mnih 2020). Returns ``(loc, var)``, each ``[..., B]`` (``[..., L, B]`` for ``L`` outputs)."""
        Luu, Lc, B, D, kdiag = self._stats(X, consume)
        lu, vu = cond.qf_terms(B, self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else Luu)
        lv, vv = cond.qf_terms(D, self.q_v.u_loc, self._v_scale(Lc), None if self.whiten else Lc)
        var = kdiag + vu + vv
        if self._cross_probe is not None:
            var = var + self._cross_var(B, D, Luu, Lc)
        return lu + lv + self._mean(X), cond.clamp_var(var)

    def _cross_var(self, B, D, Luu, Lc):
        r"""``2 a_n^T C d_n`` for the probe ``C = self._cross_probe`` ``[(L,) M, M2]`` (zero): the variance that a
        cross-covariance ``C = Cov_q(u, v⊥)`` would add to the marginals of q(f), with ``a_n``, ``d_n`` the
        projections of ``f_n`` on ``u`` and ``v⊥`` (whitened ``B``, ``D``; plain ``Luu^{-T} B``, ``Lc^{-T} D``).
        Its value is zero; its gradient ``d loss / dC`` is the cross block of the Hessian of the loss in the means
        ``(m_u, m_v)`` (Price's theorem: ``dE/dvar_n = E[d^2 log p / df^2] / 2``), which
        :func:`~pyro_sparsegp.infer.natgrad.solvegp_joint_natgrad_from_grads_` needs for the joint mean step.
        ``[..., (L,) B]``."""
        C = self._cross_probe
        if not self.whiten:
            C = solve_lower(Lc, solve_lower(Luu, C).mT).mT  # Luu^{-1} C Lc^{-T}
        return 2.0 * (B * (C @ D)).sum(-2)

    def _full_terms(self, X):
        Luu, Lc, B, D, _ = self._stats(X, consume=False)
        terms = [
            (B, self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else Luu),
            (D, self.q_v.u_loc, self._v_scale(Lc), None if self.whiten else Lc),
        ]
        return terms, [B, D]

    def kl_divergence(self, consume: bool = False):
        """KL[q(u) || p(u)] + KL[q(v⊥) || p(v⊥)] (eqs. 35-36); ``consume=True`` reuses the factors of the last
        :meth:`qf`. Shape ``()`` for a single output, ``[L, 1]`` (one term per output) for ``L`` outputs."""
        kl = torch.distributions.kl_divergence
        Luu = Lc = None
        if not self.whiten:
            Luu, Lc, _ = self._joint_chol(consume)
        return kl(self.posterior(), self.prior(Luu)) + kl(self.posterior_v(Lc), self.prior_v(Lc))

    # -- sites --------------------------------------------------------------------------------------------------
    @layer_method(guide_arg="guide")
    def sample_u(self, guide: bool = False):
        """Sample sites ``<name>.u`` and ``<name>.v`` from the priors (model) or ``q`` (guide); returns ``(u, v)``,
        ``u`` ``[..., M]`` and ``v`` ``[..., M2]`` for a single output, ``[..., L, 1, M]`` and ``[..., L, 1, M2]`` for
        ``L`` outputs (whitened ``u'``, ``v'`` when ``whiten=True``, appendix F). The global factors
        :math:`q(u) q(v_\\perp)` / :math:`p(u) p_\\perp(v_\\perp)` of Shi, Titsias, Mnih 2020, eq. 8."""
        draw_hyperparameters(self)  # PyroSample hyperparameters are sites here, outside the data plate
        with self._outputs_plate(new=True):
            if guide:
                Lc = None if (self.whiten or self.q_v.learn_scale) else self._joint_chol(consume=False)[1]
                u = pyro.sample(f"{self.name}.u", self.posterior())
                v = pyro.sample(f"{self.name}.v", self.posterior_v(Lc))
                return u, v
            if self.whiten:
                return (pyro.sample(f"{self.name}.u", self.prior()), pyro.sample(f"{self.name}.v", self.prior_v()))
            Luu, Lc, _ = self._joint_chol(consume=True)
            return (pyro.sample(f"{self.name}.u", self.prior(Luu)), pyro.sample(f"{self.name}.v", self.prior_v(Lc)))
