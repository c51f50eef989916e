r"""The data side of :class:`~pyro_sparsegp.layers.groups.GroupGP`: rows tagged with their group, batches of whole
groups, and the per-group closed forms that cost ``O(g M^2)`` for the ``g`` groups of a batch.

**Inputs.** A row is ``[x_1 .. x_D, g]``: the features and, in the last column, the index ``g`` in ``0..G-1`` of its
group (a float holding an integer: exact up to ``2^24`` in float32). ``X [N, D + 1]`` is then one tensor, so
``fit``, minibatches, datasets and ``Predictive`` carry the group with the features; :func:`join` and :func:`split`
convert.

**Batches of groups.** The layer's bound is a sum over groups, each group's term holding its rows' expected
log-likelihoods and its KL; a minibatch draws ``g`` of the ``G`` groups uniformly without replacement and takes every
row of each, and the sum over the batch times ``G / g`` is unbiased (each group is in the batch with probability
``g / G``; the stochastic bound of Hensman, Fusi, Lawrence 2013, section 3.1, with groups as the units).
:class:`GroupRows` is that sampling as a dataset of ``fit``: ``len`` is the number of groups that hold rows,
``ds[idx]`` the rows of the groups ``idx``, found in ``O(rows + g)`` from an index sorted once (no ``O(N)`` or
``O(G)`` work per batch).
"""

from __future__ import annotations

import torch
from torch.distributions import constraints, transform_to

from .. import covariances as cov
from ..checks.inputs import as_tensor
from ..conditionals import clamp_var
from ..linalg import cholesky

__all__ = ["GroupRows", "projection", "join", "split", "lower_cholesky", "whitened_group_marginals", "group_kl"]

_TRIL = transform_to(constraints.lower_cholesky)  # Pyro's transform of a PyroParam(constraint=lower_cholesky)


def join(X, group) -> torch.Tensor:
    """``[X, group]``: features ``X [N, D]`` and group indices ``group [N]`` (integers ``0..G-1``) as the layer's
    inputs ``[N, D + 1]`` (module docstring)."""
    X = as_tensor(X, "X")
    group = torch.as_tensor(group, device=X.device)
    if group.shape != X.shape[:-1]:
        raise ValueError(f"group must be [N] with one index per row of X [N, D]; got X {tuple(X.shape)} and group "
                         f"{tuple(group.shape)}")
    return torch.cat([X, group.to(X.dtype).unsqueeze(-1)], -1)


