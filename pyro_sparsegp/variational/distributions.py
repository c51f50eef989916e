r"""Variational families over inducing variables, apart from how q(u) becomes q(f) (that is
:mod:`pyro_sparsegp.conditionals`).

:class:`GaussianQ` is the full-covariance family :math:`q(u) = N(m, S)`, :math:`S = L L^T`, of Hensman, Fusi,
Lawrence (2013), section 3, with ``u_loc`` (``m``) and ``u_scale_tril`` (``L``) as ``PyroParam`` s so that SVI trains
them. :func:`to_natural` / :func:`from_natural` map between ``(m, L)`` and the natural parameters
:math:`\theta_1 = S^{-1} m`, :math:`\theta_2 = -\tfrac12 S^{-1}` used by natural-gradient steps (section 3.2).
"""

from __future__ import annotations

import weakref

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from ..linalg import cholesky

__all__ = ["GaussianQ", "to_natural", "from_natural", "live_gaussian_families"]

_LIVE = weakref.WeakSet()  # every GaussianQ alive (built, copied or unpickled): NaturalGradient's registry


def live_gaussian_families() -> list:
    """The full-covariance :class:`GaussianQ` objects alive in this process (``learn_scale=True``; weak references, so
    a family that is no longer referenced drops out). :class:`~pyro_sparsegp.infer.NaturalGradient` matches the
    parameters SVI hands it against these. Returns a list of modules (``u_loc [..., M]``, ``u_scale_tril
    [..., M, M]``): the families whose natural parameters Hensman, Fusi, Lawrence 2013, section 3.2, step."""
    return [q for q in list(_LIVE) if q.__dict__.get("learn_scale", False)]


class GaussianQ(PyroModule):
    """Full-rank Gaussian :math:`q(u) = N(m, LL^T)` over ``M`` inducing values for each of ``L`` outputs (Hensman,
    Fusi, Lawrence 2013, section 3.1).

    :param int M: number of inducing variables.
    :param int num_outputs: ``L``, or ``None`` for a single output.
    :param torch.Tensor scale_tril: initial ``u_scale_tril`` ``[M, M]`` or ``[L, M, M]`` (default identity).
    :param bool learn_scale: ``False``: only the mean is a parameter; the scale is passed to ``forward``.

    Parameters: ``u_loc`` ``[M]``/``[L, M]``, ``u_scale_tril`` ``[M, M]``/``[L, M, M]``.
    ``forward()`` returns a :class:`pyro.distributions.MultivariateNormal` with batch shape ``()`` (one output)
    or ``[L, 1]`` (``L`` outputs; the trailing ``1`` is the data plate, see :mod:`pyro_sparsegp.conditionals`).
    """

    def __init__(
        self,
        M: int,
        num_outputs: int | None = None,
        scale_tril: torch.Tensor | None = None,
        learn_scale: bool = True,
    ):
        super().__init__()
        batch = () if num_outputs is None else (num_outputs,)
        dtype = torch.get_default_dtype()
        self.u_loc = PyroParam(torch.zeros(batch + (M,), dtype=dtype), constraints.real)
        self.learn_scale = learn_scale
        if learn_scale:
            if scale_tril is None:
                scale_tril = torch.eye(M, dtype=dtype)
            scale_tril = scale_tril.expand(batch + (M, M)).clone()
            self.u_scale_tril = PyroParam(scale_tril, constraints.lower_cholesky)
        self.num_outputs = num_outputs
        _LIVE.add(self)

    def __setstate__(self, state):
        """Unpickling and ``copy.deepcopy`` (which bypass ``__init__``) register the copy too (shapes as built)."""
        super().__setstate__(state)
        _LIVE.add(self)

    def forward(self, scale_tril: torch.Tensor | None = None) -> dist.MultivariateNormal:
        """``learn_scale=False`` families (a mean only, e.g. ODVGP's q(v)) take their fixed ``scale_tril`` here."""
        loc = self.u_loc
        tril = self.u_scale_tril if self.learn_scale else scale_tril
        if self.num_outputs is not None and tril.dim() == 2:
            tril = tril.expand(self.num_outputs, *tril.shape)
        if self.num_outputs is not None:
            loc, tril = loc.unsqueeze(-2), tril.unsqueeze(-3)  # [L, 1, M], [L, 1, M, M]
        return dist.MultivariateNormal(loc, scale_tril=tril)

    @torch.no_grad()
    def set(self, loc: torch.Tensor, scale_tril: torch.Tensor | None = None) -> None:
        """Overwrite ``(u_loc, u_scale_tril)`` (used by the natural-gradient steps of Hensman, Fusi, Lawrence 2013,
        section 3.2); values keep their constraints. ``loc [M]``/``[L, M]``, ``scale_tril [M, M]``/``[L, M, M]``."""
        self.u_loc = loc.detach().clone()
        if scale_tril is not None:
            self.u_scale_tril = scale_tril.detach().clone()


def to_natural(loc: torch.Tensor, scale_tril: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`(\theta_1, \theta_2) = (S^{-1} m, -\tfrac12 S^{-1})` from ``m`` ``[..., M]`` and
    ``L`` ``[..., M, M]`` (``S = LL^T``): the natural parameters of Hensman, Fusi, Lawrence (2013), section 3.2.
    Returns ``([..., M], [..., M, M])``."""
    eye = torch.eye(loc.shape[-1], dtype=loc.dtype, device=loc.device)
    Linv = torch.linalg.solve_triangular(scale_tril, eye.expand_as(scale_tril), upper=False)
    prec = Linv.mT @ Linv  # [..., M, M]
    return (prec @ loc.unsqueeze(-1)).squeeze(-1), -0.5 * prec


def from_natural(theta1: torch.Tensor, theta2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Inverse of :func:`to_natural` (Hensman, Fusi, Lawrence 2013, section 3.2): ``S = (-2 theta2)^{-1}``,
    ``m = S theta1``. ``theta1 [..., M]``, ``theta2 [..., M, M]``; returns ``(m [..., M], chol(S) [..., M, M])``."""
    prec = -2.0 * theta2
    prec = 0.5 * (prec + prec.mT)
    Lp = cholesky(prec, symmetrize=True)
    S = torch.cholesky_inverse(Lp)
    m = torch.cholesky_solve(theta1.unsqueeze(-1), Lp).squeeze(-1)
    return m, cholesky(S, symmetrize=True)
