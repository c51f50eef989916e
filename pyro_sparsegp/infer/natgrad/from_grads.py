r"""Natural gradients from the ELBO's own gradient (what ``fit`` uses: no second forward pass): the step on a
full-covariance Gaussian q (Hensman, Fusi, Lawrence 2013, section 3.2; the positive-definite step of Lin, Schmidt,
Khan 2020), and the Fisher-scoring step on a Gaussian likelihood's noise (Hensman et al. 2013, eq. 4)."""

from __future__ import annotations

import torch
from pyro.distributions.transforms import LowerCholeskyTransform, transform_to

from ...context import deferred
from .damping import _damp

__all__ = ["natgrad_from_grads_", "noise_step_from_grads_"]


# -- natural gradients from the ELBO's own gradient (what fit uses: no second forward pass) ----------------------
def _constrained_grad(q, name):
    """``(value, grad, raw)``: the constrained value of the PyroParam ``name`` of ``q``, the gradient of the loss with
    respect to it (from that of the unconstrained parameter ``raw``: the lower-Cholesky transform
    ``x.tril(-1) + diag(exp(diag x))`` has derivative 1 below the diagonal and ``L_ii`` on it) and ``raw`` itself."""
    raw = getattr(q, f"{name}_unconstrained")
    transform = transform_to(q._pyro_params[name][0])
    x = raw.detach()
    if raw.grad is None:
        return transform(x), None, raw
    if isinstance(transform, LowerCholeskyTransform):  # x.tril(-1) + diag(exp(diag x)): derivative 1 and L_ii
        value = transform(x)
        grad = raw.grad.tril(-1)
        grad.diagonal(dim1=-2, dim2=-1).copy_(raw.grad.diagonal(dim1=-2, dim2=-1) / value.diagonal(dim1=-2, dim2=-1))
        return value, grad, raw
    if transform is torch.distributions.transforms.identity_transform:
        return x, raw.grad, raw
    raise TypeError(f"natural-gradient steps need {name} constrained to real or lower_cholesky, got {transform}")


def _set_constrained(q, name, raw, value):
    """Write the constrained ``value`` into the unconstrained parameter ``raw`` in place."""
    transform = transform_to(q._pyro_params[name][0])
    if isinstance(transform, LowerCholeskyTransform):  # value is lower triangular with a positive diagonal
        raw.copy_(value)
        raw.diagonal(dim1=-2, dim2=-1).log_()
    else:
        raw.copy_(transform.inv(value))


