r"""Conditionals of sparse GPs: :math:`p(f \mid u)` for a sampled ``u`` and the marginals of
:math:`q(f) = \int p(f \mid u) q(u) du`, as plain functions of explicit tensors.

Glossary (used across the package):

=========  ==========================================================================
``N``      number of data points; ``B`` a minibatch of them
``M``      number of inducing points ``Z`` ``[M, D]`` (or ``[L, M, D]`` per output)
``L``      number of independent outputs (latent GPs, classes, hidden units)
``D``      input dimension
``Luu``    lower Cholesky factor of ``Kuu`` ``[..., M, M]``
``W``      ``Luu^{-1} Kuf`` ``[..., M, B]``
``u_loc``  mean of q(u) ``[..., M]``; ``u_scale_tril`` its lower Cholesky factor ``[..., M, M]``
=========  ==========================================================================

Whitening (``whiten=True``): ``u = Luu v`` with prior ``v ~ N(0, I)``; ``u_loc``/``u_scale_tril`` then describe
q(v). The mean of p(f|u) is ``Kfu Kuu^{-1} u = W^T Luu^{-1} u`` (plain) or ``W^T v`` (whitened); its variance is
``diag(Kff) - sum(W**2, -2)`` either way.

Plate convention: a sample of ``u`` has event shape ``[M]`` and lives outside the data plate, which is the rightmost
batch dimension of ``f``; so a sample of ``u`` with any batch dimension carries a singleton at ``-2`` standing for the
data plate (``[..., L, 1, M]`` for ``L`` outputs, ``[P, 1, M]`` for ``P`` vectorised particles of one output). These
functions honour that convention, which is what makes vectorised particles and nested plates give ``f`` of shape
``[..., L, B]`` (a naive ``u @ W`` would put the particle dimension in the wrong place).
"""

from __future__ import annotations

import torch

from .linalg import solve_lower, whitened_marginals

__all__ = ["project", "conditional_loc", "conditional_var", "qf_terms", "qf_marginals", "whitened_q", "clamp_var"]


def project(Luu: torch.Tensor, Kuf: torch.Tensor) -> torch.Tensor:
    """``W = Luu^{-1} Kuf``: ``Luu`` ``[..., M, M]``, ``Kuf`` ``[..., M, B]`` -> ``[..., M, B]``. The projection in
    :math:`Q_{ff} = K_{fu}K_{uu}^{-1}K_{uf} = W^T W` (Hensman, Fusi, Lawrence 2013, section 2)."""
    return solve_lower(Luu, Kuf)


