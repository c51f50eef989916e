r"""A GP per group: ``G`` GPs that share a kernel and inducing inputs, each row belonging to one group, beside an
optional population GP (additive), with the cost of a step independent of ``G``.

**Model.** Rows ``(x_n, g_n, y_n)``: ``f_n = f_0(x_n) + f_{g_n}(x_n)``, ``y_n ~ p(y | f_n)``, with the population GP
``f_0 ~ GP(0, k_0)`` and the group GPs ``f_g ~ GP(0, k)``, ``g = 0..G-1``, independent given the shared kernel
``k`` (hyperpriors on it are priors shared by every group: a ``PyroSample`` on its attributes, as for
:class:`~pyro_sparsegp.SVGP`). Each GP has whitened inducing values at the shared inputs ``Z [M, D]``:
``u_g = L_{uu} v_g``, ``p(v_g) = N(0, I)``, ``q(v_g) = N(m_g, L_g L_g^T)`` (``m [G, M]``, ``L [G, M, M]``);
``q(v_0) = N(m_0, L_0 L_0^T)`` for the population.

**Bound** (Hensman, Matthews, Ghahramani 2015, eq. 21, per GP; the sum ``f_0 + f_g`` of independent Gaussian
marginals under ``q``):

.. math:: \mathcal{L} = \sum_g \Big[\sum_{n \in g} \mathbb{E}_{q(f_n)} \log p(y_n \mid f_n) - \mathrm{KL}[q(v_g)
   \| p(v_g)]\Big] - \mathrm{KL}[q(v_0) \| p(v_0)],\quad q(f_n) = N(a_{0n}^T m_0 + a_n^T m_{g_n},\
   \tilde k_{0,nn} + \tilde k_{nn} + |L_0^T a_{0n}|^2 + |L_{g_n}^T a_n|^2)

with ``a_n = L_{uu}^{-1} k(Z, x_n)`` and ``\tilde k_{nn} = k(x_n, x_n) - |a_n|^2`` (eq. 19). A minibatch holds ``g``
of the groups (drawn uniformly, every row of each): the bracket summed over them times ``G / g`` is unbiased
(:mod:`~pyro_sparsegp.layers.group_data`). :meth:`GroupGP.analytic_elbo` is that estimate in closed form (what
``fit`` maximises); :meth:`GroupGP.model` / :meth:`GroupGP.guide` are the same bound as Pyro programs, the groups'
sites ``<name>.u`` in the plate ``<name>.groups`` (``dim=-2``, subsampled: Pyro scales them by ``G / g``), the
population's ``<name>.pop.u``, and ``<name>.f`` and ``y`` in the data plate ``<name>.data`` (``dim=-1``) scaled by
``G / g`` (``poutine.scale``: the rows are those of the drawn groups, not a subsample of rows).

**Cost.** ``K_{uu}`` and its Cholesky factor are computed once per step (shared ``Z`` and kernel), and only the
batch's rows of ``m`` and ``L`` are read (``index_select``; the constraint is applied to those rows only), so the
forward pass is ``O(M^3 + R M^2)`` for ``R`` rows, whatever ``G``. The parameters are dense ``[G, M]`` and
``[G, M, M]`` tensors: the gradient of a gather is dense (zeros outside the batch's groups) and Adam updates every
row, ``O(G M^2)`` per step of cheap element-wise work. Sparse gradients (``embedding`` with ``sparse=True``) let
``fit`` step only the batch's rows (its Adam is lazy on them, as ``torch.optim.SparseAdam``), and a step is flat in
``G`` (``benchmarks/groups.py`` measures both); a Pyro optimiser such as ``pyro.optim.Adam`` refuses sparse
gradients. ``sparse="auto"`` (the default) therefore gives sparse gradients inside ``fit``'s steps and dense ones
anywhere else (``SVI``); ``True``/``False`` force one.

**Prediction.** :meth:`GroupGP.predict` ``(X, group)``: ``q(f_*) = q(f_0(x_*)) + q(f_{g}(x_*))`` for a known group;
for a new group (``group`` ``-1``, or ``None``) the group GP is its prior, ``N(0, k(x_*, x_*))``, added to the
population's ``q``.

Natural-gradient steps: the population's ``q(v_0)`` is a :class:`~pyro_sparsegp.variational.GaussianQ` (under
``SVI``, :class:`~pyro_sparsegp.infer.NaturalGradient` steps it); the groups' families are Adam's (``fit`` trains
the whole layer with Adam: :meth:`GroupGP.natgrad_families` is empty).
"""

