r"""Natural-gradient steps for q(u) of an SVGP from the likelihood's closed forms (Hensman, Fusi, Lawrence 2013,
section 3.2): the conjugate Gaussian step (their eqs. 5-6), the Pólya-Gamma step of Wenzel et al. (2019), and the
autograd step for any other likelihood; :func:`natgrad_step_for` picks one. Each runs its own forward pass on the
minibatch (:func:`pyro_sparsegp.infer.natgrad.from_grads.natgrad_from_grads_` reuses the ELBO's backward pass
instead)."""

from __future__ import annotations

import torch

from ...distributions.polya_gamma import pg_mean
from ...likelihoods import Gaussian, PolyaGammaLogit
from ...likelihoods.polya_gamma import optimal_c
from ...linalg import solve_lower
from ...variational import from_natural, to_natural
from .damping import _damped_length, check_natgrad_lr

__all__ = ["natgrad_step", "gaussian_natgrad_step", "polya_gamma_natgrad_step", "natgrad_step_for"]


def _check_step_data(svgp, X, y):
    X, y = svgp.check_inputs(X, y)
    if svgp.likelihood is None:
        raise ValueError("natural-gradient steps need a module with a likelihood")
    if getattr(svgp, "num_latents", None) is not None or (y.is_floating_point() and bool(torch.isnan(y).any())):
        raise ValueError("these closed-form steps take independent, fully observed outputs; for an LMC layer "
                         "(num_latents) or missing outputs (NaN in y) use fit or NaturalGradient (steps from the "
                         "gradients of the bound)")


def _prior_natural(svgp, Luu):
    M = svgp.inducing.num_inducing
    eye = torch.eye(M, dtype=Luu.dtype, device=Luu.device)
    if svgp.whiten:
        prec = eye
    else:
        Linv = solve_lower(Luu, eye.expand_as(Luu))
        prec = Linv.mT @ Linv
    return -0.5 * prec


def _A(svgp, Luu, W):
    return W if svgp.whiten else solve_lower(Luu, W, transpose=True)


def _targets(svgp, y):
    if svgp.likelihood.latent_dim == 1 and y.dtype != svgp.inducing.dtype:
        y = y.to(svgp.inducing.dtype)  # integer or boolean labels
    if svgp.num_outputs is not None and svgp.likelihood.latent_dim == 1:
        return y.mT  # [L, B]
    return y


@torch.no_grad()
def _apply(svgp, g1, g2, Luu, lr):
    q = svgp.q_u
    theta1, theta2 = to_natural(q.u_loc, q.u_scale_tril)
    p2 = _prior_natural(svgp, Luu)
    if svgp.num_outputs is not None and p2.dim() == 2:
        p2 = p2.expand(svgp.num_outputs, *p2.shape)
    rho = _damped_length(theta2, p2 + g2, lr)  # [...]: lr, halved where the step leaves the PD cone
    r1, r2 = rho.unsqueeze(-1), rho[..., None, None]
    new1 = (1 - r1) * theta1 + r1 * g1
    new2 = (1 - r2) * theta2 + r2 * (p2 + g2)
    new1 = torch.where(r1 == 0, theta1, new1)  # a frozen output keeps its q(u) (0 * nan is nan)
    new2 = torch.where(r2 == 0, theta2, new2)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # data-parallel: the step is linear in each rank's data term, so averaging the new natural parameters
        # over ranks is the step with the averaged (larger-batch) data term
        world = torch.distributed.get_world_size()
        for t in (new1, new2):
            torch.distributed.all_reduce(t)
            t.div_(world)
    m, L = from_natural(new1, new2)
    q.set(m, L)


def _squeeze_outputs(svgp, Luu, W, kdiag):
    if getattr(svgp, "mean_function", None) is not None:
        raise ValueError("these natural-gradient steps assume a zero mean function; train a layer with a mean "
                         "function with Adam (or with natural gradients from the backward pass)")
    if svgp.num_outputs is not None:
        if Luu.dim() == 2:
            Luu = Luu.expand(svgp.num_outputs, *Luu.shape)
        W = W.expand(svgp.num_outputs, *W.shape[-2:])
        kdiag = kdiag.expand(svgp.num_outputs, kdiag.shape[-1])
    return Luu, W, kdiag


def gaussian_natgrad_step(svgp, X: torch.Tensor, y: torch.Tensor, lr: float = 1.0, num_data: int | None = None):
    """Closed-form natural-gradient step for q(u) of an :class:`~pyro_sparsegp.SVGP` with a Gaussian likelihood
    on the minibatch ``(X, y)`` of a data set of ``num_data`` points (default: ``len(X)``, the full batch).
    ``X`` ``[B, D]``; ``y`` ``[B]`` (single output) or ``[B, L]``. Updates q(u) in place; returns nothing.
    Hensman, Fusi, Lawrence 2013, section 3.2 (eq. 6 and the step below it), with the gradient terms of their eqs.
    5-6 scaled by ``num_data / B`` (see the module docstring)."""
    if not isinstance(svgp.likelihood, Gaussian):
        raise TypeError("gaussian_natgrad_step needs a Gaussian likelihood; use natgrad_step")
    lr = check_natgrad_lr(lr)
    _check_step_data(svgp, X, y)
    with torch.no_grad():
        Luu, W, kdiag = _squeeze_outputs(svgp, *svgp.strategy.factors(X, consume=True))
        scale = (num_data or X.shape[-2]) / X.shape[-2]
        beta = 1.0 / svgp.likelihood.noise
        A = _A(svgp, Luu, W)  # [(L,) M, B]
        yt = _targets(svgp, y)
        g1 = beta * scale * (A @ yt.unsqueeze(-1)).squeeze(-1)
        g2 = -0.5 * beta * scale * (A @ A.mT)
        _apply(svgp, g1, g2, Luu, lr)


