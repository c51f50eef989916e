r"""ODVGP with many mean inducing points: the orthogonally decoupled variational GP of Salimbeni, Cheng, Boots,
Deisenroth (2018) as the special case :math:`S_v = C_{vv}` of SOLVE-GP (Shi, Titsias, Mnih 2020, sections 3.3 and 5),
trained at a cost linear in the number ``M2`` of orthogonal (mean) inducing points by subsampling the columns of
``Kvv`` (section 6.3: "1024 columns of Kvv are sampled to estimate the gradient" for ``M2 = 8096``).

Derivation (equation numbers of the arXiv version of Shi et al. 2020). With ``u = f(Z)`` (``M`` points) and
:math:`v_\perp = f_\perp(O)` (``M2`` points) the prior splits as :math:`f = K_{fu}K_{uu}^{-1}u + f_\perp` (eqs. 4-5),
and the variational family :math:`q(u)q(v_\perp)p_\perp(f_\perp|v_\perp)` gives the bound eq. 8,

.. math:: \sum_n \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)] - \mathrm{KL}[q(u)\|p(u)]
          - \mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)],

with :math:`q(u) = N(m_u, S_u)` and :math:`q_\perp(f_\perp) = N(C_{fv}C_{vv}^{-1}m_v, S_{f_\perp})`,
:math:`S_{f_\perp} = C_{ff} + C_{fv}C_{vv}^{-1}(S_v - C_{vv})C_{vv}^{-1}C_{vf}` (section 3.3). ODVGP restricts
:math:`S_v = C_{vv} = K_{vv} - K_{vu}K_{uu}^{-1}K_{uv}` (eq. 10; section 5, :math:`S'_{u,v}` with
:math:`\beta = Z`, :math:`\gamma = O`), and, as the paper says of its ODVGP runs (section 6.3: "a slightly different
parameterization to allow sub-sampling Kvv", no whitening of ``v``), the mean is parameterised through weights
``a`` ``[M2]`` on the mean basis (Salimbeni et al.'s :math:`a_\gamma`):

.. math:: m_v = C_{vv}\,a, \qquad q(v_\perp) = N(C_{vv}a,\ C_{vv}).

Then nothing needs :math:`C_{vv}^{-1}`:

* marginals of ``q(f)`` (eqs. 32-34, the diagonal of eqs. 37-38, at :math:`S_v = C_{vv}`, whose last term of the
  variance vanishes):

  .. math:: \mu_n = k_{nu}K_{uu}^{-1}m_u + c_{nv}a = k_{nu}K_{uu}^{-1}(m_u - K_{uv}a) + k_{nv}a,\qquad
            \sigma_n^2 = k_{nn} - k_{nu}K_{uu}^{-1}k_{un} + k_{nu}K_{uu}^{-1}S_uK_{uu}^{-1}k_{un},

  the SVGP variance (Hensman et al. 2015, eq. 19) and a mean that costs ``O(B M2)`` for ``K_fv a`` plus
  ``O(M M2)`` for ``K_uv a``;
* the KL of ``v`` (eq. 36 at :math:`S_v = C_{vv}`; the last term of eq. 10):

  .. math:: \mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)] = \tfrac12 m_v^TC_{vv}^{-1}m_v = \tfrac12 a^TC_{vv}a
            = \tfrac12\big(a^TK_{vv}a - \|L_{uu}^{-1}K_{uv}a\|^2\big),

  where only :math:`a^TK_{vv}a` is ``O(M2^2)`` (:math:`\|L_{uu}^{-1}K_{uv}a\|^2` is ``O(M M2 + M^2)``).

Column subsampling. With a set ``S`` of ``J`` of the ``M2`` columns drawn uniformly without replacement,

.. math:: \widehat{a^TK_{vv}a} = \frac{M_2}{J}\sum_{j\in S} a_j\,[K_{vv}a]_j = \frac{M_2}{J}\,a_S^TK_{S,:}\,a

is unbiased (each column is in ``S`` with probability ``J/M2``), with variance
:math:`M_2^2\,\frac{M_2 - J}{M_2 - 1}\,\frac{s_t^2}{J}`, :math:`s_t^2` the population variance of
:math:`t_j = a_j[K_{vv}a]_j`. ``S`` does not depend on the parameters, so the gradient of the estimate is an unbiased
estimate of the gradient; with minibatches of ``B`` points (data term scaled by ``N/B``) the whole bound and its
gradient are unbiased. A step costs ``O(B M2 + J M2 + M M2 + M^3 + B M^2)``: linear in ``M2``, no ``M2 x M2``
matrix, and no ``[B, M2]`` or ``[J, M2]`` one either: the three products ``K_fv a``, ``K_uv a`` and ``K_{S,:} a`` are
:func:`~pyro_sparsegp.kernels.kernel_matvec` calls (blocks of rows in cache, closed-form gradients). With
``J = M2`` the estimate is exact and the bound is that of ``SOLVEGP(..., odvgp=True)`` at ``q_v.u_loc = C_vv a``
(whitened: :math:`L_c^Ta`, :math:`L_c = \mathrm{chol}(C_{vv})`).
Prediction is exact (no subsampling: ``K_vv`` does not enter ``q(f*)``).
"""