from __future__ import annotations

import copy

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from .. import inducing as ind
from ..checks.inputs import as_tensor
from ..context.composition import layer_method
from ..context.naming import KeepsOwnName, claim_name, unique_name
from ..context.reporting import current_step
from ..likelihoods.base import check_likelihood
from ..variational import GaussianQ
from .group_data import (
    GroupRows,
    check_groups,
    group_kl,
    join,
    lower_cholesky,
    projection,
    split,
    whitened_group_marginals,
)
from .group_program import GroupProgram

__all__ = ["GroupGP"]


class GroupGP(GroupProgram, KeepsOwnName, PyroModule):
    r"""``G`` GPs with a shared kernel, one per group, plus an optional population GP (module docstring).

    :param kernel: the groups' kernel ``k`` (a :class:`pyro.contrib.gp.kernels.Kernel`; ``PyroSample`` attributes
        are hyperpriors shared by the groups).
    :param Z: the inducing inputs ``[M, D]``, shared by every group and the population.
    :param int num_groups: ``G``.
    :param likelihood: a :class:`~pyro_sparsegp.likelihoods.Likelihood` (element-wise, one latent function).
    :param population: ``True``: a population GP with a copy of ``kernel``; a kernel: the population's own
        kernel ``k_0``; ``None``/``False``: no population GP.
    :param str name: prefix of the sites and parameters (default ``"ggp"``, unique among live modules).
    :param sparse: sparse gradients for the groups' ``m`` and ``L``: ``"auto"`` (inside ``fit``'s steps, dense
        elsewhere), ``True`` or ``False`` (module docstring, "Cost").

    Inputs ``X [N, D + 1]``: the features and, in the last column, the group (:func:`group_data.join
    <pyro_sparsegp.layers.group_data.join>`); ``y [N]``. Parameters ``<name>.q_loc [G, M]``,
    ``<name>.q_tril [G, M * M]`` (each row an unconstrained ``M x M`` matrix, row-major: the strict lower triangle
    is ``L_g``'s, its diagonal ``log diag L_g``), ``<name>.q_pop.*`` and
    ``<name>.inducing.Z``.
    """

    _saving_aliases = {"Z": "inducing"}

    def __init__(self, kernel, Z, num_groups: int, likelihood=None, population=True, name: str | None = None,
                 jitter: float | None = None, sparse: bool | str = "auto"):
        name = unique_name("ggp") if name is None else name
        super().__init__(name=name)
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be an integer >= 1, got {num_groups!r}")
        if sparse not in (True, False, "auto"):
            raise ValueError(f"sparse must be True, False or 'auto', got {sparse!r}")
        inducing = Z if isinstance(Z, ind.InducingPoints) else None  # a saved layout gives the module back
        Z = inducing.Z.detach() if inducing is not None else as_tensor(Z, "Z")
        if Z.dim() != 2:
            raise ValueError(f"Z must be [M, D] (shared by every group), got shape {tuple(Z.shape)}")
        check_likelihood(likelihood)
        claim_name(self, name)
        M = Z.shape[0]
        self.name, self.num_groups, self.jitter, self.sparse = name, num_groups, jitter, sparse
        self.kernel, self.likelihood = kernel, likelihood
        self.inducing = inducing if inducing is not None else ind.as_inducing(Z)
        if population is True:
            population = copy.deepcopy(kernel)
        self.population = population if population is not False else None
        self.q_pop = GaussianQ(M) if self.population is not None else None
        dtype = Z.dtype
        # unconstrained (constraints.real: reading them transforms nothing); the Cholesky constraint is applied to
        # the gathered rows only (_group_rows)
        self.q_loc = PyroParam(torch.zeros(num_groups, M, dtype=dtype, device=Z.device), constraints.real)
        self.q_tril = PyroParam(torch.zeros(num_groups, M * M, dtype=dtype, device=Z.device), constraints.real)

    @property
    def Z(self) -> torch.Tensor:
        """The inducing inputs ``[M, D]`` (``self.inducing.Z``)."""
        return self.inducing.Z

    join, split = staticmethod(join), staticmethod(split)

    def natgrad_families(self) -> list:
        """No family for ``fit``'s natural steps (module docstring): ``[]``."""
        return []

    def fit_data(self, X, y):
        """``fit``'s data as batches of whole groups: ``(GroupRows(X, y), None)`` after checking ``X [N, D + 1]``,
        ``y [N]`` (a dataset or loader is passed through)."""
        if y is None:
            return X, y
        X, y = self.check_inputs(X, y)
        return GroupRows(X, y), None

    # -- inputs --------------------------------------------------------------------------------------------------
    def check_inputs(self, X, y=None, *args, **kwargs):
        """``(X [..., N, D + 1], y [N] or None)`` as tensors of the module's dtype; raises ``ValueError`` for a group
        column that is not an integer in ``0..G-1`` or a wrong width."""
        X = as_tensor(X, "X", self.Z.dtype, self.Z.device)
        D = self.Z.shape[-1]
        if X.dim() < 2 or X.shape[-1] != D + 1:
            raise ValueError(f"X must be [N, D + 1] = [N, {D + 1}]: the {D} features and the group index in the last "
                             f"column (ps.layers.groups.join(X, group)); got shape {tuple(X.shape)}")
        check_groups(split(X)[1].to(X.dtype) if X.dim() > 2 else X[:, -1], self.num_groups)
        if y is not None:
            y = as_tensor(y, "y", self.Z.dtype, self.Z.device, floating=False)
            if y.dim() == 2 and y.shape[-1] == 1:
                y = y.squeeze(-1)
            if y.shape != X.shape[-2:-1]:
                raise ValueError(f"y must be [N] = [{X.shape[-2]}], got shape {tuple(y.shape)}")
            if self.likelihood is not None:
                self.likelihood.check_y(y)
        return X, y

    # -- the pieces of q(f) --------------------------------------------------------------------------------------
    def _group_rows(self, idx: torch.Tensor):
        """``(m [g, M], L [g, M, M])`` of the groups ``idx [g]``: only those rows are read and transformed."""
        if self.sparse is True or (self.sparse == "auto" and current_step() is not None):  # fit's steps (reporting)
            m = torch.nn.functional.embedding(idx, self.q_loc, sparse=True)
            raw = torch.nn.functional.embedding(idx, self.q_tril, sparse=True)
        else:
            m, raw = self.q_loc.index_select(0, idx), self.q_tril.index_select(0, idx)
        M = m.shape[-1]
        return m, lower_cholesky(raw.unflatten(-1, (M, M)))

    def _pop_qf(self, Xf):
        if self.population is None:
            return 0.0, 0.0
        A, kdiag = projection(self.inducing, self.population, Xf, self.jitter)
        m, C = self.q_pop.u_loc, self.q_pop.u_scale_tril
        return whitened_group_marginals(A, kdiag, m.expand(Xf.shape[0], -1), C.expand(Xf.shape[0], -1, -1))

    @layer_method
    def qf(self, X: torch.Tensor):
        """Marginals of ``q(f_n)`` at the rows ``X [R, D + 1]`` (each under its own group): ``(loc [R], var [R])``,
        and the groups of the rows ``idx [g]`` with their ``(m, L)``, for the KL."""
        Xf, group = split(X)
        idx, pos = torch.unique(group, return_inverse=True)
        m, L = self._group_rows(idx)
        A, kdiag = projection(self.inducing, self.kernel, Xf, self.jitter)
        loc, var = whitened_group_marginals(A, kdiag, m.index_select(0, pos), L.index_select(0, pos))
        loc0, var0 = self._pop_qf(Xf)
        return loc + loc0, var + var0, (m, L)

    @layer_method
    def analytic_elbo(self, X, y, num_data: int | None = None) -> torch.Tensor:
        """The bound on a batch in closed form (module docstring): ``X [R, D + 1]`` holds every row of ``g``
        groups; ``num_data``: the number of groups ``G'`` the batch was drawn from (the sum is scaled by
        ``G' / g``), or ``None`` for the whole data (scale 1). Returns ``()``."""
        X, y = self.check_inputs(X, y)
        loc, var, (m, L) = self.qf(X)
        scale = 1.0 if num_data is None else num_data / m.shape[0]
        groups = self.likelihood.expected_log_prob(y, loc, var).sum() - group_kl(m, L).sum()
        kl0 = 0.0 if self.q_pop is None else torch.distributions.kl_divergence(
            self.q_pop(), dist.Normal(torch.zeros_like(self.q_pop.u_loc), 1.0).to_event(1))
        return scale * groups - kl0

    # -- prediction ----------------------------------------------------------------------------------------------
    @layer_method
    def predict(self, X, group=None, full: bool = False):
        """``(mean [N], var [N])`` of ``q(f_*)`` at features ``X [N, D]`` of the groups ``group [N]`` (an entry
        ``-1``: a new group), or at ``X [N, D + 1]`` with the group column; ``group=None`` with ``X [N, D]``: every
        row of a new group (the population's ``q`` plus the group prior ``k(x, x)``). ``full=True`` adds the
        likelihood's predictive distribution of ``y*``."""
        X = as_tensor(X, "X", self.Z.dtype, self.Z.device)
        D = self.Z.shape[-1]
        if group is None and X.shape[-1] == D + 1:
            X, group = X[:, :-1], X[:, -1]
        group = (torch.full(X.shape[:-1], -1) if group is None else torch.as_tensor(group)).to(X.device).long()
        if X.dim() != 2 or X.shape[-1] != D or group.shape != X.shape[:-1]:
            raise ValueError(f"predict takes X [N, {D}] with group [N] (or X [N, {D + 1}]); got X {tuple(X.shape)}, "
                             f"group {tuple(group.shape)}")
        known = group >= 0
        check_groups(group[known].to(X.dtype), self.num_groups)
        with torch.no_grad():
            A, kdiag = projection(self.inducing, self.kernel, X, self.jitter)
            m, L = self._group_rows(group.clamp_min(0))
            loc, var = whitened_group_marginals(A, kdiag, m, L)
            loc, var = torch.where(known, loc, 0.0), torch.where(known, var, kdiag)
            loc0, var0 = self._pop_qf(X)
            out = (loc + loc0, var + var0)
            return out + (self.likelihood.predictive(*out),) if full else out

    @layer_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """The generative model on ``X [N, D + 1]``, ``y [N]``: ``subsample_size=g`` draws ``g`` of the ``G`` groups
        (every row of each; ``O(N)`` to find them); ``num_data``: ``X`` already holds every row of some groups, of
        ``num_data`` in all. Returns the sampled values by site name."""
        return self._program(X, y, subsample_size, num_data, guide=False)

    @layer_method(guide_arg="guide")
    def guide(self, X, y=None, *, subsample_size=None, num_data=None, guide: bool = True):
        """``q(v_0) prod_g q(v_g) p(f | v)`` with the same plates as :meth:`model`; returns the draws by site name
        (a dict, so it can be a part of ``AutoGuideList``)."""
        return self._program(X, y, subsample_size, num_data, guide=True)
