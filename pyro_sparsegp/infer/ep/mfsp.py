r"""The sparse mean-field method ("MFSp") of Hensman, Matthews and Ghahramani (2015), "Scalable variational Gaussian
process classification" (AISTATS), section 3.1, the baseline of their table 1, for binary probit classification.

The probit model is augmented with ``g = f + e``, ``e ~ N(0, I)``: ``p(y, g, f) = prod_n B(y_n | Theta(g_n))
N(g | f, I) N(f | 0, K)``. Titsias' bound on ``p(g)`` with ``M`` inducing inputs (their eq. 10) gives
``p(y, g) >= prod_n B(y_n | Theta(g_n)) N(g | 0, Q + I) exp(-tr(K - Q) / 2)``, ``Q = K_nm K_mm^{-1} K_mn``. With a
factorised ``q(g) = prod_n q(g_n)`` the optimal factors (their eq. 11) are truncated Gaussians
``q(g_n) ∝ B(y_n | Theta(g_n)) N(g_n | a_n, s_n^2)``, ``s_n^{-2} = [(Q + I)^{-1}]_nn``, with ``N`` free means
``a_n``, and the bound (their eq. 12) is

.. math:: \sum_n \log\gamma_n - \tfrac12\log|Q+I| - \tfrac12\mathrm{tr}\big((Q+I)^{-1}E[gg^T]\big)
          + \tfrac12\sum_n\Big\{\log s_n^2 + \frac{E[(a_n-g_n)^2]}{s_n^2}\Big\} - \tfrac12\mathrm{tr}(K-Q),

``gamma_n = Phi(y_n a_n / s_n)`` (``y`` in ``{-1, +1}``), with the truncated-normal moments in closed form. The
``N``-vector ``a`` is a free parameter, so the method does not admit minibatches (their point). Everything is
``O(N M^2)`` through ``B = I + W W^T``, ``W = L_mm^{-1} K_mn`` (Woodbury).

:func:`fit_mfsp` maximises eq. 12 jointly over ``a``, the kernel and ``Z`` by L-BFGS (the paper alternates an
``O(N M)`` inner loop over ``a`` with outer steps; the optimum is the same), then writes the Gaussian
``q(u) = N(Sigma K_mm^{-1} K_mn E[g], Sigma)``, ``Sigma = K_mm - K_mn (Q + I)^{-1} K_nm`` (their prediction rule: the
posterior of ``u`` given ``g = E[g]``) into ``module.q_u``; the module's probit predictive ``Phi(m / sqrt(1 + v))``
is then the MFSp prediction (``g`` has the unit noise the probit carries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ... import covariances as cov
from ...likelihoods import Bernoulli
from ...linalg import KUU_INVERSE_ADVICE, cholesky, project_chol

__all__ = ["fit_mfsp", "mfsp_bound", "MFSpState"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _check(module, X, y):
    if not (isinstance(module.likelihood, Bernoulli) and module.likelihood.link == "probit"):
        raise ValueError("MFSp needs SVGP(kernel, Z, Bernoulli('probit')) (binary probit classification)")
    if module.num_outputs is not None:
        raise ValueError("MFSp is for a single latent function (num_outputs=None)")
    if X.dim() != 2 or y.shape != X.shape[:1]:
        raise ValueError(f"X must be [N, D] and y [N], got {tuple(X.shape)} and {tuple(y.shape)}")
    module.likelihood.check_y(y)


def _pieces(module, X):
    Kmm = cov.Kuu(module.inducing, module.kernel)  # the pair's covariances: inducing points or patches alike
    L = cholesky(Kmm, module.jitter, warn_singular=KUU_INVERSE_ADVICE, symmetrize=True)
    (W,) = project_chol(Kmm, L, cov.Kuf(module.inducing, module.kernel, X))  # [M, N]
    eye = torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
    # B = I + W W^T: |Q + I| = |B|, (Q + I)^{-1} = I - W^T B^{-1} W
    Lb = cholesky(eye + W @ W.mT, symmetrize=True)
    return L, W, Lb, cov.Kdiag(module.kernel, X)


def _moments(a, sgn, s2):
    """Truncated-normal ``q(g_n)``: ``(log gamma, E g, Var g)``."""
    s = s2.sqrt()
    z = sgn * a / s
    log_gamma = torch.special.log_ndtr(z)
    lam = torch.exp(-0.5 * z.pow(2) - _HALF_LOG_2PI - log_gamma)
    return log_gamma, a + sgn * s * lam, s2 * (1 - lam * (lam + z))


def mfsp_bound(module, X: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Eq. 12 of Hensman, Matthews, Ghahramani (2015) (module docstring) for inputs ``X`` ``[N, D]``, labels ``y``
    ``[N]`` in ``{0, 1}`` and the free means ``a`` ``[N]``; differentiable in ``a``, the kernel and ``Z``."""
    _, W, Lb, kdiag = _pieces(module, X)
    sgn = 2.0 * y - 1.0
    V = torch.linalg.solve_triangular(Lb, W, upper=False)  # [M, N]
    ainv_diag = 1.0 - V.pow(2).sum(0)  # [(Q + I)^{-1}]_nn
    s2 = 1.0 / ainv_diag
    log_gamma, Eg, Vg = _moments(a, sgn, s2)
    quad = Eg.pow(2).sum() - (V @ Eg).pow(2).sum() + (ainv_diag * Vg).sum()  # tr((Q + I)^{-1} E[g g^T])
    ent = 0.5 * (s2.log() + ((a - Eg).pow(2) + Vg) / s2).sum()
    logdet = 2 * Lb.diagonal().log().sum()
    return log_gamma.sum() - 0.5 * logdet - 0.5 * quad + ent - 0.5 * (kdiag - W.pow(2).sum(0)).sum()


