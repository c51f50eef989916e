r"""Expectation propagation (EP) and stochastic EP (SEP) for multi-class GP classification with a FITC prior per class
and the robust-max (Kim and Ghahramani 2006) labelling rule: Villacampa-Calvo and Hernández-Lobato (2017),
"Scalable multi-class Gaussian process classification using expectation propagation" (ICML; arXiv 1706.07258).
Equation numbers are theirs; the formulas are rebuilt in ``shared/briefs/ep_sep.md`` (sections cited as "brief").

**Model.** The module is the ordinary ``SVGP(kernel, Z, RobustMax(K), num_outputs=K)`` (``Z`` ``[K, M, D]`` or
``[M, D]``, one shared kernel). With ``W_k = L_k^{-1} K_k(Z_k, X)`` (``L_k L_k^T = K_k(Z_k, Z_k)``) the FITC prior
of class ``k`` (eqs. 4-5) is ``f^k_i | u^k ~ N(upsilon_i^T u^k, d^k_i)``, ``d^k_i = k(x_i, x_i) - |w^k_i|^2``.
Label noise lives in the kernel's diagonal: use ``Sum(RBF(D), WhiteNoise(D))`` for the paper's ``sigma0``
(:mod:`pyro_sparsegp.kernels` gives ``WhiteNoise`` to ``k(x_i, x_i)`` but not to ``K(Z, Z)``, so here the inducing
values are noise-free values of the latent functions; the paper adds ``sigma0`` to ``K(Z, Z)`` as well). The labels
follow ``y_i = argmax_k f^k_i``; the likelihood's ``epsilon`` is not used in training (EP has no labelling-error
term: eq. 1) and only enters the module's predictive distribution (a floor of ``epsilon / (K - 1)``).

**Approximation.** Eq. 6 replaces the exact factor (eq. 3) by ``prod_{k != y_i} Phi(alpha_ik(u))``, and each of
the ``N (K - 1)`` factors by a Gaussian factor that factorises over the two classes it touches (eq. 8): on class
``y_i`` ``exp(-C1y/2 (upsilon^T u)^2 + C2y upsilon^T u)``, on class ``k`` the same with ``(C1c, C2c)``.

* ``method="ep"``: one site per factor, four scalars ``[N, K]`` each (entries ``(i, y_i)`` are zero).
* ``method="sep"``: stochastic EP (sec. 2.3.1): one tied factor per class, the natural parameters
  ``(Lambda_k [M, M], eta_k [M])`` of the product of all factors that touch class ``k``; state ``O(K M^2)``,
  independent of ``N``.

Everything is computed in whitened coordinates ``v_k = L_k^{-1} u_k`` (prior ``N(0, I)``, posterior precision
``I + W diag(c) W^T``: well conditioned). Tied sites are stored relative to the ``L`` they were formed with and moved
to a new ``L'`` by ``R = L^{-1} L'`` (``Lambda <- R^T Lambda R``, ``eta <- R^T eta``): that is the paper's "keep the
factors, swap the prior" (brief sec. 5, R ``updatePosterior_after``). Per-point EP sites in batch mode are kept as
functions of the projections ``upsilon_i^T u`` and re-applied with the current ``upsilon`` at every iteration (the
paper re-sets ``upsilon`` after each refinement; both have the same fixed points).

**Updates.** Parallel refinement of every factor from one ``q`` (appendix D, brief sec. 3), damped:
``C <- delta C_new + (1 - delta) C_old``, ``delta = damping * damping_decay^t`` in batch mode (paper: 0.5, 0.99),
``delta = 1`` with minibatches. A factor whose cavity is not a proper Gaussian (``1 - C1 v <= 0``), whose ``s`` is
not positive, or whose new precision would not be positive and finite, is skipped (its old value is kept); the count
is in :attr:`EPState.skipped`. New precisions ``g / (1 - g v_cav)`` are positive whenever ``0 < g < 1 / s``, which is
checked.

**Evidence and gradients.** :func:`ep_log_evidence` is eq. 9 (appendix F; SEP: the tied-factor version). The
hyper-parameter and inducing-input gradient is eq. 10 (eq. 12 for a minibatch, scaled by ``N / |B|``), computed by
autograd of the surrogate of the brief, sec. 5:
``sum_k [A(theta_p + theta~_k) - A(theta_p)] + (N/|B|) sum log Phi(beta_ik(xi; m_cav, S_cav))`` with the sites
``theta~`` fixed as functions of ``u`` and the cavities frozen. At an EP fixed point this is the exact gradient of
``log Z_EP`` (tested against finite differences); away from one (the paper's "EP-inner-approx" schedule, which
updates both at once) it ignores the dependence of the sites on the hyper-parameters.
Steps: batch, per-element sign-adaptive ascent (start ``1e-2``, x1.02 on equal signs up to 1, x0.5 on a flip) on
the module's unconstrained parameters (so in log space for positive ones; raw for ``Z``); minibatch, Adam
(``lr=1e-3``).

**Result.** The Gaussian ``q(u_k)`` is written into ``module.q_u`` (whitened or not, as the module is). The
posterior over ``u`` of the FITC model is what EP approximates, and the module's ``predict`` gives
``m*_k = k*^T K^{-1} mu_k``, ``v*_k = k** - k*^T K^{-1} k* + k*^T K^{-1} Sigma_k K^{-1} k*`` (eq. 11 / appendix H:
``k**`` includes the kernel's white noise, i.e. the FITC diagonal), and class probabilities by the 1-D
Gauss-Hermite quadrature of eq. 3 (``RobustMax.predictive``). So EP, SEP and VI fit the same module and predict
through the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...checks.validation import check_positive_int
from ...linalg import cholesky
from ..training.progress import Progress
from .sites import (  # noqa: F401  (ep_refine, _fitc_stats: public and test access through this module)
    _aggregate,
    _check_module,
    _ep_batch,
    _ep_evidence,
    _ep_minibatch,
    _factor_counts,
    _fitc_stats,
    _log_norm,
    _proj,
    _sep_evidence,
    _sep_step,
    _side_cavity,
    _transform,
    _write_q,
    ep_refine,
)

__all__ = ["fit_ep", "EPState", "ep_log_evidence", "ep_refine", "ep_surrogate"]


# -- state -----------------------------------------------------------------------------------------------------
@dataclass
class EPState:
    """State of :func:`fit_ep`: the approximate factors of Villacampa-Calvo and Hernández-Lobato 2017, eq. 18
    (EP), or their tied product (SEP, stochastic EP, their section 2).

    EP: ``sites = (C1y, C2y, C1c, C2c)``, each ``[N, K]`` (zero at ``(i, y_i)``); with minibatches also ``ups``
    ``[K, N, M]``, the directions ``upsilon_i = K^{-1} k(Z, x_i)`` each site was formed with (the paper's R code
    keeps them too: ``O(N K M)``), and the running sums ``(Lam, eta)``. SEP: ``(Lam [K, M, M], eta [K, M])`` only.
    ``Lam, eta`` are whitened with respect to ``L_ref``.
    """

    method: str
    sites: tuple | None = None
    ups: torch.Tensor | None = None
    Lam: torch.Tensor | None = None
    eta: torch.Tensor | None = None
    L_ref: torch.Tensor | None = None
    iteration: int = 0
    log_evidence: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    skipped: int = 0
    updated: int = 0

    def state_bytes(self) -> int:
        """Bytes held by the approximate factors (what grows with ``N`` for EP and not for SEP): the summed
        ``numel * element_size`` of the tensors above (``[N, K]`` sites, ``[K, N, M]`` directions, ``[K, M, M]``
        and ``[K, M]`` sums); returns an ``int``. The memory cost compared in Villacampa-Calvo and Hernández-Lobato
        2017, section 2 (SEP reduces it by a factor of ``N``)."""
        ts = [t for t in (*(self.sites or ()), self.ups, self.Lam, self.eta) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def time_per_iteration(self) -> float:
        """Median seconds per iteration (refinement + hyper-parameter step), a Python float (no tensor, so
        shapes do not apply). Implements no paper equation; the training-time measure of Villacampa-Calvo and
        Hernández-Lobato 2017, section 4."""
        s = sorted(self.seconds)
        return s[len(s) // 2] if s else float("nan")


# -- surrogate of eq. 10 -----------------------------------------------------------------------------------------
def _surrogate(L, W, d, L0, Lq, mu, Lam, eta, sides, y, own, scale):
    """Autograd surrogate whose gradient is eq. 10 (eq. 12 with ``scale = N / |B|``), see the module docstring.

    ``L, W, d`` live (functions of the hyper-parameters); ``L0`` the value of ``L``; ``(Lq, mu)`` the frozen
    whitened q (or SEP cavity) the cavities are built from; ``(Lam, eta)`` the frozen tied natural parameters of
    all sites (whitened at ``L0``); ``sides``: ``None`` (SEP: the cavity is ``(Lq, mu)`` itself) or the frozen
    ``(Wold, C1y, C2y, C1c, C2c)`` of EP (``Wold`` ``[K, M, B]``: the sites' directions whitened at ``L0``)."""
    R = torch.linalg.solve_triangular(L0, L, upper=False)  # live, the identity at the current value
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    Lb = cholesky(eye + R.mT @ Lam @ R, symmetrize=True)
    prior = _log_norm(Lb, (R.mT @ eta.unsqueeze(-1)).squeeze(-1)).sum()
    T = torch.linalg.solve_triangular(R.mT, W, upper=True)  # L0^T upsilon(xi)
    tv, tm, Vt = _proj(Lq, mu, T)
    if sides is None:  # SEP: one cavity per class
        ya, ka = tm.T.gather(-1, y[:, None]), tm.T
        va, vk = tv.T.gather(-1, y[:, None]), tv.T
    else:
        Wold, C1y, C2y, C1c, C2c = sides
        v, m, Vw = _proj(Lq, mu, Wold)
        tw = (Vt * Vw).sum(-2)
        g = lambda P: P.T.gather(-1, y[:, None])  # noqa: E731  the observed class's row, [B, 1]
        ya, va, _ = _side_cavity(g(tv), g(tw), g(tm), g(v), g(m), C1y, C2y)
        ka, vk, _ = _side_cavity(tv.T, tw.T, tm.T, v.T, m.T, C1c, C2c)
    dT = d.T
    s = dT.gather(-1, y[:, None]) + dT + va + vk
    beta = (ya - ka) / s.clamp(min=torch.finfo(s.dtype).tiny).sqrt()
    lik = torch.special.log_ndtr(beta).masked_fill(own, 0.0).sum()
    return prior + scale * lik


@torch.no_grad()
def ep_log_evidence(module, X: torch.Tensor, y: torch.Tensor, state: EPState) -> float:
    r"""EP estimate of :math:`\log p(y)` (eq. 9, appendix F; brief sec. 4) at the module's current
    hyper-parameters and the sites in ``state``: ``sum_{i, k != y_i} [log Phi(beta_ik) + Delta_y + Delta_c]
    + sum_k [A(q_k) - A(p_k)]``. For SEP, the tied-factor version (R ``computeEvidence_minibatch``) on all data:
    ``sum log Phi(beta_ik) + sum_k F_k (A(cav_k) - A(q_k)) + sum_k [A(q_k) - A(p_k)]``.

    :param X: ``[N, D]`` the training inputs the state was fitted on; ``y`` ``[N]`` labels in ``0..K-1``."""
    K = _check_module(module)
    y = y.long()
    own = torch.nn.functional.one_hot(y, K).bool()
    L, W, d = _fitc_stats(module, X)
    if state.method == "sep":
        _transform(state, L)
        return float(_sep_evidence(W, d, state.Lam, state.eta, y, own, _factor_counts(y, K)))
    if state.ups is not None:  # minibatch EP: the sites on the directions they were formed with
        W = L.mT @ state.ups.mT
    return float(_ep_evidence(W, d, state.sites, y, own))


# -- step rules ----------------------------------------------------------------------------------------------------
class _SignAdaptive:
    """Per-element sign-adaptive ascent (brief sec. 5): ``eps`` starts at ``1e-2``, x1.02 (at most 1) when the
    gradient's sign repeats, x0.5 when it flips; ``p += eps * sign(grad)``."""

    def __init__(self, params, eps=1e-2):
        self.params = params
        self.eps = [torch.full_like(p, eps) for p in params]
        self.prev = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, e, prev in zip(self.params, self.eps, self.prev, strict=True):
            if p.grad is None:
                continue
            g = p.grad.sign()
            same = g * prev
            e.copy_(torch.where(same > 0, (e * 1.02).clamp(max=1.0), torch.where(same < 0, e * 0.5, e)))
            p.add_(e * g)
            prev.copy_(g)


# -- the loop ----------------------------------------------------------------------------------------------------
def fit_ep(
    module,
    X: torch.Tensor,
    y: torch.Tensor,
    method: str = "ep",
    num_iters: int = 250,
    batch_size: int | None = None,
    learn_hyperparameters: bool = True,
    damping: float = 0.5,
    damping_decay: float = 0.99,
    lr: float = 1e-3,
    seed: int = 0,
    state: EPState | None = None,
    callback=None,
    progress: bool = True,
) -> EPState:
    r"""Fit ``module`` (``SVGP(kernel, Z, RobustMax(K), num_outputs=K)``) by EP or SEP (Villacampa-Calvo and
    Hernández-Lobato 2017; see the module docstring) and write the Gaussian ``q(u_k)`` of each class into
    ``module.q_u``.

    :param X: ``[N, D]`` inputs. :param y: ``[N]`` labels in ``0..K-1``.
    :param method: ``"ep"`` (one site per factor) or ``"sep"`` (one tied site per class).
    :param num_iters: iterations (batch) or minibatch steps; each refines the factors once (parallel, damped) and
        takes one hyper-parameter step (the paper's schedule, sec. 2.3 and appendix E).
    :param batch_size: ``None``: batch mode (all factors each iteration, sign-adaptive steps, damping schedule);
        else minibatches of that size drawn from random permutations (``delta = 1``, Adam on eq. 12).
    :param learn_hyperparameters: also train the kernel and ``Z`` (eq. 10/12); ``False``: EP only. A parameter
        frozen the PyTorch way stays where it is, e.g. ``gp.inducing.Z_unconstrained.requires_grad_(False)`` keeps
        the inducing inputs fixed (EP's FITC-type prior tends to pull learned inducing inputs onto each other,
        Bauer, van der Wilk, Rasmussen 2016, which makes ``Kuu`` singular).
    :param damping: initial ``delta``; :param damping_decay: ``delta <- decay * delta`` after each batch iteration
        (``1.0``: constant damping, which is how to run EP to a fixed point).
    :param lr: Adam learning rate in minibatch mode.
    :param state: continue from a previous :class:`EPState` (same data).
    :param callback: ``callback(iteration, state)`` after every iteration.
    :param progress: show the iterations (with the log evidence in batch mode), as
        :func:`~pyro_sparsegp.infer.fit` shows its steps (a bar on a terminal, plain lines in a log file).
    :returns: the :class:`EPState` (``log_evidence`` per batch iteration, ``seconds`` per iteration, ``skipped``).
    """
    X, y, own, F, batch, state = _prepare(module, X, y, method, batch_size, damping, state)
    N = X.shape[0]
    params = [p for n, p in module.named_parameters() if not n.startswith("q_u") and p.requires_grad]
    params = params if learn_hyperparameters else []
    opt = (torch.optim.Adam(params, lr=lr, maximize=True) if batch else _SignAdaptive(params)) if params else None
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(N, generator=gen, device="cpu")
    pos = 0
    bar = Progress(int(num_iters), enabled=progress, desc=f"fit_ep ({method})", metric="log Z")
    try:
        for it in range(num_iters):
            t0 = time.perf_counter()
            if batch:
                if pos + batch_size > N:
                    order, pos = torch.randperm(N, generator=gen, device="cpu"), 0
                idx = order[pos : pos + batch_size]
                pos += batch_size
            else:
                idx = None
            delta = 1.0 if batch else damping * damping_decay**state.iteration
            new, ok, logz, ownb = _refine_and_step(module, state, X, y, own, F, idx, delta, params, opt)
            state.skipped += int((~ok & ~ownb).sum())
            state.updated += int((ok & ~ownb).sum())
            new()
            state.iteration += 1
            if not batch:
                state.log_evidence.append(float(logz))
            state.seconds.append(time.perf_counter() - t0)
            bar.update(1, None if batch else state.log_evidence[-1])
            if callback is not None:
                callback(it, state)
    finally:
        bar.close()
    finish(module, X, y, state)
    return state


def _prepare(module, X, y, method, batch_size, damping, state):
    """:func:`fit_ep`'s checks and set-up: ``(X [N, D], y [N] long, own [N, K], F [K], batch, state)``, with a new
    :class:`EPState` (zero sites, eq. 18) unless ``state`` continues one."""
    if method not in ("ep", "sep"):
        raise ValueError(f"method must be 'ep' or 'sep', got {method!r}")
    K = _check_module(module)
    X, y = module.check_inputs(X, y)  # tensors, numpy, lists, pandas; y [N] (or [N, 1]) labels
    if X.dim() != 2:
        raise ValueError(f"X must be [N, D], got shape {tuple(X.shape)}")
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    check_positive_int(batch_size, "batch_size (minibatches; None: batch mode, all points)")
    y = y.long()
    N = X.shape[0]
    own = torch.nn.functional.one_hot(y, K).bool()
    F = _factor_counts(y, K).to(X.dtype)
    M = module.inducing.num_inducing
    batch = batch_size is not None and batch_size < N
    if state is None:
        state = EPState(method)
    if state.method != method:
        raise ValueError(f"state was made by {state.method!r}, not {method!r}")
    zeros = X.new_zeros(N, K)
    if method == "ep" and state.sites is None:
        state.sites = (zeros, zeros.clone(), zeros.clone(), zeros.clone())
    if (method == "sep" or batch) and state.Lam is None:
        state.Lam, state.eta = X.new_zeros(K, M, M), X.new_zeros(K, M)
    if method == "ep" and batch and state.ups is None:
        state.ups = X.new_zeros(K, N, M)
    return X, y, own, F, batch, state


def _refine_and_step(module, state, X, y, own, F, idx, delta, params, opt):
    """One iteration of :func:`fit_ep` on the points ``idx`` (``None``: all): the factors' refinement (deferred:
    the returned ``new()`` applies it) and, with ``opt``, one hyper-parameter step on the surrogate of eq. 10 (eq. 12
    for a minibatch). Returns ``(new, ok [B, K], logz, own [B, K])``."""
    N = X.shape[0]
    yb = y if idx is None else y[idx]
    ownb = own if idx is None else own[idx]
    with torch.set_grad_enabled(bool(params)):
        L, W, d, new, ok, sur_args, logz = _parts(module, state, X, y, own, F, idx, delta)
        if opt is not None:
            for p in params:
                p.grad = None
            sur = _surrogate(L, W, d, L.detach(), *sur_args, yb, ownb, 1.0 if idx is None else N / len(idx))
            sur.backward()
            if not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
                raise FloatingPointError("non-finite hyper-parameter gradient in EP; check the kernel and data")
            opt.step()
    return new, ok, logz, ownb


def _parts(module, state, X, y, own, F, idx, delta):
    """One refinement's ingredients: live ``(L, W, d)`` on the batch, the deferred site update, validity, the
    surrogate's frozen arguments and the evidence estimate (``None`` for minibatch EP)."""
    N = X.shape[0]
    Xb = X if idx is None else X[idx]
    yb = y if idx is None else y[idx]
    ownb = own if idx is None else own[idx]
    L, W, d = _fitc_stats(module, Xb)
    L0, W0, d0 = L.detach(), W.detach(), d.detach()
    logz = None
    if state.method == "ep" and state.ups is None:
        new, ok, sur_args, logz = _ep_batch(state, W0, d0, yb, ownb, delta)
    elif state.method == "ep":
        new, ok, sur_args = _ep_minibatch(state, L0, W0, d0, yb, ownb, idx if idx is not None else slice(None))
    else:
        scale = 1.0 if idx is None else N / len(idx)
        new, ok, sur_args, logz = _sep_step(state, L0, W0, d0, yb, ownb, F, scale, delta)
    return L, W, d, new, ok, sur_args, logz


def ep_surrogate(module, X: torch.Tensor, y: torch.Tensor, state: EPState) -> torch.Tensor:
    r"""The scalar whose gradient with respect to the kernel's parameters and ``Z`` is eq. 10 (appendix G) on the
    full data at the sites in ``state``: ``sum_k [A(theta_p + theta~_k) - A(theta_p)] + sum_{i, k} log Phi(beta_ik)``
    with the sites and cavities frozen (brief sec. 5). At an EP fixed point its gradient is that of
    :func:`ep_log_evidence`; its value is not ``log Z``. Leaves ``state`` unchanged."""
    K = _check_module(module)
    y = y.long()
    own = torch.nn.functional.one_hot(y, K).bool()
    L, W, d, _, _, sur_args, _ = _parts(module, state, X, y, own, _factor_counts(y, K).to(X.dtype), None, 1.0)
    return _surrogate(L, W, d, L.detach(), *sur_args, y, own, 1.0)


@torch.no_grad()
def finish(module, X, y, state):
    """Write the current q(u) into ``module.q_u`` (after the last hyper-parameter step)."""
    K = module.num_outputs
    y = y.long()
    own = torch.nn.functional.one_hot(y, K).bool()
    L, W, d = _fitc_stats(module, X) if state.Lam is None else (_fitc_stats(module, X[:1])[0], None, None)
    if state.Lam is None:  # batch EP: sites on the current directions
        C1y, C2y, C1c, C2c = state.sites
        c1, c2 = _aggregate(C1y, C1c, own), _aggregate(C2y, C2c, own)
        Lam, eta = (W * c1.unsqueeze(-2)) @ W.mT, (W * c2.unsqueeze(-2)).sum(-1)
    else:
        _transform(state, L)
        Lam, eta = state.Lam, state.eta
    _write_q(module, L, Lam, eta)