def split(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [..., N, D], group [N] long)`` from the layer's inputs ``[..., N, D + 1]`` (the group column of the
    last batch entry: groups do not vary over particles)."""
    g = X[..., -1]
    while g.dim() > 1:
        g = g[0]
    return X[..., :-1], g.long()


def check_groups(group_column: torch.Tensor, num_groups: int) -> None:
    """Raise ``ValueError`` unless every entry of ``group_column`` ``[N]`` (floats) is an integer in
    ``0..num_groups-1``."""
    ok = (group_column == group_column.round()) & (group_column >= 0) & (group_column < num_groups)
    if not bool(ok.all()):
        bad = group_column[~ok][:5].tolist()
        raise ValueError(f"the last column of X holds each row's group, an integer in 0..{num_groups - 1} "
                         f"(num_groups={num_groups}); found {bad}. Build the inputs with "
                         "ps.layers.groups.join(X, group) from features X [N, D] and integer groups [N]")


def projection(inducing, kernel, X, jitter):
    """``(A = L_uu^{-1} K_uf [..., M, R], kdiag [..., R])`` for inputs ``X [R, D]`` (Hensman 2015, eq. 19)."""
    Kuu = cov.Kuu(inducing, kernel)
    Luu = cholesky(Kuu, jitter, symmetrize=True)
    Kuf = cov.Kuf(inducing, kernel, X)
    return torch.linalg.solve_triangular(Luu, Kuf, upper=False), cov.Kdiag(kernel, X)


def lower_cholesky(raw: torch.Tensor) -> torch.Tensor:
    """Pyro's ``lower_cholesky`` constraint applied to unconstrained rows ``[..., M, M]`` (strict lower triangle kept,
    diagonal exponentiated): applied to the gathered rows only, so a step never transforms all ``G`` factors."""
    return _TRIL(raw)


def whitened_group_marginals(A: torch.Tensor, kdiag: torch.Tensor, m: torch.Tensor, L: torch.Tensor):
    r"""Marginals of ``q(f_n)`` of each row under its own group's whitened ``q(v_g) = N(m_g, L_g L_g^T)``: mean
    ``a_n^T m_{g_n}`` and variance ``k_nn - |a_n|^2 + |L_{g_n}^T a_n|^2`` with ``a_n = L_{uu}^{-1} k(Z, x_n)``
    (Hensman, Matthews, Ghahramani 2015, eq. 19, per group). ``A [M, R]``, ``kdiag [R]``, the rows' own ``m [R, M]``
    and ``L [R, M, M]``; returns ``(loc [R], var [R])``. ``O(R M^2)``."""
    a = A.mT  # [R, M]
    loc = (a * m).sum(-1)
    s = (L.mT @ a.unsqueeze(-1)).squeeze(-1)  # [R, M]
    var = kdiag - a.pow(2).sum(-1) + s.pow(2).sum(-1)
    return loc, clamp_var(var)


def group_kl(m: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    r"""``KL[N(m, L L^T) || N(0, I)] = (tr S + m^T m - M - log det S) / 2`` per group, ``m [g, M]``, ``L [g, M, M]``
    -> ``[g]`` (the whitened KL of Hensman, Matthews, Ghahramani 2015, eq. 21, per group)."""
    M = m.shape[-1]
    logdet = 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return 0.5 * (L.pow(2).sum((-2, -1)) + m.pow(2).sum(-1) - M - logdet)


class GroupRows:
    """A dataset of whole groups for :func:`~pyro_sparsegp.infer.fit` (module docstring): ``len(ds)`` is the number
    ``G'`` of groups that hold rows; ``ds[idx]`` (``idx [g]`` integers below ``G'``) returns ``(X [R, D + 1], y [R])``,
    every row of those groups. ``fit(gp, GroupRows(X, y), batch_size=g)`` then draws ``g`` groups per step and
    passes ``num_data = G'``, so the layer's bound scales the batch by ``G' / g``. Groups without rows are left out
    (their ``q`` stays at the prior, their optimum)."""

    def __init__(self, X, y):
        X = as_tensor(X, "X")
        y = torch.as_tensor(y, device=X.device)
        if y.shape[:1] != X.shape[:1]:
            raise ValueError(f"X and y have different numbers of rows: {X.shape[0]} and {y.shape[0]}")
        group = X[:, -1].long()
        self.X, self.y = X, y
        self.order = torch.argsort(group, stable=True)  # rows sorted by group, once
        counts = torch.bincount(group)
        present = counts.nonzero().squeeze(-1)
        self.counts = counts[present]  # [G'] rows per non-empty group
        self.starts = (torch.cumsum(counts, 0) - counts)[present]  # [G'] their first position in `order`
        self.groups = present  # [G'] the group index of each

    def __len__(self) -> int:
        return len(self.groups)

    def rows(self, idx) -> torch.Tensor:
        """The row indices ``[R]`` of the ``idx``-th non-empty groups, ``O(R + g)``."""
        idx = torch.as_tensor(idx, device=self.order.device).long().reshape(-1)
        n, start = self.counts[idx], self.starts[idx]
        offsets = torch.cumsum(n, 0) - n
        within = torch.arange(int(n.sum()), device=n.device) - torch.repeat_interleave(offsets, n)
        return self.order[torch.repeat_interleave(start, n) + within]

    def __getitem__(self, idx):
        rows = self.rows(idx)
        return self.X[rows], self.y[rows]
