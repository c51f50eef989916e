"""The Pyro program of :class:`~pyro_sparsegp.layers.groups.GroupGP` (its module docstring gives the model and the
bound): the groups plate (``<name>.groups``, ``dim=-2``) whose subsample Pyro scales by ``G / g``, the rows of the
drawn groups in the data plate (``<name>.data``, ``dim=-1``) under ``poutine.scale(G / g)``, and ``p(f | v_0, v)``
with each row's own group picked from the batch's groups (Hensman, Matthews, Ghahramani 2015, eq. 21, per group)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from .. import conditionals as cond
from ..context.composition import draw_hyperparameters
from ..context.composition import plate as joined_plate
from .group_data import projection, split

__all__ = ["GroupProgram"]


class GroupProgram:
    """Mixin of :class:`~pyro_sparsegp.layers.groups.GroupGP`: its ``model``/``guide`` program and plates. Inputs
    ``X [N, D + 1]`` (group in the last column), ``y [N]``; sites ``<name>.pop.u [..., M]``, ``<name>.u
    [..., g, 1, M]``, ``<name>.f [..., 1, R]`` (``[R]`` without particles)."""

    # -- the Pyro program ----------------------------------------------------------------------------------------
    def _plates(self, group, subsample_size, num_data):
        """``(groups plate, data plate, rows [R], pos [R])``: the groups plate (``dim=-2``; drawn ``subsample_size``
        of ``G``, or the batch's groups of ``num_data``, or all ``G``), the rows of its groups and each row's place
        among its indices, and the data plate over those rows (``dim=-1``)."""
        name, G = self.name, self.num_groups
        if num_data is not None:
            idx, pos = torch.unique(group, return_inverse=True)
            gp = joined_plate(f"{name}.groups", num_data, dim=-2, subsample=idx)
            rows = torch.arange(len(group), device=group.device)
        else:
            gp = joined_plate(f"{name}.groups", G, subsample_size=subsample_size, dim=-2, device=group.device)
            idx = gp._indices
            srt, perm = idx.sort()
            rows = torch.isin(group, idx).nonzero().squeeze(-1)
            pos = perm[torch.searchsorted(srt, group[rows])]
        return gp, joined_plate(f"{name}.data", len(rows), dim=-1), rows, pos

    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The plates :meth:`model` opens for these arguments, drawn from this call's own ``X``: pass
        ``create_plates=gp.create_plates`` to ``AutoGuideList`` around :meth:`model`."""
        X, _ = self.check_inputs(X)
        gp, data, _, _ = self._plates(split(X)[1], subsample_size, num_data)
        return [gp, data]

    def _conditional(self, Xf, pos, v, u0):
        """``p(f | v_0, v)`` at the rows ``Xf [R, D]``: each row's group value ``v [..., g, 1, M]`` picked by
        ``pos [R]``; a Normal of batch shape ``[..., 1, R]`` (``[R]`` without particles). Draws made outside the
        plates under vectorised particles (``v_0 [P, 1, 1, M]``, a ``PyroSample`` hyperparameter's ``[P, 1, 1]`` and the
        projections made from it) lose their singletons first, so that their particle dimension meets ``v``'s and
        never another particle dimension (the program checker's "particles broadcast against particles")."""
        A, kdiag = projection(self.inducing, self.kernel, Xf, self.jitter)
        A, kdiag = _outside_plates(A, 2), _outside_plates(kdiag, 1)  # [(P,) M, R], [(P,) R]
        vr = v.squeeze(-2).index_select(-2, pos)  # [(P,) R, M]
        loc = (vr * A.mT).sum(-1)  # [(P,) R]
        var = cond.conditional_var(kdiag, A)
        if u0 is not None:
            A0, k0 = projection(self.inducing, self.population, Xf, self.jitter)
            A0, k0 = _outside_plates(A0, 2), _outside_plates(k0, 1)
            loc = loc + (_outside_plates(u0, 1).unsqueeze(-2) @ A0).squeeze(-2)
            var = var + cond.conditional_var(k0, A0)
        loc, var = torch.broadcast_tensors(loc, var)
        if loc.dim() > 1:  # particles: [P, R] -> [P, 1, R], the groups plate's singleton at dim -2
            loc, var = loc.unsqueeze(-2), var.unsqueeze(-2)
        return dist.Normal(loc, var.sqrt())

    def _program(self, X, y, subsample_size, num_data, guide: bool):
        X, y = self.check_inputs(X, y)
        Xf, group = split(X)
        draw_hyperparameters(self)
        M = self.Z.shape[0]
        out, u0 = {}, None
        if self.population is not None:
            q0 = self.q_pop() if guide else dist.Normal(self.Z.new_zeros(M), 1.0).to_event(1)
            u0 = out[f"{self.name}.pop.u"] = pyro.sample(f"{self.name}.pop.u", q0)
        gplate, data, rows, pos = self._plates(group, subsample_size, num_data)
        with gplate as idx:
            if guide:
                m, L = self._group_rows(idx)
                qv = dist.MultivariateNormal(m.unsqueeze(-2), scale_tril=L.unsqueeze(-3))
            else:
                qv = dist.Normal(self.Z.new_zeros(len(idx), 1, M), 1.0).to_event(1)
            v = out[f"{self.name}.u"] = pyro.sample(f"{self.name}.u", qv)
        scale = 1.0 if subsample_size is None and num_data is None else gplate.size / gplate.subsample_size
        with poutine.scale(scale=scale), data:
            f = out[f"{self.name}.f"] = pyro.sample(f"{self.name}.f", self._conditional(Xf[rows], pos, v, u0))
            if not guide and self.likelihood is not None:
                self.likelihood(f, None if y is None else y[rows], prefix=self.name)
        return out



def _outside_plates(t: torch.Tensor, event: int) -> torch.Tensor:
    """``t [..., *event]`` computed from values drawn outside the groups and data plates (a ``v_0``, a hyperparameter
    and what a kernel makes of it), whose batch dimensions are the particles' and singletons (``[P, 1, 1]``,
    ``[P, 1]``, ... as the kernel broadcasts), as ``[P, *event]``; without particles ``[*event]``."""
    batch = t.shape[: t.dim() - event]
    sized = [n for n in batch if n != 1]
    if len(sized) > 1:
        raise ValueError(f"GroupGP: a value drawn outside the plates has batch shape {tuple(batch)}: more than the "
                         "particles' dimension (is a hyperparameter's prior batched? give it .to_event())")
    return t.reshape(tuple(sized) + t.shape[t.dim() - event :])