def natgrad_step(svgp, X: torch.Tensor, y: torch.Tensor, lr: float = 0.1, num_data: int | None = None):
    """Natural-gradient step for q(u) of an :class:`~pyro_sparsegp.SVGP` with any likelihood (expected
    log-likelihood by the likelihood's quadrature or closed form). See the module docstring (damping).
    ``X`` ``[B, D]``; ``y`` ``[B]`` (single output) or ``[B, L]`` (``[B]`` class labels for a multi-class
    likelihood). Updates q(u) in place; returns nothing. The step :math:`\\theta \\leftarrow \\theta + \\ell\\,
    \\partial\\mathcal{L}/\\partial\\eta` of Hensman, Fusi, Lawrence 2013, section 3.2 (eq. 6), with the
    likelihood term's gradient by automatic differentiation (Hensman, Matthews, Ghahramani 2015, eq. 21 data term)."""
    lr = check_natgrad_lr(lr)
    _check_step_data(svgp, X, y)
    with torch.no_grad():
        Luu, W, kdiag = _squeeze_outputs(svgp, *svgp.strategy.factors(X, consume=True))
        A = _A(svgp, Luu, W)
        q = svgp.q_u
        m0 = q.u_loc.detach()
        L0 = q.u_scale_tril.detach()
        S0 = L0 @ L0.mT
    scale = (num_data or X.shape[-2]) / X.shape[-2]
    with torch.enable_grad():
        m = m0.clone().requires_grad_(True)
        S = S0.clone().requires_grad_(True)
        loc = (m.unsqueeze(-2) @ A).squeeze(-2)
        var = (kdiag - W.pow(2).sum(-2) + (A * (S @ A)).sum(-2)).clamp(min=1e-12)
        ell = svgp.likelihood.expected_log_prob(_targets(svgp, y), loc, var).sum() * scale
        gm, gS = torch.autograd.grad(ell, (m, S))
    with torch.no_grad():
        gS = 0.5 * (gS + gS.mT)
        g1 = gm - 2 * (gS @ m0.unsqueeze(-1)).squeeze(-1)
        _apply(svgp, g1, gS, Luu, lr)


def polya_gamma_natgrad_step(svgp, X, y, lr: float = 1.0, num_data: int | None = None, c: torch.Tensor | None = None):
    r"""Closed-form natural-gradient step of Wenzel et al. (2019) for an :class:`~pyro_sparsegp.SVGP` with the
    Pólya-Gamma logit likelihood, on the minibatch ``(X, y)`` (labels in ``{0, 1}``, ``s = 2y - 1``):

    .. math:: c_n = \sqrt{\mathbb{E}_q f_n^2},\quad
              \hat\theta_1 = \tfrac{N}{2B}\,\kappa^T s,\quad
              \hat\theta_2 = -\tfrac12\big(K_{uu}^{-1} + \tfrac{N}{B}\,\kappa^T \mathrm{diag}(\bar\omega)\,\kappa\big),
              \quad \theta \leftarrow (1-\rho)\theta + \rho\hat\theta,

    :math:`\kappa = K_{fu}K_{uu}^{-1}` (``W^T`` whitened, with prior precision ``I``),
    :math:`\bar\omega_n = \mathbb{E}_{\mathrm{PG}(1,c_n)}[\omega] = \tanh(c_n/2)/(2c_n)`. (The poster prints
    :math:`\theta_n = \tanh(c_n/2)/(4c_n)`; differentiating the bound gives the PG mean above, and the test
    against the dense optimum confirms it.) ``c`` fixes the local parameters instead of updating them first.

    Shapes: ``X`` ``[B, D]``, ``y`` ``[B]`` (or ``[B, L]``), ``c`` ``[B]`` (``[L, B]``); :math:`\kappa` is
    ``[B, M]``. Updates q(u) in place; returns nothing.
    """
    lr = check_natgrad_lr(lr)
    _check_step_data(svgp, X, y)
    with torch.no_grad():
        Luu, W, kdiag = _squeeze_outputs(svgp, *svgp.strategy.factors(X, consume=True))
        A = _A(svgp, Luu, W)  # [(L,) M, B]
        if c is None:
            q = svgp.q_u
            loc = (q.u_loc.unsqueeze(-2) @ A).squeeze(-2)
            var = kdiag - W.pow(2).sum(-2) + (q.u_scale_tril.mT @ A).pow(2).sum(-2)
            c = optimal_c(loc, var)
        scale = (num_data or X.shape[-2]) / X.shape[-2]
        s = 2 * _targets(svgp, y) - 1
        w = pg_mean(c)
        g1 = 0.5 * scale * (A @ s.unsqueeze(-1)).squeeze(-1)
        g2 = -0.5 * scale * ((A * w.unsqueeze(-2)) @ A.mT)
        _apply(svgp, g1, g2, Luu, lr)


def natgrad_step_for(likelihood):
    """The natural-gradient step that fits a likelihood: closed form for Gaussian and Pólya-Gamma logit,
    the autograd step otherwise (Hensman, Fusi, Lawrence 2013, section 3.2; Wenzel et al. 2019)."""
    if isinstance(likelihood, Gaussian):
        return gaussian_natgrad_step
    if isinstance(likelihood, PolyaGammaLogit):
        return polya_gamma_natgrad_step
    return natgrad_step
