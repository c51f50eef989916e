r"""Natural-gradient steps for q(u) (Hensman, Fusi, Lawrence 2013, section 3.2).

With natural parameters :math:`\theta = (S^{-1}m, -\tfrac12 S^{-1})` and expectation parameters
:math:`\eta = (m, S + mm^T)`, the natural gradient of the ELBO is its ordinary gradient with respect to
:math:`\eta`. Because :math:`\nabla_\eta(-\mathrm{KL}[q\|p]) = \theta_p - \theta`, a step of length :math:`\rho` is

.. math:: \theta \leftarrow (1-\rho)\,\theta + \rho\,(\theta_p + g), \qquad
          g = \tfrac{N}{B}\,\nabla_\eta \sum_{n \in \text{batch}} \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)].

For a Gaussian likelihood :math:`g` is closed form (Hensman 2013 eqs. 5-6 with the minibatch scaling of section
3.2): :math:`g_1 = \beta\tfrac{N}{B} A y`, :math:`g_2 = -\tfrac{\beta}{2}\tfrac{N}{B} A A^T`, with
:math:`A = K_{uu}^{-1}K_{uf}` (or :math:`L_{uu}^{-1}K_{uf}` whitened), and a full-batch step of length 1 lands on
the optimal q(u). For other likelihoods :func:`natgrad_step` obtains :math:`g` by automatic differentiation of the
quadrature expected log-likelihood with respect to :math:`(m, S)`, using
:math:`\nabla_{\eta_1} = \nabla_m - 2(\nabla_S) m`, :math:`\nabla_{\eta_2} = \nabla_S`.

**Step length and damping.** ``lr`` must be a number in ``(0, 1]`` (``1``: the full step). For the Gaussian and
Pólya-Gamma steps :math:`g_2` is negative semi-definite, so the new precision
:math:`(1-\rho)S^{-1} + \rho(K^{-1} - 2g_2)` is positive definite for every such ``lr``. For a likelihood that is
not log-concave (robust-max), or with a large step on a non-conjugate one, :math:`-2 g_2` can be indefinite and the
step can leave the positive-definite cone. :func:`natgrad_step` therefore **damps**: it halves the step (separately
for each output) until the new precision has a Cholesky factor, at most 30 times (then that output is left
unchanged), and reports a damped step once per process with :class:`NatGradDampingWarning`. The positive-definite
step of Lin, Schmidt, Khan (2020) (``retraction=True`` in :func:`natgrad_from_grads_`; ``fit``'s
``natgrad_retraction``, on by default for non-conjugate likelihoods and deep GPs' hidden layers) never leaves the
cone, so for it damping is reserved for non-finite gradients.
"""

from __future__ import annotations

import numbers

import torch
from pyro.distributions.transforms import LowerCholeskyTransform, transform_to

from .. import deferred
from ..bounds.polya_gamma import optimal_c, pg_mean
from ..likelihoods import Gaussian, PolyaGammaLogit
from ..linalg import _warn_once, solve_lower
from ..variational import OrthogonalStrategy, from_natural, to_natural

__all__ = [
    "natgrad_step",
    "gaussian_natgrad_step",
    "polya_gamma_natgrad_step",
    "natgrad_step_for",
    "natgrad_from_grads_",
    "natgrad_families",
    "noise_step_from_grads_",
    "noise_natgrad_likelihood",
    "solvegp_natgrad_step",
    "solvegp_joint_natgrad_from_grads_",
    "natgrad_pairs",
    "set_natgrad_probes",
    "clear_natgrad_probes",
    "check_natgrad_lr",
    "NatGradDampingWarning",
]

_MAX_HALVINGS = 30


class NatGradDampingWarning(UserWarning):
    """A natural-gradient step was shortened so that the new precision of q(u) stays positive definite.
    A warning about the package's damping rule (module docstring): implements no paper equation."""


