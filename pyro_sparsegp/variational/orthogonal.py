r"""The orthogonal strategy of SOLVE-GP (Shi, Titsias, Mnih 2020), with ODVGP (Salimbeni et al. 2018) as the
restriction :math:`S_v = C_{vv}`.

The prior splits as :math:`f = K_{fu}K_{uu}^{-1}u + f_\perp` with :math:`u = f(Z)` (the base strategy's inducing
variables) and the orthogonal process :math:`f_\perp` summarised by :math:`v_\perp = f_\perp(O)`;
:math:`q(u)q(v_\perp)p_\perp(f_\perp \mid v_\perp)` gives the bound eq. 8. The computation follows algorithm 1 of
appendix D: Choleskys of ``Kuu`` ``[M, M]`` and :math:`C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}` ``[M2, M2]``
only, never of the ``(M + M2)``-square joint matrix. Whitening follows appendix F: ``u = L_u u'``,
``v⊥ = L_c v'`` with ``L_c = chol(Cvv)``. The layer holds ``orthogonal`` (``O``) and ``q_v`` beside ``inducing``
and ``q_u``; sites ``<name>.u`` and ``<name>.v``.

Shapes: ``Luu`` ``[(L,) M, M]``, ``Lc`` ``[(L,) M2, M2]``, ``A = Luu^{-1} Kuv`` ``[(L,) M, M2]``,
``B = Luu^{-1} Kuf`` ``[..., (L|1,) M, B]``, ``D = Lc^{-1}(Kvf - A^T B)`` ``[..., (L|1,) M2, B]``.
"""

from __future__ import annotations

import torch

from .. import conditionals as cond
from .. import covariances as cov
from ..linalg import KUU_ADVICE, cholesky, gram, project_chol, solve_lower
from .cache import XKey
from .strategy import Strategy, in_layer

__all__ = ["OrthogonalStrategy", "CVV_ADVICE"]

#: The advice of IllConditionedWarning for Cvv = Kvv - Kvu Kuu^{-1} Kuv of an un-whitened SOLVE-GP layer.
CVV_ADVICE = (
    "This is Cvv = Kvv - Kvu Kuu^-1 Kuv, the prior covariance of the orthogonal inducing variables, whose inverse the "
    "un-whitened bound uses: orthogonal inducing inputs O that (nearly) duplicate each other or lie on top of the "
    "inducing inputs Z make it singular. Use whiten=True (the default), or spread O away from Z and from each other."
)


