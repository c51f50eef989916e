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

with :math:`C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}`. ``Trace_ELBO`` then estimates eq. 8 of the paper. The
computation follows algorithm 1 of appendix D: Choleskys of ``Kuu`` ``[M, M]`` and ``Cvv`` ``[M2, M2]`` only, never
of the ``(M + M2)``-square joint matrix. Whitening follows appendix F: ``u = L_u u'``, ``v⊥ = L_c v'`` with
``L_c = chol(Cvv)``.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroParam, pyro_method
from torch.distributions import constraints

from . import conditionals as cond
from .kernels import kernel_diag, kernel_matrix
from .layers import SVGP, _check_finite, _xkey
from .linalg import cholesky, solve_lower
from .variational import GaussianQ

__all__ = ["SOLVEGP"]


class SOLVEGP(SVGP):
    r"""SVGP with ``M`` inducing points ``Z`` plus ``M2`` orthogonal inducing points ``O``.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`.
    :param torch.Tensor Z: ``[M, D]`` or ``[L, M, D]``.
    :param torch.Tensor O: ``[M2, D]`` or ``[L, M2, D]`` (same sharing as ``Z``).
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
        name="gp",
        integrate_f=False,
        jitter=None,
        odvgp=False,
    ):
        super().__init__(kernel, Z, likelihood, num_outputs, whiten, name, integrate_f, jitter)
        if O.dim() != Z.dim() or O.shape[-1] != Z.shape[-1] or O.shape[:-2] != Z.shape[:-2]:
            raise ValueError(f"O must be shaped like Z ([..., M2, D] with D = {Z.shape[-1]}); got {tuple(O.shape)}")
        _check_finite("O", O)
        self.O = PyroParam(O.clone(), constraints.real)
        self.odvgp = odvgp
        M2 = O.shape[-2]
        scale_tril = None
        if not whiten and not odvgp:  # start at the prior q(v⊥) = p(v⊥)
            with torch.no_grad():
                scale_tril = self._joint_chol(consume=False)[1]
        self.q_v = GaussianQ(M2, num_outputs, scale_tril, learn_scale=not odvgp)

    # -- covariances (algorithm 1, lines 1-2 and 3-4) -----------------------------------------------------------
    @pyro_method
    def _joint_chol(self, consume: bool):
        """``(Luu, Lc, A)``: ``Luu = chol(Kuu)``, ``A = Luu^{-1} Kuv`` ``[M, M2]``, ``Lc = chol(Kvv - A^T A)``."""
        key = ("chol2", self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        Luu = cholesky(kernel_matrix(self.kernel, self.Z), self.jitter)  # [(L,) M, M]
        A = solve_lower(Luu, kernel_matrix(self.kernel, self.Z, self.O))  # [(L,) M, M2]
        Cvv = kernel_matrix(self.kernel, self.O) - A.mT @ A
        Lc = cholesky(0.5 * (Cvv + Cvv.mT), self.jitter)  # [(L,) M2, M2]
        out = (Luu, Lc, A)
        if not consume:
            self._cache = {key: out}
        return out

    def _luu(self, consume: bool):
        return self._joint_chol(consume)[0]

    @pyro_method
    def _stats(self, X, consume):
        """``(Luu, Lc, B, D, kff_diag)`` with ``B = Luu^{-1} Kuf``, ``D = Lc^{-1}(Kvf - A^T B)`` (algorithm 1)."""
        key = ("stats", _xkey(X), self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        Luu, Lc, A = self._joint_chol(consume)
        Xk = X if self.Z.dim() == 2 else X.unsqueeze(-3)
        B = solve_lower(Luu, kernel_matrix(self.kernel, self.Z, Xk))  # [..., (L,) M, B]
        Cvf = kernel_matrix(self.kernel, self.O, Xk) - A.mT @ B  # [..., (L,) M2, B]
        D = solve_lower(Lc, Cvf)
        kdiag = kernel_diag(self.kernel, X)  # [..., B]
        if self.num_outputs is not None and self.Z.dim() == 2:
            B, D = B.unsqueeze(-3), D.unsqueeze(-3)
        if self.num_outputs is not None:
            kdiag = kdiag.unsqueeze(-2)
        stats = (Luu, Lc, B, D, kdiag)
        if not consume:
            self._cache[key] = stats
        return stats

    # -- distributions ------------------------------------------------------------------------------------------
    @pyro_method
    def prior_v(self, Lc=None):
        """``p(v⊥) = N(0, Cvv)`` (``N(0, I)`` whitened), batch shape ``()`` or ``[L, 1]``."""
        M2 = self.O.shape[-2]
        batch = () if self.num_outputs is None else (self.num_outputs, 1)
        zeros = torch.zeros(batch + (M2,), dtype=self.O.dtype, device=self.O.device)
        if self.whiten:
            return dist.Normal(zeros, 1.0).to_event(1)
        if Lc is None:
            Lc = self._joint_chol(consume=False)[1]
        if self.num_outputs is not None:
            Lc = Lc.unsqueeze(-3).expand(batch + (M2, M2))
        return dist.MultivariateNormal(zeros, scale_tril=Lc)

    def _v_scale(self, Lc):
        """Scale of q(v⊥): learnt, or (ODVGP) the prior's: ``I`` whitened, ``Lc`` plain."""
        if self.q_v.learn_scale:
            return self.q_v.u_scale_tril
        if self.whiten:
            return torch.eye(self.O.shape[-2], dtype=self.O.dtype, device=self.O.device)
        return Lc

    @pyro_method
    def posterior_v(self, Lc=None):
        """``q(v⊥)``, batch shape ``()`` or ``[L, 1]``."""
        if self.q_v.learn_scale:
            return self.q_v()
        if Lc is None and not self.whiten:
            Lc = self._joint_chol(consume=False)[1]
        return self.q_v(self._v_scale(Lc))

    def _moments(self, X, uv, consume):
        u, v = uv
        Luu, Lc, B, D, kdiag = self._stats(X, consume)
        loc = cond.conditional_loc(u, B, None if self.whiten else Luu) + cond.conditional_loc(
            v, D, None if self.whiten else Lc
        )
        var = cond.clamp_var(kdiag - B.pow(2).sum(-2) - D.pow(2).sum(-2))
        return loc, var.expand_as(loc)

    @pyro_method
    def qf(self, X, consume=False):
        """Marginals of q(f) at ``X``: eqs. 37-38 (diagonal), i.e. algorithm 1 lines 5-7."""
        Luu, Lc, B, D, kdiag = self._stats(X, consume)
        lu, vu = cond.qf_terms(B, self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else Luu)
        lv, vv = cond.qf_terms(D, self.q_v.u_loc, self._v_scale(Lc), None if self.whiten else Lc)
        return lu + lv, cond.clamp_var(kdiag + vu + vv)

    def kl_divergence(self):
        """KL[q(u) || p(u)] + KL[q(v⊥) || p(v⊥)] (eqs. 35-36)."""
        kl = torch.distributions.kl_divergence
        Lc = None if self.whiten else self._joint_chol(consume=False)[1]
        return kl(self.posterior(), self.prior()) + kl(self.posterior_v(Lc), self.prior_v(Lc))

    # -- sites --------------------------------------------------------------------------------------------------
    @pyro_method
    def sample_u(self, guide: bool = False):
        """Sample sites ``<name>.u`` and ``<name>.v`` from the priors (model) or ``q`` (guide); returns ``(u, v)``."""
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
