r"""The structured-covariance view of SOLVE-GP (Shi, Titsias, Mnih 2020, section 3.3): the Gaussian over the union
of the inducing sets that a layer's ``q(u) q(v⊥)`` induces. :meth:`~pyro_sparsegp.SOLVEGP.to_svgp` uses it to turn a
SOLVE-GP layer into the equivalent SVGP; :mod:`pyro_sparsegp.bounds.solvegp` checks it against the dense bound."""

from __future__ import annotations

import torch

from ..linalg import cholesky, solve_lower

__all__ = ["structured_svgp_params"]


def _matvec(M, v):
    return (M @ v.unsqueeze(-1)).squeeze(-1)


def structured_svgp_params(Kuu, Kuv, m_u, L_u, m_v, L_v, return_scale_tril=False, jitter=None):
    r"""Section 3.3 ("Structured Covariance"): the Gaussian :math:`q(u, v) = N(m_{u,v}, S_{u,v})` over the union
    ``{Z, O}`` induced by :math:`q(u)q(v_\perp)` through :math:`v = v_\perp + K_{vu}K_{uu}^{-1}u`:

    .. math:: m_{u,v} = \begin{bmatrix} m_u \\ m_v + K_{vu}K_{uu}^{-1}m_u \end{bmatrix},\qquad
              S_{u,v} = \begin{bmatrix} S_u & S_uK_{uu}^{-1}K_{uv} \\
                        K_{vu}K_{uu}^{-1}S_u & S_v + K_{vu}K_{uu}^{-1}S_uK_{uu}^{-1}K_{uv}\end{bmatrix}.

    SVGP over ``{Z, O}`` with this ``q(u, v)`` has the same ``q(f)`` and the same KL as SOLVE-GP (so the same eq. 8).
    ODVGP's :math:`S'_{u,v}` (section 5) is the case :math:`S_v = C_{vv}`. Parameters are un-whitened (see
    :func:`~pyro_sparsegp.bounds.solvegp.unwhiten_params`). This dense ``(M + M2)``-square view is for analysis and
    tests, not for training.

    :param return_scale_tril: return the lower Cholesky factor
        :math:`\begin{bmatrix} L_u & 0\\ K_{vu}K_{uu}^{-1}L_u & L_v\end{bmatrix}` of :math:`S_{u,v}` instead of
        :math:`S_{u,v}` (lower-triangular because the map :math:`(u, v_\perp) \mapsto (u, v)` is).
    :returns: ``(m_uv [..., M + M2], S_uv or L_uv [..., M + M2, M + M2])``.
    """
    Luu = cholesky(Kuu, jitter, symmetrize=True)
    P = solve_lower(Luu, solve_lower(Luu, Kuv), transpose=True).mT  # [..., M2, M]   Kvu Kuu^{-1}
    M, M2 = L_u.shape[-1], L_v.shape[-1]
    mv = m_v + _matvec(P, m_u)  # [..., M2]
    mb = torch.broadcast_shapes(m_u.shape[:-1], mv.shape[:-1])
    m_uv = torch.cat([m_u.expand(mb + (M,)), mv.expand(mb + (M2,))], -1)  # [..., M + M2]
    PL = P @ L_u  # [..., M2, M]
    batch = torch.broadcast_shapes(L_u.shape[:-2], L_v.shape[:-2], PL.shape[:-2])
    zeros = torch.zeros(batch + (M, M2), dtype=L_u.dtype, device=L_u.device)
    L_uv = torch.cat(
        [
            torch.cat([L_u.expand(batch + (M, M)), zeros], -1),
            torch.cat([PL.expand(batch + (M2, M)), L_v.expand(batch + (M2, M2))], -1),
        ],
        -2,
    )  # [..., M + M2, M + M2]
    if return_scale_tril:
        return m_uv, L_uv
    return m_uv, L_uv @ L_uv.mT
