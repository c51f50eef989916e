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
import torch

from .. import covariances as cov
from .. import inducing as ind
from ..checks.inputs import as_tensor
from ..checks.validation import check_orthogonal_inputs
from ..context.composition import layer_method, sampled_attributes
from ..variational import GaussianQ, OrthogonalLMCStrategy, OrthogonalStrategy
from ..variational.structured import structured_svgp_params
from .svgp import SVGP

__all__ = ["SOLVEGP", "OrthogonalInputs"]


class OrthogonalInputs:
    """``O``, the orthogonal inducing inputs (or patches) ``[(L,) M2, d]`` of a layer with an ``orthogonal``
    inducing variable (SOLVE-GP, ODVGP): ``self.orthogonal.Z`` under the papers' name (Shi, Titsias, Mnih 2020,
    section 3.3)."""
    # constructor arguments kept under another attribute (dotted path): read by saving.describe
    _saving_aliases = {"O": "orthogonal"}

    @property
    def O(self) -> torch.Tensor:  # noqa: E743 (the paper's name)
        """The orthogonal inducing inputs ``[(L,) M2, d]`` (``self.orthogonal.Z``); settable and deletable."""
        return self.orthogonal.Z

    @O.setter
    def O(self, value):  # noqa: E743
        self.orthogonal.Z = value

    @O.deleter
    def O(self):  # noqa: E743
        del self.orthogonal.Z