class OrthogonalStrategy(Strategy):
    """``q(u) q(v⊥)`` over the layer's ``inducing`` (``u``, base strategy) and ``orthogonal`` (``v⊥``) variables
    (SOLVE-GP, Shi, Titsias, Mnih 2020, section 3). ``u`` ``[..., M]`` and ``v⊥`` ``[..., M2]`` (``[..., L, 1, M]``,
    ``[..., L, 1, M2]`` for ``L`` outputs); the factors' shapes are in the module docstring.
    ``odvgp=True``: ``q(v⊥)`` has the prior's covariance (``S_v = C_vv``; only ``m_v`` is learnt), section 3.3."""

    sites = ("u", "v")

    def __init__(self, layer, odvgp: bool = False):
        super().__init__(layer)
        self.odvgp = odvgp

    def natgrad_families(self) -> list:
        """``[q_u, q_v]`` (``[q_u]`` for ODVGP, whose ``q(v⊥)`` has no covariance of its own)."""
        q_v = self.layer.q_v
        return [self.layer.q_u] + ([q_v] if q_v.learn_scale else [])

    # -- covariances (algorithm 1, lines 1-2 and 3-4) -------------------------------------------------------------
    def joint_factors(self, Xk=None):
        """Algorithm 1 of appendix D, lines 1-4 (and the projections of the inputs ``Xk``, if given):
        ``Luu = chol(Kuu)``, ``A = Luu^{-1} Kuv`` ``[M, M2]``, ``Lc = chol(Kvv - A^T A)``, and with inputs
        ``B = Luu^{-1} Kuf``, ``D = Lc^{-1} (Kvf - A^T B)``. ``A`` and ``B`` are one :func:`project_chol` call, so
        the backward pass solves against ``Luu`` once for both; ``A^T A`` is a :func:`gram`. Returns
        ``(Luu, Lc, A)`` or ``(Luu, Lc, A, B, D)``."""
        layer = self.layer
        k, u, v = layer.kernel, layer.inducing, layer.orthogonal
        Kuu = cov.Kuu(u, k)
        Luu = cholesky(Kuu, layer.jitter, warn_singular=not layer.whiten and KUU_ADVICE,
                       symmetrize=True)  # [(L,) M, M]
        Kuv = cov.Kuu(u, k, v)
        if Xk is None:
            (A,) = project_chol(Kuu, Luu, Kuv)
        else:
            A, B = project_chol(Kuu, Luu, Kuv, cov.Kuf(u, k, Xk))  # [(L,) M, M2], [..., (L,) M, B]
        Cvv = cov.Kuu(v, k) - gram(A)
        # [(L,) M2, M2]; the factorisation reads the lower triangle only
        Lc = cholesky(Cvv, layer.jitter, warn_singular=not layer.whiten and CVV_ADVICE, symmetrize=True)
        if Xk is None:
            return Luu, Lc, A
        (D,) = project_chol(Cvv, Lc, cov.Kuf(v, k, Xk) - A.mT @ B)  # [..., (L,) M2, B]
        return Luu, Lc, A, B, D

    @in_layer
    def joint_chol(self, consume: bool):
        """``(Luu, Lc, A)`` (:meth:`joint_factors`), ``[(L,) M, M]``, ``[(L,) M2, M2]``, ``[(L,) M, M2]``; cached
        like :meth:`factors`, which also leaves them."""
        return self.cache.once(("chol2", self.key()), consume, self.joint_factors, reset=True)

    def luu(self, consume: bool) -> torch.Tensor:
        return self.joint_chol(consume)[0]

    @in_layer
    def factors(self, X, consume):
        """``(Luu, Lc, B, D, kff_diag)`` with ``B = Luu^{-1} Kuf``, ``D = Lc^{-1}(Kvf - A^T B)`` (algorithm 1) at
        ``X`` ``[..., B, D]``: shapes as in the module docstring, ``kff_diag`` ``[..., (1,) B]``."""
        key = ("stats", XKey(X), self.key())
        if consume and key in self.cache:
            return self.cache.entries.pop(key)
        Xk = self.align(X)
        Luu, Lc, A, B, D = self.joint_factors(Xk)
        stats = (Luu, Lc, B, D, cov.Kdiag(self.layer.kernel, Xk))  # kdiag [..., (1,) B]
        if not consume:  # the factors are left for the model's priors / the KL (one factorisation per evaluation)
            self.cache.put({("chol2", self.key()): (Luu, Lc, A), key: stats})
        return stats

    # -- distributions ------------------------------------------------------------------------------------------------
    @in_layer
    def prior_v(self, Lc=None):
        """``p(v⊥) = N(0, Cvv)`` (``N(0, I)`` whitened), batch shape ``()`` or ``[L, 1]``."""
        if not self.whiten and Lc is None:
            Lc = self.joint_chol(consume=False)[1]
        return self._gaussian(self._zeros(self.layer.orthogonal), Lc)

    def v_scale(self, Lc):
        """Scale of q(v⊥) ``[(L,) M2, M2]``: learnt, or (ODVGP) the prior's: ``I`` whitened, ``Lc`` plain."""
        q_v = self.layer.q_v
        if q_v.learn_scale:
            return q_v.u_scale_tril
        if self.whiten:
            o = self.layer.orthogonal
            return torch.eye(o.num_inducing, dtype=o.dtype, device=o.device)
        return Lc

    @in_layer
    def posterior_v(self, Lc=None):
        """``q(v⊥)``, batch shape ``()`` or ``[L, 1]``."""
        q_v = self.layer.q_v
        if q_v.learn_scale:
            return q_v()
        if Lc is None and not self.whiten:
            Lc = self.joint_chol(consume=False)[1]
        return q_v(self.v_scale(Lc))

    def site_distributions(self, guide: bool) -> list:
        """``[q(u), q(v⊥)]`` (guide) or ``[p(u), p⊥(v⊥)]`` (model, taking the guide's factors)."""
        if guide:
            Lc = None if (self.whiten or self.layer.q_v.learn_scale) else self.joint_chol(consume=False)[1]
            return [self.posterior(), self.posterior_v(Lc)]
        if self.whiten:
            return [self.prior(), self.prior_v()]
        Luu, Lc, _ = self.joint_chol(consume=True)
        return [self.prior(Luu), self.prior_v(Lc)]

    # -- p(f | u, v⊥) and q(f) ----------------------------------------------------------------------------------------
    def perp_moments(self, stats, v):
        """Mean and variance of ``p⊥(f⊥ | v⊥)`` (the variance is also that of ``p(f | u, v⊥)``), each ``[..., B]``
        or ``[..., L, B]``, from ``stats`` (:meth:`factors`) and ``v`` ``[..., M2]`` or ``[..., L, 1, M2]``."""
        Luu, Lc, B, D, kdiag = stats
        loc = cond.conditional_loc(v, D, None if self.whiten else Lc)
        return loc, cond.clamp_var(kdiag - B.pow(2).sum(-2) - D.pow(2).sum(-2)).expand_as(loc)

    def latent_moments(self, X, uv, consume):
        """Mean (no mean function) and variance of ``p(f | u, v⊥)`` at ``X`` ``[..., B, D]``, each ``[..., B]`` or
        ``[..., L, B]``: ``Kfu Kuu⁻¹ u`` plus :meth:`perp_moments` (eqs. 4-5); ``uv = (u, v)``."""
        u, v = uv
        stats = self.factors(X, consume)
        loc_perp, var = self.perp_moments(stats, v)
        loc = cond.conditional_loc(u, stats[2], None if self.whiten else stats[0]) + loc_perp
        return loc, var.expand_as(loc)

    def project(self, X, u, consume=True):
        """``Kfu Kuu⁻¹ u`` at ``X`` (no mean function), ``[..., B]`` or ``[..., L, B]`` (eq. 4)."""
        Luu, Lc, B, D, kdiag = self.factors(X, consume)
        return cond.conditional_loc(u, B, None if self.whiten else Luu)

    def orthogonal_conditional(self, X, v, consume=False):
        """``p⊥(f⊥ | v⊥)`` at ``X`` (marginals), batch shape ``[..., B]`` or ``[..., L, B]``, built by the guide and
        taken by the model."""
        from ..distributions.kl import ConditionalNormal

        def compute():
            loc, var = self.perp_moments(self.factors(X, consume), v)
            return ConditionalNormal(loc, var.sqrt())

        return self.cache.once(("perp", XKey(X), id(v), v._version, self.key()), consume, compute)

    def latent_qf(self, X, consume=False):
        """Marginals of q(f) at ``X`` (no mean function): eqs. 37-38 (diagonal), i.e. algorithm 1 lines 5-7.
        ``(loc, var)``, each ``[..., B]`` (``[..., L, B]`` for ``L`` outputs)."""
        Luu, Lc, B, D, kdiag = self.factors(X, consume)
        q_u, q_v = self.layer.q_u, self.layer.q_v
        lu, vu = cond.qf_terms(B, q_u.u_loc, q_u.u_scale_tril, None if self.whiten else Luu)
        lv, vv = cond.qf_terms(D, q_v.u_loc, self.v_scale(Lc), None if self.whiten else Lc)
        var = kdiag + vu + vv
        if self.cross_probe is not None:
            var = var + self.cross_var(B, D, Luu, Lc)
        return lu + lv, cond.clamp_var(var)

    def cross_var(self, B, D, Luu, Lc):
        r"""``2 a_n^T C d_n`` for the probe ``C = self.cross_probe`` ``[(L,) M, M2]`` (zero): the variance that a
        cross-covariance ``C = Cov_q(u, v⊥)`` would add to the marginals of q(f), with ``a_n``, ``d_n`` the
        projections of ``f_n`` on ``u`` and ``v⊥`` (whitened ``B``, ``D``; plain ``Luu^{-T} B``, ``Lc^{-T} D``).
        Its value is zero; its gradient ``d loss / dC`` is the cross block of the Hessian of the loss in the means
        ``(m_u, m_v)`` (Price's theorem: ``dE/dvar_n = E[d^2 log p / df^2] / 2``), which
        :func:`~pyro_sparsegp.infer.natgrad.solvegp_joint_natgrad_from_grads_` needs for the joint mean step.
        ``[..., (L,) B]``."""
        C = self.cross_probe
        if not self.whiten:
            C = solve_lower(Lc, solve_lower(Luu, C).mT).mT  # Luu^{-1} C Lc^{-T}
        return 2.0 * (B * (C @ D)).sum(-2)

    @in_layer
    def predictive_terms(self):
        r"""``(inducing, Lj, m, C)`` as :meth:`Strategy.predictive_terms`, over ``[Z; O]``: algorithm 1's factors
        make the joint lower factor ``Lj = [[Luu, 0], [A^T, Lc]]`` ``[(L,) M + M2, M + M2]`` (``A = Luu^{-1} Kuv``,
        ``Lc = chol(Cvv)``), so ``w = Lj^{-1} k([Z; O], x)`` stacks the projections ``B`` and ``D`` of eqs. 37-38,
        and ``q`` is ``N([m_u; m_v], blockdiag(C_u, C_v))`` in those coordinates (Shi, Titsias, Mnih 2020, section
        3.3 and appendix D)."""
        Luu, Lc, A = self.joint_factors()
        q_u, q_v = self.layer.q_u, self.layer.q_v
        mu, Cu = cond.whitened_q(q_u.u_loc, q_u.u_scale_tril, None if self.whiten else Luu)
        mv, Cv = cond.whitened_q(q_v.u_loc, self.v_scale(Lc), None if self.whiten else Lc)
        M, M2 = Luu.shape[-1], Lc.shape[-1]
        batch = torch.broadcast_shapes(Luu.shape[:-2], Lc.shape[:-2], Cu.shape[:-2], Cv.shape[:-2])
        Lj = Luu.new_zeros(batch + (M + M2, M + M2))
        C = Lj.clone()
        Lj[..., :M, :M], Lj[..., M:, :M], Lj[..., M:, M:] = Luu, A.mT, Lc
        C[..., :M, :M], C[..., M:, M:] = Cu, Cv
        return [self.layer.inducing, self.layer.orthogonal], Lj, torch.cat([mu, mv], -1), C

    def full_terms(self, X):
        Luu, Lc, B, D, _ = self.factors(X, consume=False)
        q_u, q_v = self.layer.q_u, self.layer.q_v
        terms = [
            (B, q_u.u_loc, q_u.u_scale_tril, None if self.whiten else Luu),
            (D, q_v.u_loc, self.v_scale(Lc), None if self.whiten else Lc),
        ]
        return terms, [B, D]

    def kl(self, consume: bool = False):
        """KL[q(u) || p(u)] + KL[q(v⊥) || p(v⊥)] (eqs. 35-36); ``consume=True`` reuses the factors of the last
        :meth:`qf`. Shape ``()`` for a single output, ``[L, 1]`` (one term per output) for ``L`` outputs."""
        kl = torch.distributions.kl_divergence
        Luu = Lc = None
        if not self.whiten:
            Luu, Lc, _ = self.joint_chol(consume)
        return kl(self.posterior(), self.prior(Luu)) + kl(self.posterior_v(Lc), self.prior_v(Lc))