@torch.no_grad()
def natgrad_from_grads_(q, lr: float, retraction: bool = False) -> None:
    r"""A natural-gradient step of length ``lr`` on a full-covariance :class:`~pyro_sparsegp.variational.GaussianQ`
    ``q = N(m, L L^T)`` (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``), from the gradient of the loss
    :math:`\ell = -\mathcal{L}` (the negative ELBO) that a backward pass left in its parameters' ``.grad``.

    The natural gradient is the gradient with respect to the expectation parameters (Hensman, Fusi, Lawrence 2013,
    section 3.2; module docstring): :math:`\theta \leftarrow \theta + \rho\,\nabla_\eta\mathcal{L}`, i.e. with
    :math:`\Lambda = S^{-1}`, :math:`X = \nabla_S\mathcal{L}` (symmetric) and :math:`g = \nabla_m\mathcal{L}`,

    .. math:: \Lambda' = \Lambda - 2\rho X, \qquad m' = m + \rho\,\Lambda'^{-1} g.

    Neither :math:`S`, :math:`\Lambda` nor :math:`X` is formed. With :math:`G = \nabla_L\ell` (lower triangular) the
    Cholesky backward identity (Murray 2016) gives :math:`2L^T X L = -\Psi`, :math:`\Psi = \Phi(L^TG) + \Phi(L^TG)^T`
    (:math:`\Phi`: lower triangle with halved diagonal), so :math:`\Lambda' = L^{-T} K L^{-1}` with
    :math:`K = I + \rho\Psi`, and

    .. math:: L' = L\,E,\quad E = J D^{-T} J,\quad D = \mathrm{chol}(JKJ), \qquad
              m' = m - \rho\, L E E^T L^T \nabla_m\ell

    (:math:`J` the exchange matrix; :math:`E` is lower triangular with :math:`EE^T = K^{-1}`, and
    :math:`L'^T = J D^{-1} J L^T` is one triangular solve). Cost: one product, one Cholesky and one triangular solve
    of ``M``-square matrices, independent of the batch: the data enter through the gradient only. The prior enters
    through the gradient of the KL term, so the step is the same for whitened and plain parameterisations and for
    any prior covariance (``Kuu``, SOLVE-GP's ``Cvv``).

    With the closed-form bound on the full data and a Gaussian likelihood, a step of length 1 lands on the optimal
    ``q`` given the other factors (Hensman 2013 eq. 5-6 for q(u); for SOLVE-GP's q(v⊥) the optimum of eq. 8 given
    q(u), whose fixed point with q(u) is eqs. 28-29 of Shi, Titsias, Mnih 2020). For ``0 < lr <= 1`` and a
    log-concave likelihood ``K`` is positive definite; otherwise the step is damped (halved per output until it is,
    with a :class:`NatGradDampingWarning` once) on the CPU; on a GPU (no host synchronisation) a failed factorisation
    makes the update NaN, and ``fit``'s guard restores the last good state and names the step.

    With ``retraction=True`` the precision takes the step of Lin, Schmidt, Khan (2020), "Handling the
    positive-definite constraint in the Bayesian learning rule" (ICML), eq. 7 (their "improved Bayesian learning
    rule"): :math:`\Lambda' = \Lambda + \rho\hat G + \tfrac{\rho^2}{2}\hat G\Lambda^{-1}\hat G` with
    :math:`\hat G = -2X`, i.e. :math:`K = I + \rho\Psi + \tfrac{\rho^2}{2}\Psi^2 = \tfrac12 I +
    \tfrac12 (I + \rho\Psi)^2`, whose eigenvalues are at least 1/2 for **any** gradient: the precision stays
    positive definite by construction, whatever the curvature of the likelihood (robust-max, a Monte Carlo
    gradient, a hidden layer of a deep GP), so damping never triggers except on non-finite input. It agrees with
    the plain step to first order in :math:`\rho` and has the same fixed points (:math:`\Psi = 0`); it is not
    exact at ``lr = 1`` for a Gaussian likelihood (``fit`` uses it for non-conjugate terms only). One more
    ``M``-square product per step.

    :param q: a ``GaussianQ`` with ``learn_scale=True`` whose ``u_loc``/``u_scale_tril`` gradients are populated.
    :param float lr: step length :math:`\rho`.
    :param bool retraction: the positive-definite step of Lin et al. (2020) above instead of the plain one.
    """
    m, g_m, raw_m, L_new, raw_L, rho = _precision_step(q, lr, retraction)[:6]
    t = L_new.mT @ g_m.unsqueeze(-1)  # L'^T g
    m_new = m - rho.unsqueeze(-1) * (L_new @ t).squeeze(-1)
    _set_constrained(q, "u_loc", raw_m, m_new)
    _set_constrained(q, "u_scale_tril", raw_L, L_new)  # lower triangular: the solve keeps L^T's zeros exactly