def _as_rows(u: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """View a sample of ``u`` as ``[..., 1, M]`` rows, honouring the data-plate placeholder (module docstring)."""
    if u.dim() == 1:
        return u.unsqueeze(-2)
    if u.shape[-2] != 1:
        raise ValueError(
            f"u of shape {tuple(u.shape)} must have a singleton data-plate dimension at -2 (u is sampled outside "
            f"the data plate); got size {u.shape[-2]}"
        )
    return u


def conditional_loc(u: torch.Tensor, W: torch.Tensor, Luu: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of :math:`p(f \\mid u)`: ``Kfu Kuu^{-1} u`` (the :math:`\\mu` of Hensman, Fusi, Lawrence 2013, eq. 2).

    :param u: sample of u, ``[M]``, ``[..., 1, M]`` or ``[..., L, 1, M]`` (module docstring).
    :param W: ``Luu^{-1} Kuf`` ``[..., M, B]`` or ``[..., L|1, M, B]``.
    :param Luu: Cholesky factor of ``Kuu``; ``None`` when ``u`` is whitened.
    :returns: ``[..., B]`` or ``[..., L, B]``.
    """
    rows = _as_rows(u, W)  # [..., 1, M]
    if Luu is not None:
        # rows <- rows Luu^{-T}   (solve X Luu^T = rows)
        rows = torch.linalg.solve_triangular(Luu.mT, rows, upper=True, left=False)
    return (rows @ W).squeeze(-2)


def conditional_var(kff_diag: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Variance of :math:`p(f_n \\mid u)`: ``k_nn - sum_m W_mn^2`` (clamped at a tiny positive value), the
    :math:`\\tilde k_{nn}` of Hensman, Fusi, Lawrence (2013), eq. 2. ``kff_diag [..., B]``, ``W [..., M, B]`` (or
    ``[..., L|1, M, B]``) -> ``[..., B]`` (or ``[..., L, B]``)."""
    return clamp_var(kff_diag - W.pow(2).sum(-2))


def qf_terms(
    W: torch.Tensor,
    u_loc: torch.Tensor,
    u_scale_tril: torch.Tensor,
    Luu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contribution of one set of inducing variables to the marginals of q(f): ``(a^T m, -a^T (K - S) a)``
    (see :func:`qf_marginals`; Hensman, Matthews, Ghahramani 2015, eq. 19), unclamped so that contributions can be
    added (SOLVE-GP adds two: Shi, Titsias, Mnih 2020, eqs. 32-34). Shapes as in :func:`qf_marginals`: ``W``
    ``[..., M, B]``, ``u_loc`` ``[M]``, ``u_scale_tril`` ``[M, M]`` (``[L, ...]`` per output) -> two ``[..., B]`` (or
    ``[..., L, B]``). Computed in whitened form by :func:`~pyro_sparsegp.linalg.whitened_marginals`."""
    return whitened_marginals(W, *whitened_q(u_loc, u_scale_tril, Luu))


def whitened_q(u_loc: torch.Tensor, u_scale_tril: torch.Tensor, Luu: torch.Tensor | None = None):
    """``q(u) = N(m, C C^T)`` in whitened coordinates ``v = Luu^{-1} u`` (the whitening of Shi, Titsias, Mnih 2020,
    appendix F): ``(Luu^{-1} m, Luu^{-1} C)`` (``M^3``), or
    ``(m, C)`` unchanged when ``Luu`` is ``None`` (``q`` already whitened). ``u_loc`` ``[(L,) M]``, ``u_scale_tril``
    ``[(L,) M, M]``, ``Luu`` ``[(L,) M, M]`` -> ``[(L,) M]``, ``[(L,) M, M]``."""
    if Luu is None:
        return u_loc, u_scale_tril
    m = solve_lower(Luu, u_loc.unsqueeze(-1)).squeeze(-1)
    return m, solve_lower(Luu, u_scale_tril)


def clamp_var(var: torch.Tensor) -> torch.Tensor:
    """Clamp a variance at a tiny positive value (round-off can make ``k - a^T (K - S) a`` of Hensman, Matthews,
    Ghahramani 2015, eq. 19, slightly negative): the square root of the dtype's smallest normal number. Element-wise,
    any shape ``[...]``."""
    return var.clamp(min=torch.finfo(var.dtype).tiny ** 0.5)


def qf_marginals(
    W: torch.Tensor,
    kff_diag: torch.Tensor,
    u_loc: torch.Tensor,
    u_scale_tril: torch.Tensor,
    Luu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Marginals of :math:`q(f_n) = N(\mu_n, \sigma^2_n)` for :math:`q(u) = N(m, S)`,
    ``S = u_scale_tril u_scale_tril^T``.

    Hensman, Matthews, Ghahramani (2015), eq. 19, diagonal (and Hensman, Fusi, Lawrence 2013, section 3):

    .. math:: \mu_n = a_n^T m, \qquad \sigma^2_n = k_{nn} - a_n^T (K_{uu} - S) a_n, \qquad a_n = K_{uu}^{-1} k_{un}

    (whitened: :math:`a_n = L_{uu}^{-1} k_{un}`, prior covariance ``I``).

    :param W: ``Luu^{-1} Kuf`` ``[..., M, B]`` (or ``[..., L|1, M, B]``).
    :param kff_diag: ``[..., B]``.
    :param u_loc: ``[M]`` or ``[L, M]``.
    :param u_scale_tril: ``[M, M]`` or ``[L, M, M]``.
    :param Luu: Cholesky factor of ``Kuu``, or ``None`` for whitened q(u).
    :returns: ``(loc, var)`` each ``[..., B]`` or ``[..., L, B]``.
    """
    loc, dvar = qf_terms(W, u_loc, u_scale_tril, Luu)
    return loc, clamp_var(kff_diag + dvar)