def check_natgrad_lr(lr) -> float:
    """``lr`` as a float in ``(0, 1]``, else ``ValueError`` naming the range. ``lr`` is a number or a one-element
    tensor (any shape with one element, e.g. ``()``); returns a Python float. The step length :math:`\\ell` of
    Hensman, Fusi, Lawrence 2013, section 3.2 (an argument check: implements no equation of its own)."""
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        lr = lr.item()
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (0.0 < float(lr) <= 1.0):
        raise ValueError(
            f"natural-gradient step length must be a number in (0, 1] (1 is the full step, exact for a Gaussian "
            f"likelihood on the full batch; 0.05-0.5 suits non-conjugate likelihoods), got {lr!r}; to train q(u) "
            "with Adam instead, leave natgrad_lr=None"
        )
    return float(lr)


def _check_step_data(svgp, X, y):
    X, y = svgp.check_inputs(X, y)
    if svgp.likelihood is None:
        raise ValueError("natural-gradient steps need a module with a likelihood")


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


def _damped_length(theta2, target2, lr):
    """Per-output step lengths ``[...]``: ``lr``, halved until ``-2((1-r) theta2 + r target2)`` has a Cholesky
    factor (``0`` after ``_MAX_HALVINGS``: that output keeps its q(u)); see the module docstring."""
    rho = torch.full(theta2.shape[:-2], float(lr), dtype=theta2.dtype, device=theta2.device)
    for _ in range(_MAX_HALVINGS):
        r = rho[..., None, None]
        prec = -2.0 * ((1 - r) * theta2 + r * target2)
        _, info = torch.linalg.cholesky_ex(0.5 * (prec + prec.mT))
        bad = (info > 0) | ~torch.isfinite(prec).all(-1).all(-1)
        if not bool(bad.any()):
            break
        rho = torch.where(bad, 0.5 * rho, rho)
    else:
        rho = torch.where(bad, torch.zeros_like(rho), rho)
    if bool((rho < lr).any()):
        _warn_once(
            ("natgrad-damped",),
            f"natural-gradient step of length {lr:g} would have made the precision of q(u) indefinite (a "
            f"non-log-concave likelihood or too long a step); it was shortened to {float(rho.min()):.3g}. Reported "
            "once; use a smaller natgrad_lr if this recurs.",
            NatGradDampingWarning,
            stacklevel=4,
        )
    return rho


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


def _damp(factor, D, info, rho, lr, retraction):
    """Damping (the module docstring): halve the step ``rho [...]`` of each output whose new precision has no
    Cholesky factor (``info [...] > 0``; a non-log-concave likelihood, too long a step, a noisy gradient), at most
    ``_MAX_HALVINGS`` times, then set it to 0 (that output keeps its q); ``factor(rho)`` returns ``(D, info)`` with
    ``D [..., M, M]``. Warns once (:class:`NatGradDampingWarning`) with the remedy that applies. Returns
    ``(D, rho)``."""
    halvings = 0
    while bool((info > 0).any()) and halvings <= _MAX_HALVINGS:
        bad = info > 0
        rho = torch.where(bad, 0.5 * rho, rho) if halvings < _MAX_HALVINGS else torch.where(bad, 0.0, rho)
        D, info = factor(rho)
        halvings += 1
    if halvings:
        if retraction:  # K >= I/2 for every finite gradient: only a non-finite or overflowing one fails
            advice = ("even the positive-definite step (retraction) had no Cholesky factor, so the gradient of q was "
                      "not finite or overflowed; lower natgrad_lr and lr, or check the data")
        else:
            advice = ("if this recurs use a smaller natgrad_lr, the positive-definite step (natgrad_retraction=True "
                      "in fit, retraction=True in NaturalGradient), or more particles (num_particles=8, "
                      "vectorize_particles=True) when u is sampled")
        _warn_once(
            ("natgrad-damped", bool(retraction)),
            f"natural-gradient step of length {lr:g} would have made the precision of q indefinite (a "
            "non-log-concave likelihood, too long a step, or the noise of a Monte Carlo gradient when the ELBO "
            f"samples u); it was shortened to {float(rho.min()):.3g}. Reported once; {advice}.",
            NatGradDampingWarning,
            stacklevel=5,
        )
    return D, rho


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
        return torch.linalg.cholesky_ex(K.flip(-1, -2))  # chol(J K J)

    D, info = factor(rho)
    if D.device.type == "cpu" and deferred.active() is None:
        D, rho = _damp(factor, D, info, rho, lr, retraction)
        frozen = rho == 0  # a frozen output keeps its q: L' = L, and no step for its mean (0 * nan is nan)
        D = torch.where(frozen[..., None, None], torch.eye(D.shape[-1], dtype=D.dtype, device=D.device), D)
        g_m = torch.where(frozen[..., None], 0.0, g_m)
    else:  # no host synchronisation: a failed factorisation makes the update NaN, which fit's guard catches
        D = D + torch.where(info > 0, float("nan"), 0.0).to(D.dtype)[..., None, None]
    # L' = L J D^{-T} J, i.e. L'^T = J D^{-1} (J L^T): one triangular solve, no inverse, no product
    L_new = torch.linalg.solve_triangular(D, L.mT.flip(-2), upper=False).flip(-2).mT
    return m, g_m, raw_m, L_new, raw_L, rho, L, Psi