def _precision_step(q, lr: float, retraction: bool = False):
    """The covariance half of :func:`natgrad_from_grads_` (its docstring): ``(m, g_m, raw_m, L', raw_L, rho, L, Psi)``
    with ``L'`` the new scale (``L' L'^T = Lambda'^{-1}``), ``rho`` the step length per output after damping, ``L``
    the current scale and ``Psi`` (so that ``L^{-T}(I + Psi)L^{-1}`` is the length-1 precision, the Hessian block
    that :func:`solvegp_joint_natgrad_from_grads_` uses)."""
    if not getattr(q, "learn_scale", False):
        raise ValueError("natgrad_from_grads_ needs a full-covariance GaussianQ (learn_scale=True)")
    m, g_m, raw_m = _constrained_grad(q, "u_loc")
    L, G, raw_L = _constrained_grad(q, "u_scale_tril")
    if g_m is None or G is None:
        raise ValueError("natgrad_from_grads_: the variational parameters have no gradient; call backward() first")
    Phi = (L.mT @ G).tril_()  # G is lower triangular (the gradient of a lower-triangular parameter)
    Phi.diagonal(dim1=-2, dim2=-1).mul_(0.5)
    Psi = Phi + Phi.mT
    rho = torch.full(Psi.shape[:-2], float(lr), dtype=Psi.dtype, device=Psi.device)  # one length per output

    def factor(rho):
        K = Psi * rho[..., None, None]
        K.diagonal(dim1=-2, dim2=-1).add_(1.0)
        if retraction:  # Lin, Schmidt, Khan 2020: K = (I + (I + rho Psi)^2) / 2, PD for any Psi
            K = K @ K.mT
            K.diagonal(dim1=-2, dim2=-1).add_(1.0)
            K = 0.25 * (K + K.mT)
        D, info = torch.linalg.cholesky_ex(K.flip(-1, -2))  # chol(J K J)
        # cuSOLVER reports no failure for a NaN matrix (LAPACK does): a non-finite factor fails on every device
        return D, torch.where(torch.isfinite(D).flatten(-2).all(-1), info, info.clamp(min=1))

    D, info = factor(rho)
    checks = deferred.active()
    if checks is None or checks.damp_at_once:  # (outside fit on a GPU too: a read per step, but no NaN update)
        D, rho = _damp(factor, D, info, rho, lr, retraction)
    else:  # no host read: an output whose step needs damping keeps its q and is flagged; fit redoes the window
        checks.record(checks.DAMPING, info > 0)  # with the halving at once (deferred.py)
        rho = torch.where(info > 0, 0.0, rho)
    frozen = rho == 0  # a frozen output keeps its q: L' = L, and no step for its mean (0 * nan is nan)
    D = torch.where(frozen[..., None, None], torch.eye(D.shape[-1], dtype=D.dtype, device=D.device), D)
    g_m = torch.where(frozen[..., None], 0.0, g_m)
    # L' = L J D^{-T} J, i.e. L'^T = J D^{-1} (J L^T): one triangular solve, no inverse, no product
    L_new = torch.linalg.solve_triangular(D, L.mT.flip(-2), upper=False).flip(-2).mT
    return m, g_m, raw_m, L_new, raw_L, rho, L, Psi


@torch.no_grad()
def noise_step_from_grads_(likelihood, lr: float, num_obs) -> None:
    r"""A Fisher-scoring step of length ``lr`` on the noise variance :math:`\sigma^2` of a
    :class:`~pyro_sparsegp.Gaussian` likelihood, from the gradient of the loss :math:`\ell = -\mathcal{L}` that a
    backward pass left in ``likelihood.noise_unconstrained.grad``; the noise's companion of
    :func:`natgrad_from_grads_` (same pass, same step length).

    Every bound of this package depends on :math:`\sigma^2` only through the expected log-likelihood, which for
    :math:`n` observations is :math:`-\tfrac n2\log\sigma^2 - S/(2\sigma^2) + c` with
    :math:`S = \sum_n \mathbb{E}_q[(y_n - f_n)^2]` (Hensman, Fusi, Lawrence 2013, eq. 4; a minibatch estimates
    ``S`` with the ``N / B`` scaling, a Monte Carlo bound with its samples). Its maximiser given q(f) is
    :math:`S/n`, and its Fisher information is :math:`n / (2\sigma^4)`. The step

    .. math:: \sigma^2 \leftarrow \sigma^2 + \rho\,\frac{2\sigma^4}{n}\,\frac{\partial\mathcal{L}}{\partial
              \sigma^2} = (1-\rho)\,\sigma^2 + \rho\,\frac{S}{n}

    therefore lands on the optimum given q(f) at ``lr = 1`` on the full data, and otherwise moves a fraction ``lr``
    of the way: a running average of the minibatch estimates of :math:`S/n`, whatever the current :math:`\sigma^2`
    (Adam on :math:`\log\sigma^2` moves at most about its learning rate per step). A step that would leave the
    constraint's support (possible only at ``lr = 1`` by rounding) keeps the old value. No host synchronisation.

    :param likelihood: a ``Gaussian`` whose ``noise`` is a ``PyroParam`` (a scalar ``()``).
    :param float lr: step length :math:`\rho` in ``(0, 1]``.
    :param num_obs: :math:`n`, the number of scalar observations the bound's likelihood term stands for (``N``
        for ``y [N]``, ``N L`` for ``y [N, L]``).
    """
    raw = likelihood.noise_unconstrained
    if raw.grad is None:
        raise ValueError("noise_step_from_grads_: the noise has no gradient; call backward() first")
    constraint = likelihood._pyro_params["noise"][0]
    transform = transform_to(constraint)
    x = raw.detach()
    var = transform(x)
    dvar_dx = transform.log_abs_det_jacobian(x, var).exp()  # a scalar transform: its derivative
    g = -raw.grad / dvar_dx  # d ELBO / d sigma^2
    new = var + lr * 2.0 * var.square() / num_obs * g
    new = torch.where(constraint.check(new), new, var)
    raw.copy_(transform.inv(new))