@dataclass
class MFSpState:
    """Result of :func:`fit_mfsp`: the free means ``a`` ``[N]`` and the bound after each L-BFGS evaluation.
    ``a_n`` are the means of the optimal truncated-Gaussian factors :math:`q(g_n)` of Hensman, Matthews, Ghahramani
    2015, section 3.1, eq. 11."""

    a: torch.Tensor
    bounds: list = field(default_factory=list)


def _closure(module, X, y, a, params, state):
    for p in params:
        p.grad = None
    loss = -mfsp_bound(module, X, y, a) / X.shape[0]
    loss.backward()
    state.bounds.append(-loss.item() * X.shape[0])
    return loss


@torch.no_grad()
def _write_q(module, X, y, a):
    L, W, Lb, _ = _pieces(module, X)
    V = torch.linalg.solve_triangular(Lb, W, upper=False)
    _, Eg, _ = _moments(a, 2.0 * y - 1.0, 1.0 / (1.0 - V.pow(2).sum(0)))
    mean_v = torch.cholesky_solve((W @ Eg).unsqueeze(-1), Lb).squeeze(-1)  # whitened: B^{-1} W E[g]
    eye = torch.eye(Lb.shape[0], dtype=Lb.dtype, device=Lb.device)
    Lbi = torch.linalg.solve_triangular(Lb, eye, upper=False)
    S_v = Lbi.mT @ Lbi  # B^{-1}
    St = cholesky(S_v, symmetrize=True)
    if module.whiten:
        module.q_u.set(mean_v, St)
    else:
        module.q_u.set(L @ mean_v, L @ St)


def fit_mfsp(
    module,
    X: torch.Tensor,
    y: torch.Tensor,
    num_iters: int = 300,
    learn_hyperparameters: bool = True,
    frozen_iters: int = 50,
) -> MFSpState:
    """Fit MFSp (module docstring) to ``module`` = ``SVGP(kernel, Z, Bernoulli("probit"))`` and write ``q(u)``:
    the sparse mean-field method of Hensman, Matthews, Ghahramani 2015, section 3.1 (factors of eq. 11).

    :param X: ``[N, D]``. :param y: ``[N]`` in ``{0, 1}``.
    :param num_iters: L-BFGS iterations on ``(a, kernel, Z)`` jointly.
    :param frozen_iters: L-BFGS iterations on ``a`` alone first (hyper-parameters frozen, as table 1's KLSp runs).
    :returns: :class:`MFSpState`.
    """
    _check(module, X, y)
    a = torch.zeros_like(y, dtype=X.dtype).requires_grad_(True)
    state = MFSpState(a)
    hyper = [p for n, p in module.named_parameters() if not n.startswith("q_u")] if learn_hyperparameters else []
    for params, iters in (([a], frozen_iters), ([a] + hyper, num_iters)):
        if iters <= 0:
            continue
        opt = torch.optim.LBFGS(params, lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")
        opt.step(lambda params=params: _closure(module, X, y, a, params, state))
    state.a = a.detach()
    _write_q(module, X, y, state.a)
    return state