@torch.no_grad()
def solvegp_joint_natgrad_from_grads_(gp, lr: float, retraction: bool = False) -> None:
    r"""A natural-gradient step of length ``lr`` on SOLVE-GP's pair ``q(u) q(v⊥)`` (both full-covariance) whose
    **means move jointly**, from the gradients a backward pass left in their parameters and in the layer's zero probe
    ``gp.strategy.cross_probe`` ``[(L,) M, M2]`` (set before the pass; see
    :meth:`~pyro_sparsegp.variational.OrthogonalStrategy.cross_var`).

    Each covariance takes the step of :func:`natgrad_from_grads_`, :math:`\Lambda'_u = (1-\rho)\Lambda_u +
    \rho H_{uu}` and likewise :math:`\Lambda'_v` (for a Gaussian likelihood the optimal covariance of each factor
    does not depend on the other factor). The means take a damped Newton step with this minibatch's Hessian of the
    loss :math:`\ell = -\mathcal{L}` in the joint means,

    .. math:: \begin{pmatrix} m_u' \\ m_v' \end{pmatrix} = \begin{pmatrix} m_u \\ m_v \end{pmatrix} - \rho
              \begin{pmatrix} H_{uu} & H_{uv} \\ H_{uv}^T & H_{vv} \end{pmatrix}^{-1}
              \begin{pmatrix} \nabla_{m_u}\ell \\ \nabla_{m_v}\ell \end{pmatrix},

    with :math:`H_{uu} = L_u^{-T}(I + \Psi_u)L_u^{-1}` (the length-1 precision of the covariance step, from the
    same gradients) and :math:`H_{uv} = \partial^2\ell / \partial m_u \partial m_v^T` (the probe's gradient). This
    is the mean step of the natural gradient of a full-covariance Gaussian over ``(u, v⊥)`` whose precision has
    settled at ``H`` (SVGP's mean step once its covariance has converged). All blocks come from one minibatch on
    purpose: the direction in which ``u`` and ``v⊥`` explain the data alike has a curvature about the prior's, a
    small difference of large blocks, so a cross block from this batch beside running-average diagonal blocks (the
    covariances' precisions) gets it wrong; on the deep SOLVE-GP of ``benchmarks/deepgp_uci.py`` (energy) that
    pairing trained to a lower bound than the separate steps.

    Why: taking the two factors' natural gradients separately (each mean preconditioned by its own covariance) is a
    damped block-Jacobi iteration on the coupled means. Where ``u`` and ``v⊥`` explain the data alike (Z and O
    interleaved, as k-means leaves them), it converges at a rate near 1: on energy (768 points, M = 50 + 50, fixed
    hyperparameters, full batch) 200 separate steps of length 0.1 left the bound 0.14 nats per point below its
    maximum and steps of length 1 oscillated, while SVGP's steps of length 0.1 converged in about 50; the joint step
    of length 0.1 was within 1e-5 after 100 steps. With a Gaussian likelihood and the full batch, a step of length
    1 lands on the maximiser of eq. 8 of Shi, Titsias, Mnih 2020 (eqs. 28-29 for ``q(v⊥)``), as Hensman et al.'s
    does for SVGP. The step has the same fixed points as the separate steps. Cost: one ``(M + M2)``-square Cholesky
    factorisation and four triangular solves beyond theirs, independent of the batch.

    Where the joint precision has no Cholesky factor (a non-log-concave likelihood, rounding in float32) or a
    covariance step was damped by :func:`natgrad_from_grads_`'s rule, that output's means take the factors' own
    steps instead (selected per output, no host synchronisation). ``retraction``: each covariance takes the
    positive-definite step of :func:`natgrad_from_grads_` (Lin, Schmidt, Khan 2020).
    """
    C = gp.strategy.cross_probe
    if C is None or C.grad is None:
        raise ValueError("solvegp_joint_natgrad_from_grads_: set gp.strategy.cross_probe (zeros, requires_grad) before "
                         "the "
                         "backward pass (set_natgrad_probes)")
    mu, gu, raw_mu, Lu, raw_Lu, rho_u, Lu0, Psi_u = _precision_step(gp.q_u, lr, retraction)
    mv, gv, raw_mv, Lv, raw_Lv, rho_v, Lv0, Psi_v = _precision_step(gp.q_v, lr, retraction)
    M = mu.shape[-1]
    Huv = C.grad.expand(Lu.shape[:-2] + C.shape[-2:])

    def hessian_block(L, Psi):  # L^{-T} (I + Psi) L^{-1}: the length-1 precision of natgrad_from_grads_
        K = Psi.clone()
        K.diagonal(dim1=-2, dim2=-1).add_(1.0)
        W = torch.linalg.solve_triangular(L.mT, K, upper=True)  # L^{-T} K
        return torch.linalg.solve_triangular(L.mT, W.mT, upper=True).mT  # L^{-T} K L^{-1} (K symmetric)

    H = torch.cat([torch.cat([hessian_block(Lu0, Psi_u), Huv], -1),
                   torch.cat([Huv.mT, hessian_block(Lv0, Psi_v)], -1)], -2)
    LH, info = torch.linalg.cholesky_ex(0.5 * (H + H.mT))
    step = torch.cholesky_solve(torch.cat([gu, gv], -1).unsqueeze(-1), LH).squeeze(-1)
    m_new = torch.cat([mu, mv], -1) - float(lr) * step
    # where the joint precision has no factor or a covariance step was damped: the factors' own mean steps
    # (selected per output without a host synchronisation)
    joint_ok = ((info == 0) & (rho_u == lr) & (rho_v == lr))[..., None]
    sep_u = mu - rho_u.unsqueeze(-1) * (Lu @ (Lu.mT @ gu.unsqueeze(-1))).squeeze(-1)
    sep_v = mv - rho_v.unsqueeze(-1) * (Lv @ (Lv.mT @ gv.unsqueeze(-1))).squeeze(-1)
    mu_new = torch.where(joint_ok, m_new[..., :M], sep_u)
    mv_new = torch.where(joint_ok, m_new[..., M:], sep_v)
    _set_constrained(gp.q_u, "u_loc", raw_mu, mu_new)
    _set_constrained(gp.q_u, "u_scale_tril", raw_Lu, Lu)
    _set_constrained(gp.q_v, "u_loc", raw_mv, mv_new)
    _set_constrained(gp.q_v, "u_scale_tril", raw_Lv, Lv)