from __future__ import annotations

import torch
from pyro.nn import PyroParam
from torch.distributions import constraints

from .. import conditionals as cond
from .. import covariances as cov
from .. import inducing as ind
from ..checks.inputs import as_tensor
from ..checks.validation import check_orthogonal_inputs
from ..context.composition import layer_method
from ..kernels.matvec import kernel_matvec
from ..linalg import whitened_marginals
from .solvegp import OrthogonalInputs
from .svgp import SVGP

__all__ = ["ODVGP"]

class ODVGP(OrthogonalInputs, SVGP):
    r"""ODVGP (Salimbeni et al. 2018) as SOLVE-GP with :math:`q(v_\perp) = N(C_{vv}a, C_{vv})` (module docstring),
    trained on a column-subsampled estimate of the bound (eq. 8 of Shi, Titsias, Mnih 2020), linear in ``M2``.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`.
    :param torch.Tensor Z: ``[M, D]`` inducing inputs of ``q(u) = N(m_u, S_u)`` (mean and covariance).
    :param torch.Tensor O: ``[M2, D]`` orthogonal inducing inputs of the mean (``M2 >> M`` is the point).
    :param likelihood: a :class:`~pyro_sparsegp.likelihoods.Likelihood` (any with ``expected_log_prob``).
    :param int num_subsample: ``J``, the columns of ``K_vv`` per evaluation of the bound (``None`` or ``>= M2``:
        all, exact).
    :param bool whiten: whiten ``q(u)`` (``u = L_uu u'``); the mean weights ``a`` are never whitened.

    Parameters: ``q_u.u_loc``, ``q_u.u_scale_tril`` (as :class:`~pyro_sparsegp.SVGP`) and ``a`` ``[M2]`` (zero at
    the start: ``q(v⊥) = p(v⊥)``, the SVGP bound). Single output, inducing points only. Train with
    :meth:`analytic_elbo` (``pyro_sparsegp.infer.fit(gp, X, y)`` does: its default ``elbo="analytic"``); the
    Pyro ``model``/``guide`` pair is not provided (sampling ``q(v⊥)`` would need ``chol(C_vv)``, cubic in ``M2``).
    """
    # constructor arguments kept under another attribute (dotted path): read by saving.describe
    _saving_aliases = {"Z": "inducing.Z", "O": "orthogonal.Z"}

    def __init__(self, kernel, Z, O, likelihood=None, num_subsample=None, whiten=True, name=None, jitter=None,
                 mean_function=None):
        if isinstance(Z, ind.InducingVariables) or isinstance(O, ind.InducingVariables):
            raise ValueError("ODVGP takes inducing points (Z [M, D] and O [M2, D]: tensors, arrays, lists) only")
        Z, O = as_tensor(Z, "Z"), as_tensor(O, "O")
        if Z.dim() != 2:
            raise ValueError(f"ODVGP has a single output: Z must be [M, D], got shape {tuple(Z.shape)}")
        if getattr(likelihood, "latent_dim", 1) != 1:
            raise ValueError(f"ODVGP has a single output, but {type(likelihood).__name__} has K = "
                             f"{likelihood.latent_dim} latent functions per point: use SVGP or SOLVEGP for it")
        # integrate_f=True: the bound integrates f in closed form (no f site), so no UntrainableWarning applies
        super().__init__(kernel, Z, likelihood, None, whiten, name, True, jitter, mean_function)
        check_orthogonal_inputs(O, self.Z)
        if O.dim() != 2 or O.shape[-1] != Z.shape[-1]:
            raise ValueError(f"O must be [M2, {Z.shape[-1]}], got shape {tuple(O.shape)}")
        if num_subsample is not None and (isinstance(num_subsample, bool) or int(num_subsample) != num_subsample
                                          or num_subsample < 1):
            raise ValueError(f"num_subsample must be a positive integer or None, got {num_subsample!r}")
        self.orthogonal = ind.InducingPoints(O)
        self.num_subsample = None if num_subsample is None else int(num_subsample)
        self.a = PyroParam(torch.zeros(O.shape[0], dtype=O.dtype, device=O.device), constraints.real)

    # -- the bound's pieces ------------------------------------------------------------------------------------------
    def _terms(self, X):
        """``(loc, var, Luu, b)``: the marginals of ``q(f)`` at ``X [B, D]`` (module docstring) and
        ``b = Luu^{-1} K_uv a`` ``[M]``. One Cholesky of ``Kuu``; ``K_fv a`` and ``K_uv a`` are ``O((B + M) M2)``."""
        k, a = self.kernel, self.a
        Kuu, Luu = self.strategy.kuu_chol(consume=False)
        self.strategy.clear()
        Kuv_a = kernel_matvec(k, self.Z, self.O, a)  # [M]
        Kfv_a = kernel_matvec(k, X, self.O, a)  # [B]
        b = torch.linalg.solve_triangular(Luu, Kuv_a.unsqueeze(-1), upper=False).squeeze(-1)  # [M]
        m, C = cond.whitened_q(self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else Luu)
        # k_nu Kuu^{-1} (m_u - K_uv a) = W^T (m' - b) with W = Luu^{-1} K_uf (whitened_marginals forms W)
        loc, dvar = whitened_marginals(cov.Kuf(self.inducing, k, X), m - b, C, Kuu, Luu)
        return loc + Kfv_a + self._mean(X), cond.clamp_var(cov.Kdiag(k, X) + dvar), Luu, b

    def columns(self, generator=None) -> torch.Tensor:
        """A uniform random subset of ``J = num_subsample`` of the ``M2`` column indices, without replacement
        (``[J]``, from ``generator`` or torch's global generator, which ``pyro.set_rng_seed`` seeds)."""
        M2 = self.O.shape[0]
        J = M2 if self.num_subsample is None else min(self.num_subsample, M2)
        return torch.randperm(M2, generator=generator, device="cpu")[:J].to(self.O.device)

    def quad_kvv(self, columns=None) -> torch.Tensor:
        r""":math:`a^TK_{vv}a`, estimated from the columns ``columns`` (an index tensor ``[J]`` of distinct
        indices; ``None``: a fresh :meth:`columns` draw) as :math:`\frac{M_2}{J}a_S^TK_{S,:}a` (unbiased; module
        docstring), or exactly when they are all ``M2`` columns (in row blocks: memory ``O(M2)`` per row)."""
        a, O = self.a, self.O
        M2 = O.shape[0]
        idx = self.columns() if columns is None else torch.as_tensor(columns, device=O.device)
        J = idx.shape[0]
        if J == M2:  # exact: every column (in any order)
            return a @ kernel_matvec(self.kernel, O, O, a)
        return (M2 / J) * (a[idx] @ kernel_matvec(self.kernel, O[idx], O, a))

    def kl_v(self, b, columns=None) -> torch.Tensor:
        r""":math:`\mathrm{KL}[q(v_\perp)\|p_\perp(v_\perp)] = \tfrac12(a^TK_{vv}a - \|b\|^2)`,
        ``b = Luu^{-1}K_{uv}a`` (eq. 36 at :math:`S_v = C_{vv}`), with :meth:`quad_kvv`'s estimate; ``()``."""
        return 0.5 * (self.quad_kvv(columns) - b.pow(2).sum(-1))

    @layer_method
    def kl_divergence(self, consume: bool = False, columns=None) -> torch.Tensor:
        """``KL_u + KL_v`` (eqs. 35-36 at ``S_v = C_vv``, ``m_v = C_vv a``), ``()``, with ``a^T K_vv a`` from the
        columns ``columns`` (``None``: ``num_subsample`` drawn afresh; all ``M2``: exact)."""
        _, Luu = self.strategy.kuu_chol(consume=False)
        self.strategy.clear()
        Kuv_a = kernel_matvec(self.kernel, self.Z, self.O, self.a)  # [M]
        b = torch.linalg.solve_triangular(Luu, Kuv_a.unsqueeze(-1), upper=False).squeeze(-1)
        return self.kl_u(Luu) + self.kl_v(b, columns)

    def kl_u(self, Luu) -> torch.Tensor:
        """KL[q(u) || p(u)] (eq. 35), ``()``; ``Luu = chol(Kuu)``."""
        prior = self.prior(None if self.whiten else Luu)
        return torch.distributions.kl_divergence(self.posterior(), prior)

    # -- the bound and predictions -----------------------------------------------------------------------------------
    @layer_method
    def analytic_elbo(self, X, y, num_data: int | None = None, columns=None) -> torch.Tensor:
        """Eq. 8 of Shi, Titsias, Mnih (2020) at ``S_v = C_vv``, ``m_v = C_vv a`` on a minibatch ``X [B, D]``,
        ``y [B]``: ``num_data / B * sum_n E_q[log p(y_n | f_n)] - KL_u - KL_v``, with ``a^T K_vv a`` in ``KL_v``
        estimated from the columns ``columns`` (``None``: ``num_subsample`` drawn afresh; module docstring).
        Unbiased for the full-data, exact bound, and so is its gradient. ``()``. What ``fit`` maximises."""
        X, y = self.check_inputs(X, y, purpose="elbo")
        loc, var, Luu, b = self._terms(X)
        scale = (num_data or X.shape[-2]) / X.shape[-2]
        lld = scale * self.likelihood.expected_log_prob(y, loc, var).sum()
        return lld - self.kl_u(Luu) - self.kl_v(b, columns)

    @layer_method
    def qf(self, X, consume: bool = False):
        """Marginals ``(loc, var)`` of ``q(f)`` at ``X [..., B, D]``, exact (module docstring), each ``[..., B]``.
        :meth:`~pyro_sparsegp.SVGP.predict` takes them in chunks of rows (``K_fv`` ``[rows, M2]`` within 2^24
        elements)."""
        loc, var, _, _ = self._terms(X)
        return loc, var

    @layer_method
    def qf_full(self, X):
        """Mean ``[N]`` and full covariance ``[N, N]`` of ``q(f*)`` at ``X [N, D]``: the SVGP covariance (``q(v⊥)``
        has the prior's, which adds nothing) and the mean of :meth:`qf`."""
        _, cov = super().qf_full(X)
        return self._terms(X)[0], cov

    def _sites(self, *args, **kwargs):
        r"""Not available for ODVGP (``NotImplementedError``): the Pyro sites of :class:`~pyro_sparsegp.SOLVEGP`
        (``X [..., B, D]``) would sample :math:`q(v_\perp) = N(C_{vv}a, C_{vv})` (Shi, Titsias, Mnih 2020,
        section 5), whose factor ``chol(C_vv)`` ``[M2, M2]`` is what this module avoids."""
        raise NotImplementedError(
            "ODVGP has no Pyro model/guide sites (q(v⊥) = N(C_vv a, C_vv) would need chol(C_vv), cubic in M2); "
            "train it on analytic_elbo, e.g. pyro_sparsegp.infer.fit(gp, X, y)")

    model = guide = sample_u = sample_f = sample_hidden = conditional = moments = _sites