class SOLVEGP(OrthogonalInputs, SVGP):
    r"""SVGP with ``M`` inducing points ``Z`` plus ``M2`` orthogonal inducing points ``O``: an
    :class:`~pyro_sparsegp.SVGP` whose strategy is an :class:`~pyro_sparsegp.variational.OrthogonalStrategy`.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`, or a list of kernels (one per output or latent GP).
    :param torch.Tensor Z: ``[M, D]`` or ``[L, M, D]``.
    :param O: ``[M2, D]`` or ``[L, M2, D]`` (same sharing as ``Z``), or inducing variables of the same kind as ``Z``
        (e.g. :class:`~pyro_sparsegp.inducing.InducingPatches`: both sets are patches); ``[Q, M2, D]`` per latent GP
        with ``num_latents=Q`` (an LMC over SOLVE-GP latents, each with its ``q(u_q) q(v⊥_q)``).
    :param bool odvgp: restrict ``q(v⊥)`` to the prior covariance (``S_v = C_vv``; only ``m_v`` is learnt):
        the orthogonally decoupled method of Salimbeni et al. (2018), a special case (section 3.3 of the paper).

    The other arguments, the sites' methods, ``predict`` (eqs. 37-38) and the shapes are those of
    :class:`~pyro_sparsegp.SVGP`; ``sample_u`` returns the pair ``(u, v)``.
    """

    def __init__(self, kernel, Z, O, likelihood=None, num_outputs=None, whiten=True, name=None, integrate_f=None,
                 jitter=None, odvgp=False, mean_function=None, num_latents=None, W=None):
        super().__init__(kernel, Z, likelihood, num_outputs, whiten, name, integrate_f, jitter, mean_function,
                         num_latents, W)
        if not isinstance(O, ind.InducingVariables):
            O = as_tensor(O, "O")  # numpy, lists, pandas (checked below as a tensor O is)
        if torch.is_tensor(O) and isinstance(self.inducing, ind.InducingPoints):
            check_orthogonal_inputs(O, self.Z)
        orthogonal = ind.as_inducing(O)  # O: a tensor (inducing points) or inducing variables like Z's
        self.inducing.check_like(orthogonal)
        cov.check(orthogonal, self.kernel)
        self.orthogonal = orthogonal
        self.odvgp = odvgp
        self.strategy = (OrthogonalStrategy if num_latents is None else OrthogonalLMCStrategy)(self, odvgp)
        scale_tril = None
        if not whiten and not odvgp and not sampled_attributes(self.kernel, names=False):  # start at q(v⊥) = p(v⊥)
            with torch.no_grad():
                scale_tril = self.strategy.joint_factors()[1]  # not cached: the module may still be nested
        self.q_v = GaussianQ(orthogonal.num_inducing, self.num_latent_gps, scale_tril, learn_scale=not odvgp)

    @layer_method
    def prior_v(self, Lc=None):
        """``p(v⊥) = N(0, Cvv)`` (``N(0, I)`` whitened), batch shape ``()`` or ``[L, 1]``."""
        return self.strategy.prior_v(Lc)

    @layer_method
    def posterior_v(self, Lc=None):
        """``q(v⊥)``, batch shape ``()`` or ``[L, 1]``."""
        return self.strategy.posterior_v(Lc)

    @layer_method
    def project(self, X, u, consume=True):
        """``Kfu Kuu⁻¹ u`` at ``X`` ``[..., B, D]`` (plus the mean function ``m(X)``, if any): the part of ``f`` in
        the span of the inducing points (eq. 4), ``[..., B]`` or ``[..., L, B]``; ``u`` as returned by
        :meth:`sample_u` (whitened: ``Luu⁻¹ u``). Called in the model, it takes the factors that the guide's
        :meth:`sample_f_perp` left for these inputs (one factorisation per ELBO evaluation), and computes them
        otherwise."""
        return self.strategy.project(X, u, consume) + self._mean(X)

    @layer_method
    def orthogonal_conditional(self, X, v, consume=False):
        """``p⊥(f⊥ | v⊥)`` at ``X``: marginals ``N(Cfv Cvv⁻¹ v⊥, k_nn - Q_nn - [Cfv Cvv⁻¹ Cvf]_nn)`` (the likelihood
        factorises, so marginals are all the bound needs), batch shape ``[..., B]`` or ``[..., L, B]``. Built by the
        guide and taken by the model, like :meth:`conditional`."""
        return self.strategy.orthogonal_conditional(X, v, consume)

    @layer_method
    def sample_f_perp(self, X, v, guide: bool = False):
        """Sample site ``<name>.f_perp ~ p⊥(f⊥ | v⊥)`` at ``X`` ``[..., B, D]``; call inside the data plate, in model
        and guide. ``v`` is ``v⊥`` ``[..., M2]`` (``[..., L, 1, M2]`` for ``L`` outputs); returns ``f⊥`` ``[..., B]``
        (``[..., L, B]``). The factor :math:`p_\\perp(f_\\perp | v_\\perp)` of the variational distribution
        :math:`q(u) q(v_\\perp) p_\\perp(f_\\perp | v_\\perp)` of Shi, Titsias, Mnih 2020, section 3.3 (it cancels in
        the bound, eq. 8)."""
        with self._outputs_plate():
            return pyro.sample(f"{self.name}.f_perp", self.orthogonal_conditional(X, v, consume=not guide))

    @torch.no_grad()
    def to_svgp(self, name: str | None = None) -> SVGP:
        r"""The :class:`~pyro_sparsegp.SVGP` over the union of the inducing sets, ``Z' = [Z; O]`` ``[(L,) M + M2,
        d]``, whose ``q(u, v)`` is this layer's ``q(u) q(v⊥)`` seen through :math:`v = v_\perp + K_{vu}K_{uu}^{-1}u`
        (Shi, Titsias, Mnih 2020, section 3.3, "Structured Covariance"): the same ``q(f)``, the same KL, hence the
        same bound (eq. 8), with the SOLVE-GP restriction on the covariance lifted for further training.

        Whitened, the map is the identity: ``chol(K_{Z'Z'}) = [[Luu, 0], [A^T, Lc]]`` with ``A = Luu^{-1} Kuv`` and
        ``Lc = chol(Cvv)`` (algorithm 1's factors), so ``q(u')`` is ``N([m_u; m_v], blockdiag(L_u, L_v))``
        (``L_v = I`` for ODVGP). Un-whitened it is
        :func:`~pyro_sparsegp.variational.structured.structured_svgp_params`. The two agree up to the jitter of the
        factorisations (the SVGP factorises ``K_{Z'Z'}`` with its own). Kernel, likelihood and mean function are
        copied (the new layer shares no parameter with this one); its name is ``name``, by default this layer's with
        ``_svgp`` appended (two live modules of one name would share Pyro's parameter store entries).

        ``ValueError`` for ``PyroSample`` hyperparameters (fix them first: the map depends on their values)."""
        import copy

        if sampled_attributes(self, names=False):
            raise ValueError("to_svgp: the layer has PyroSample hyperparameters; the map depends on their values, so "
                             "set them to fixed values (PyroParam or tensors) before converting")
        if isinstance(self.inducing, ind.InducingSum):
            raise ValueError("to_svgp: not available for an InducingSum (the union orders the inducing variables by "
                             "part, which breaks the block-triangular Cholesky factor the map relies on)")
        twin = copy.deepcopy(self)
        # the copy shares one Pyro context, marked used: a kernel with parts of its own (Separate, Pyro's Sum) could
        # not join the new layer under it (Pyro asserts an unused context), so the copy starts unused
        twin.kernel._pyro_context.used = False
        u, v = twin.inducing, twin.orthogonal
        union = copy.deepcopy(u)
        union.Z = torch.cat([u.Z, v.Z], -2)
        if hasattr(u, "locations"):  # inducing patches with locations (TICK)
            union.locations = torch.cat([u.locations, v.locations], -2)
        gp = SVGP(twin.kernel, union, twin.likelihood, twin.num_outputs, twin.whiten, name or f"{self.name}_svgp",
                  twin.integrate_f, twin.jitter, twin.mean_function, twin.num_latents, twin.W)
        Lc = twin.strategy.joint_factors()[1]  # chol(Cvv): ODVGP's plain scale of q(v⊥)
        m_u, L_u = twin.q_u.u_loc, twin.q_u.u_scale_tril
        m_v, L_v = twin.q_v.u_loc, twin.strategy.v_scale(Lc)
        if twin.whiten:
            M, M2 = m_u.shape[-1], m_v.shape[-1]
            batch = torch.broadcast_shapes(L_u.shape[:-2], L_v.shape[:-2])
            L = torch.zeros(batch + (M + M2, M + M2), dtype=m_u.dtype, device=m_u.device)
            L[..., :M, :M] = L_u
            L[..., M:, M:] = L_v
            m = torch.cat([m_u, m_v], -1)
        else:
            Kuu, Kuv = cov.Kuu(u, twin.kernel), cov.Kuu(u, twin.kernel, v)
            m, L = structured_svgp_params(Kuu, Kuv, m_u, L_u, m_v, L_v, return_scale_tril=True, jitter=twin.jitter)
        gp.q_u.set(m, L.expand(gp.q_u.u_scale_tril.shape))
        return gp