def natgrad_pairs(module, families) -> list:
    """The SOLVE-GP layers of ``module`` whose ``q(u)`` and ``q(v⊥)`` are both in ``families``: ``fit`` steps
    their means jointly (:func:`solvegp_joint_natgrad_from_grads_`) and the other families alone."""
    ids = {id(q) for q in families}
    return [m for m in module.modules()
            if isinstance(getattr(m, "strategy", None), OrthogonalStrategy) and id(m.q_u) in ids
            and id(getattr(m, "q_v", None)) in ids]


def set_natgrad_probes(pairs) -> None:
    """Give each SOLVE-GP layer in ``pairs`` a zero probe ``[(L,) M, M2]`` that requires a gradient (before the
    forward pass of a natural-gradient step); :func:`clear_natgrad_probes` removes them."""
    for gp in pairs:
        Lu = gp.q_u.u_scale_tril
        C = torch.zeros(Lu.shape[:-1] + (gp.q_v.u_loc.shape[-1],), dtype=Lu.dtype, device=Lu.device)
        gp.strategy.cross_probe = C.requires_grad_(True)


def clear_natgrad_probes(pairs) -> None:
    """Remove the probes that :func:`set_natgrad_probes` gave (after the natural-gradient step)."""
    for gp in pairs:
        gp.strategy.cross_probe = None


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


def noise_natgrad_likelihood(module):
    """The :class:`~pyro_sparsegp.Gaussian` likelihood of ``module`` whose learnable noise
    :func:`noise_step_from_grads_` trains beside the natural-gradient families, or ``None`` (no likelihood, another
    likelihood, a frozen noise (``requires_grad_(False)``), or a noise with a prior: a ``PyroSample`` is its guide's
    to train). The step's noise is a scalar
    ``()``; the Fisher-scoring step of Hensman, Fusi, Lawrence 2013, eq. 4 in the noise precision."""
    lik = getattr(module, "likelihood", None)
    if isinstance(lik, Gaussian) and "noise" in getattr(lik, "_pyro_params", {}):
        return lik if lik.noise_unconstrained.requires_grad else None
    return None


def natgrad_families(module) -> list:
    """The variational families that natural-gradient steps train: every full-covariance
    :class:`~pyro_sparsegp.variational.GaussianQ` in ``module`` (q(u) of an SVGP; q(u) and q(v⊥) of a SOLVE-GP;
    ODVGP's mean-only q(v⊥) is not one and stays with the ordinary optimiser). A module may choose its own with a
    ``natgrad_families()`` method (:class:`~pyro_sparsegp.DeepGP`: the last layer's q(u), and its q(v⊥) if it is
    a SOLVE-GP). Returns a list of modules (each with ``u_loc`` ``[..., M]`` and ``u_scale_tril`` ``[..., M, M]``);
    the families whose natural parameters the step of Hensman, Fusi, Lawrence 2013, section 3.2, updates."""
    from ..variational import GaussianQ

    if hasattr(module, "natgrad_families"):
        return list(module.natgrad_families())
    return [m for m in module.modules() if isinstance(m, GaussianQ) and m.learn_scale]


def solvegp_natgrad_step(gp, X, y, lr: float = 1.0, num_data: int | None = None, sites=("u", "v")) -> None:
    r"""Natural-gradient step of length ``lr`` for SOLVE-GP's q(u) and/or q(v⊥) (``sites``) on the minibatch
    ``(X [B, D], y [B])`` of a data set of ``num_data`` points (default ``B``): the gradient of the closed-form bound
    (eq. 8 of Shi, Titsias, Mnih 2020 via ``analytic_elbo``) then, for both sites, the joint step
    :func:`solvegp_joint_natgrad_from_grads_` (with a Gaussian likelihood and the full batch a step of length 1
    lands on the maximiser of eq. 8, whose q(v⊥) is eqs. 28-29), and for one site :func:`natgrad_from_grads_` on
    that family (a step of length 1 lands on its optimum given the other factor).
    Works for an :class:`~pyro_sparsegp.SVGP` too (``sites=("u",)``)."""
    qs = {"u": gp.q_u, "v": getattr(gp, "q_v", None)}
    fams = [qs[s] for s in sites]
    if any(q is None or not q.learn_scale for q in fams):
        raise ValueError(f"solvegp_natgrad_step: sites {sites} need full-covariance families (not ODVGP's q(v⊥))")
    pairs = natgrad_pairs(gp, fams)
    params = [p for q in fams for p in q.parameters()]
    for p in params:
        p.grad = None
    set_natgrad_probes(pairs)
    try:
        probes = [g.strategy.cross_probe for g in pairs]
        with torch.enable_grad():
            loss = -gp.analytic_elbo(X, y, num_data=num_data)
            grads = torch.autograd.grad(loss, params + probes)
        for p, g in zip(params + probes, grads, strict=True):
            p.grad = g
        if pairs:
            solvegp_joint_natgrad_from_grads_(gp, lr)
        else:
            for q in fams:
                natgrad_from_grads_(q, lr)
    finally:
        clear_natgrad_probes(pairs)
        for p in params:
            p.grad = None
