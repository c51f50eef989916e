r"""GFITC: expectation propagation on the exact Kim-Ghahramani (robust-max without label noise) likelihood with a
FITC prior per class, EP run to convergence between L-BFGS steps on the hyper-parameters and inducing inputs. The
baseline of Villacampa-Calvo and Hernández-Lobato (2017), "Scalable multi-class Gaussian process classification
using expectation propagation" (ICML; arXiv 1706.07258), sec. 3 ("generalized FITC approximation"), after Kim and
Ghahramani (2006) and Naish-Guzman and Holden (2008). Brief: ``shared/briefs/ep_sep.md`` sec. 9.

**Model.** The module is the one :func:`~pyro_sparsegp.infer.fit_ep` fits, ``SVGP(kernel, Z, RobustMax(K),
num_outputs=K)``. With ``W_k = L_k^{-1} K_k(Z_k, X)`` ``[M, N]`` (``L_k L_k^T = K_k(Z_k, Z_k)``) and the FITC diagonal
``d^k_i = k(x_i, x_i) - |w^k_i|^2`` (it holds the kernel's white noise, the paper's ``sigma0``), the inducing values
are marginalised (unlike EP/SEP) and each class has the FITC prior ``f^k ~ N(0, Q_k + diag(d_k))``,
``Q_k = W_k^T W_k`` (sec. 2.1, eqs. 4-5). The likelihood is eq. 1, ``p(y_i | f_i) = prod_{k != y_i}
Theta(f^{y_i}_i - f^k_i)``: in ``f``-space it is *exactly* a product of ``N (K - 1)`` factors, each depending on two
latent values. (The issue text speaks of a 1-D quadrature for the tilted moments; the authors' GFITC code
``Rcode/gfitc_code/epMGPC.R``, emakryo/scalable_multiclass_ep @ 01a1beb, shows why none is needed: the tilted
moments of ``Theta(f^a - f^k)`` under a Gaussian cavity are probit moments in closed form. Quadrature enters only
at prediction, eq. 11, through :meth:`RobustMax.predictive`.)

**Sites** (Kim and Ghahramani 2006; the parameterisation of ``epMGPC.R``: ``eta1k, eta2k, eta1kyi, eta2kyi``).
Factor ``(i, k)``, ``k != y_i = a``, is approximated by ``exp(-tau_y/2 (f^a_i)^2 + nu_y f^a_i) exp(-tau_c/2 (f^k_i)^2
+ nu_c f^k_i)``: four scalars per factor, stored as ``[N, K]`` arrays (zero at ``(i, y_i)``). The sites factorise
across classes, so ``q(f) = prod_k q(f^k)``; class ``k`` collects at point ``i`` the diagonal site
``T^k_i = sum_j tau_y[i, j]`` if ``y_i = k``, else ``tau_c[i, k]`` (and ``Nu`` likewise). Each factor has its own
cavity: the ``y`` side removes ``tau_y[i, k]`` only, not the sum.

**q(u) and q(f).** Marginalising ``f^k_i | u ~ N(w_i^T v, d_i)`` (whitened ``v = L^{-1} u``) against the site gives
a site on ``u`` with precision ``T / (1 + d T)`` and natural mean ``Nu / (1 + d T)`` along ``w_i``, so
``q(v_k) = N(mu, (I + W diag(T / (1 + dT)) W^T)^{-1})``: ``O(N M^2 + M^3)`` per class, as FITC regression. The
marginals are ``q(f^k_i) = N((w^T mu + d Nu) / (1 + d T), d / (1 + d T) + w^T S w / (1 + d T)^2)`` (``epMGPC.R``
``reconstructPosterior``). ``q(u)`` is written into ``module.q_u`` as :func:`fit_ep` does, so ``module.predict``
gives eq. 11 (the R ``predictMGPC``: ``m* = k*^T K^{-1} mu_u``, ``v* = k** - Q** + k*^T K^{-1} S_u K^{-1} k*``).

**Refinement** (parallel, damped; ``epMGPC.R`` ``process_likelihood_factors``). With cavity marginals
``(m_a, v_a)``, ``(m_k, v_k)``: ``s = v_a + v_k``, ``z = (m_a - m_k) / sqrt(s)``, ``r = N(z) / Phi(z)``,
``b = -r (z + r) / s`` (the second derivative of ``log Z``), first derivatives ``+-r / sqrt(s)``; new sites
``tau = -b / (1 + b v)``, ``nu = (alpha - m b) / (1 + b v)`` per side. The site precisions are always positive, so
every cavity is a proper Gaussian. EP stops when the largest change a full (undamped) update would make to any site
parameter, relative to ``1 + |parameter|``, is below ``tol``. The parallel EP map can have an eigenvalue close to
one (on glass the residual shrinks by ~0.3 % per damped sweep, along one fixed direction): every 10th sweep, when the
last two changes are parallel, EP jumps to the limit of that geometric sequence (Aitken's extrapolation along one
direction; it keeps the fixed point and needs 4-5 times fewer sweeps there). In the table-2 runs a warm-started EP
run took 20-45 sweeps on average.

**Evidence and gradient.** ``log Z_EP = sum_{i, k != y_i} [log Phi(z_ik) + sum_sides (A(cav) - A(q))] + sum_k L_k``,
``A(N(m, v)) = log(v) / 2 + m^2 / (2 v)`` on the 1-D marginals, and ``L_k = log int N(f | 0, Q_k + diag d_k)
exp(-f^T diag(T) f / 2 + Nu^T f) df`` (``epMGPC.R`` ``computeEvidence``). The factors do not depend on the
hyper-parameters, so at an EP fixed point ``d log Z_EP / d theta = d sum_k L_k / d theta`` with the sites held
fixed (Seeger 2006; ``epMGPC.R`` ``computeGrads``, eq. 34 of Hernández-Lobato and Hernández-Lobato 2016): autograd
of ``L_k``. L-BFGS (``torch.optim.LBFGS``, strong-Wolfe line search) minimises ``-log Z_EP``; every evaluation of
the objective first runs EP to convergence at the trial hyper-parameters, warm-started from the last sites (as
``epMGPCExternal_lBFGS`` with R's ``optim``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ...context.reporting import warn
from ...linalg import cholesky
from ...mean_functions import Zero
from ..training.progress import Progress
from .sites import _aggregate, _check_module, _fitc_stats, _gauss, _log_norm, _proj, _write_q

__all__ = ["fit_gfitc", "GFITCState", "GFITCConvergenceWarning", "gfitc_log_evidence", "gfitc_marginals",
           "gfitc_refine", "gfitc_surrogate"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class GFITCConvergenceWarning(UserWarning):
    """EP did not reach its tolerance within ``max_ep_iters`` iterations (the gradient of Villacampa-Calvo and
    Hernández-Lobato 2017, sec. 3, is then approximate)."""


@dataclass
class GFITCState:
    """State of :func:`fit_gfitc` (GFITC, Villacampa-Calvo and Hernández-Lobato 2017, section 3).

    ``sites = (tau_y, nu_y, tau_c, nu_c)``, each ``[N, K]`` (zero at ``(i, y_i)``): factor ``(i, k)`` on the
    observed class's latent ``f^{y_i}_i`` and on ``f^k_i`` (module docstring). Per objective evaluation (each one an
    EP run to convergence): ``log_evidence``, ``ep_iterations`` (EP sweeps it took) and ``converged``.
    ``lbfgs_iterations``: L-BFGS iterations taken; ``seconds``: wall time of the whole fit.
    """

    sites: tuple | None = None
    log_evidence: list = field(default_factory=list)
    ep_iterations: list = field(default_factory=list)
    converged: list = field(default_factory=list)
    lbfgs_iterations: int = 0
    seconds: float = 0.0
    skipped: int = 0

    @property
    def evaluations(self) -> int:
        """Objective evaluations (EP runs) so far, an ``int`` (no tensor, so shapes do not apply); the outer loop of
        GFITC (Villacampa-Calvo and Hernández-Lobato 2017, section 3)."""
        return len(self.ep_iterations)


# -- q(f) and cavities -------------------------------------------------------------------------------------------
def _totals(sites, own):
    """Per-class diagonal site ``(T, Nu)`` ``[K, N]`` from the factor sites ``[N, K]``."""
    tau_y, nu_y, tau_c, nu_c = sites
    return _aggregate(tau_y, tau_c, own), _aggregate(nu_y, nu_c, own)


def _u_sites(W, d, T, Nu):
    """Sites moved onto the whitened ``v``: ``(Lam [K, M, M], eta [K, M], 1 + d T [K, N])``."""
    den = 1.0 + d * T
    Lam = (W * (T / den).unsqueeze(-2)) @ W.mT
    eta = (W * (Nu / den).unsqueeze(-2)).sum(-1)
    return Lam, eta, den


def _marginals(W, d, T, Nu):
    """``q(f)`` marginals ``(m, v)`` ``[K, N]`` and ``(Lb, eta, den)`` of ``q(v)`` (module docstring)."""
    Lam, eta, den = _u_sites(W, d, T, Nu)
    Lb, mu = _gauss(Lam, eta)
    vu, mu_f, _ = _proj(Lb, mu, W)
    return (mu_f + d * Nu) / den, d / den + vu / den.pow(2), Lb, eta, den


def _cavities(m, v, sites, y):
    """Cavity marginals ``(m_a, v_a, m_k, v_k)`` ``[N, K]`` of every factor (``a = y_i``) from q's ``(m, v)``."""
    tau_y, nu_y, tau_c, nu_c = sites
    ma, va = m.T.gather(-1, y[:, None]), v.T.gather(-1, y[:, None])  # [N, 1]
    mk, vk = m.T, v.T
    pa, pk = 1.0 / va - tau_y, 1.0 / vk - tau_c  # cavity precisions (positive: every site precision is)
    return (ma / va - nu_y) / pa, 1.0 / pa, (mk / vk - nu_c) / pk, 1.0 / pk


def gfitc_refine(m_a, v_a, m_k, v_k):
    r"""New sites of the factors ``Theta(f^a - f^k)`` from their cavity marginals ``N(m_a, v_a) N(m_k, v_k)``
    (Villacampa-Calvo and Hernández-Lobato 2017, section 3; their ``epMGPC.R`` ``process_likelihood_factors``; Kim
    and Ghahramani 2006). All arguments broadcast.

    ``z = (m_a - m_k) / sqrt(v_a + v_k)``, ``r = N(z) / Phi(z)``, ``b = -r (z + r) / (v_a + v_k)``; per side
    ``tau = -b / (1 + b v)``, ``nu = (+-r / sqrt(v_a + v_k) - m b) / (1 + b v)``.

    :returns: ``((tau_y, nu_y, tau_c, nu_c), log Phi(z))``, shaped like the broadcast arguments.
    """
    s = v_a + v_k
    rs = s.sqrt()
    z = (m_a - m_k) / rs
    logcdf = torch.special.log_ndtr(z)
    r = torch.exp(-0.5 * z.pow(2) - _HALF_LOG_2PI - logcdf)
    eps = torch.finfo(s.dtype).eps
    g = (r * (z + r)).clamp(min=0.0, max=1.0 - eps)  # in (0, 1) exactly; round-off can leave it (z << 0)
    b = -g / s
    da, dk = 1.0 + b * v_a, 1.0 + b * v_k  # > 1 - g > 0 since v < s
    tau_y, tau_c = -b / da, -b / dk
    nu_y = (r / rs - m_a * b) / da
    nu_c = (-r / rs - m_k * b) / dk
    return (tau_y, nu_y, tau_c, nu_c), logcdf


def _sweep(W, d, y, own, sites):
    """Undamped proposal of every factor from one q: ``(new sites, log Phi(z) [N, K], q marginals, ...)``."""
    T, Nu = _totals(sites, own)
    m, v, Lb, eta, den = _marginals(W, d, T, Nu)
    cav = _cavities(m, v, sites, y)
    new, logcdf = gfitc_refine(*cav)
    ok = ~own
    for t in (*new, *cav):
        ok = ok & torch.isfinite(t)
    ok = ok & (cav[1] > 0) & (cav[3] > 0)
    new = tuple(torch.where(ok, n, o).masked_fill(own, 0.0) for n, o in zip(new, sites, strict=True))
    return new, ok, logcdf, (m, v, cav, T, Nu, Lb, eta, den)


# -- EP to convergence -------------------------------------------------------------------------------------------
@torch.no_grad()
def _run_ep(W, d, y, own, sites, damping, tol, max_iters, extrapolate=True):
    """Parallel damped EP from ``sites`` until the largest relative undamped change ``|new - old| / (1 + |old|)``
    of any site parameter is below ``tol``. With ``extrapolate``, every 10th sweep whose change is parallel to the
    previous one (cosine > 0.999) with a ratio ``r`` in ``(0.5, 1)``, i.e. a single slow mode, jumps to that mode's
    limit ``sites + damping * change / (1 - r)`` (Aitken's extrapolation on one direction), unless that would make
    a site precision negative.

    :returns: ``(sites, sweeps, converged, skipped)``: ``skipped`` counts factor updates left out (non-finite)."""
    skipped, prev = 0, None
    for it in range(1, max_iters + 1):
        new, ok, _, _ = _sweep(W, d, y, own, sites)
        skipped += int((~ok & ~own).sum())
        diff = torch.stack([n - o for n, o in zip(new, sites, strict=True)])  # [4, N, K]
        change = float((diff.abs() / (1.0 + torch.stack(sites).abs())).max())
        if change < tol:
            return tuple(o + damping * c for o, c in zip(sites, diff, strict=True)), it, True, skipped
        step = damping * diff
        if extrapolate and prev is not None and it % 10 == 0:
            r = float((diff * prev).sum() / prev.pow(2).sum())
            cos = r * float(prev.norm() / diff.norm())
            jump = torch.stack(sites) + step / (1.0 - r) if cos > 0.999 and 0.5 < r < 1.0 else None
            if jump is not None and bool(torch.isfinite(jump).all()) and bool((jump[0::2] >= 0).all()):
                step = jump - torch.stack(sites)
        sites = tuple(o + st for o, st in zip(sites, step, strict=True))
        prev = diff
    return sites, max_iters, False, skipped


def _prior_term(W, d, T, Nu):
    """``sum_k L_k = sum_k log int N(f | 0, W^T W + diag d) exp(-f^T diag(T) f / 2 + Nu^T f) df``, a scalar,
    differentiable in ``(W, d)`` with the sites ``(T, Nu)`` ``[K, N]`` as given (module docstring)."""
    Lam, eta, den = _u_sites(W, d, T, Nu)
    eye = torch.eye(W.shape[-2], dtype=W.dtype, device=W.device)
    Lb = cholesky(eye + Lam, symmetrize=True)
    diag = -0.5 * den.log() + 0.5 * d * Nu.pow(2) / den
    return _log_norm(Lb, eta).sum() + diag.sum()


def _A(m, v):
    return 0.5 * v.log() + 0.5 * m.pow(2) / v


@torch.no_grad()
def _evidence(W, d, y, own, sites):
    """``log Z_EP`` (module docstring) at the given sites, a 0-dim tensor."""
    _, _, logcdf, (m, v, (ma, va, mk, vk), T, Nu, _, _, _) = _sweep(W, d, y, own, sites)
    qa, qva = m.T.gather(-1, y[:, None]), v.T.gather(-1, y[:, None])
    per = logcdf + _A(ma, va) - _A(qa, qva) + _A(mk, vk) - _A(m.T, v.T)
    return per.masked_fill(own, 0.0).sum() + _prior_term(W, d, T, Nu)


# -- public helpers ------------------------------------------------------------------------------------------------
def _prepare(module, X, y, state):
    K = _check_module(module)
    mf = getattr(module, "mean_function", None)
    if mf is not None and not isinstance(mf, Zero):
        raise ValueError(f"GFITC assumes zero-mean GP priors (as the paper); the module has a {type(mf).__name__} mean "
                         "function")
    X, y = module.check_inputs(X, y)
    if X.dim() != 2:
        raise ValueError(f"X must be [N, D], got shape {tuple(X.shape)}")
    y = y.long()
    own = torch.nn.functional.one_hot(y, K).bool()
    if state is not None and state.sites is not None and state.sites[0].shape != own.shape:
        raise ValueError(f"state has sites for {tuple(state.sites[0].shape)} (N, K) but the data are "
                         f"{tuple(own.shape)}")
    return X, y, own


def gfitc_log_evidence(module, X, y, state: GFITCState) -> float:
    r"""EP estimate of :math:`\log p(y)` (``log Z_EP``, module docstring; Villacampa-Calvo and Hernández-Lobato 2017,
    section 3, their ``epMGPC.R`` ``computeEvidence``) at the module's hyper-parameters and the sites in ``state``.
    ``X`` ``[N, D]``, ``y`` ``[N]`` labels in ``0..K-1``."""
    X, y, own = _prepare(module, X, y, state)
    with torch.no_grad():
        _, W, d = _fitc_stats(module, X)
    return float(_evidence(W, d, y, own, state.sites))


def gfitc_surrogate(module, X, y, state: GFITCState) -> torch.Tensor:
    r"""``sum_k L_k`` with the sites in ``state`` held fixed: a 0-dim tensor whose gradient with respect to the
    kernel's parameters and ``Z`` is that of ``log Z_EP`` at an EP fixed point (module docstring; Seeger 2006, as in
    eq. 34 of Hernández-Lobato and Hernández-Lobato 2016). Its value is not ``log Z_EP``. ``X`` ``[N, D]``,
    ``y`` ``[N]``."""
    X, y, own = _prepare(module, X, y, state)
    _, W, d = _fitc_stats(module, X)
    T, Nu = _totals(state.sites, own)
    return _prior_term(W, d, T, Nu)


@torch.no_grad()
def gfitc_marginals(module, X, y, state: GFITCState):
    """The approximate posterior marginals ``(mean, var)`` ``[K, N]`` of the latent values ``f^k_i`` at the
    training inputs (``q(f)``, not the FITC predictive of :meth:`predict`; ``epMGPC.R`` ``reconstructPosterior`` of
    Villacampa-Calvo and Hernández-Lobato 2017). ``X`` ``[N, D]``, ``y`` ``[N]``."""
    X, y, own = _prepare(module, X, y, state)
    _, W, d = _fitc_stats(module, X)
    m, v, *_ = _marginals(W, d, *_totals(state.sites, own))
    return m, v


# -- the fit -------------------------------------------------------------------------------------------------------
def _ep_at(module, X, y, own, state, ep, with_grad):
    """EP to convergence at the module's current hyper-parameters, recorded in ``state``; returns ``(W, d)`` (with
    their graph when ``with_grad``) and ``log Z_EP``. ``ep = (damping, tol, max_ep_iters, callback)``."""
    damping, tol, max_iters, callback = ep
    with torch.set_grad_enabled(with_grad):
        _, W, d = _fitc_stats(module, X)
    sites, sweeps, conv, skipped = _run_ep(W.detach(), d.detach(), y, own, state.sites, damping, tol, max_iters)
    state.sites = sites
    logz = _evidence(W.detach(), d.detach(), y, own, sites)
    state.log_evidence.append(float(logz))
    state.ep_iterations.append(sweeps)
    state.converged.append(conv)
    state.skipped += skipped
    if not conv:
        warn(f"GFITC: EP did not converge in {max_iters} sweeps (tol {tol}); the hyper-parameter gradient "
             "is approximate there. Raise max_ep_iters or tol", GFITCConvergenceWarning)
    if callback is not None:
        callback(state.evaluations - 1, state)
    return W, d, logz


def fit_gfitc(
    module,
    X,
    y,
    num_iters: int = 250,
    learn_hyperparameters: bool = True,
    tol: float | None = None,
    max_ep_iters: int = 1000,
    damping: float = 0.5,
    state: GFITCState | None = None,
    callback=None,
    progress: bool = True,
) -> GFITCState:
    r"""Fit ``module`` (``SVGP(kernel, Z, RobustMax(K), num_outputs=K)``, as for :func:`fit_ep`) by GFITC (module
    docstring; Villacampa-Calvo and Hernández-Lobato 2017, section 3) and write the Gaussian ``q(u_k)`` of each
    class into ``module.q_u``.

    :param X: ``[N, D]`` inputs. :param y: ``[N]`` labels in ``0..K-1`` (tensors, numpy, lists, pandas).
    :param num_iters: L-BFGS iterations on ``-log Z_EP`` (the paper: 250); each objective evaluation (more than one
        per iteration with the line search) runs EP to convergence, warm-started. ``0``: EP only.
    :param learn_hyperparameters: ``False``: run EP to convergence once at the current hyper-parameters. A parameter
        frozen the PyTorch way (``requires_grad_(False)``, e.g. the inducing inputs) stays where it is.
    :param tol: EP stops when no site parameter would change by more than ``tol (1 + |parameter|)`` in an undamped
        update; default ``1e-4`` in float64, ``1e-3`` in float32 (the R code's tolerance; float32 round-off in the
        sweep can sit near ``1e-4``).
    :param max_ep_iters: cap on EP sweeps per run; a run that hits it warns (:class:`GFITCConvergenceWarning`).
    :param damping: ``delta`` of the damped update ``site <- delta new + (1 - delta) old``, in ``(0, 1]``.
    :param state: continue from a previous :class:`GFITCState` (same data): EP starts from its sites.
    :param callback: ``callback(evaluation, state)`` after every EP run.
    :param progress: show the EP runs (about ``1.25 num_iters + 1``: L-BFGS's evaluations, a few more when its line
        search needs them, then the final one) with the log evidence, as :func:`~pyro_sparsegp.infer.fit` shows its
        steps (a bar on a terminal, plain lines in a log file).
    :returns: the :class:`GFITCState` (per EP run: ``log_evidence``, ``ep_iterations``, ``converged``).
    """
    if int(num_iters) != num_iters or num_iters < 0:
        raise ValueError(f"num_iters must be a non-negative integer, got {num_iters}")
    if int(max_ep_iters) != max_ep_iters or max_ep_iters < 1:
        raise ValueError(f"max_ep_iters must be a positive integer, got {max_ep_iters}")
    if tol is not None and not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    X, y, own = _prepare(module, X, y, state)
    tol = tol if tol is not None else (1e-4 if X.dtype == torch.float64 else 1e-3)
    state = GFITCState() if state is None else state
    if state.sites is None:
        zeros = X.new_zeros(own.shape)
        state.sites = (zeros, zeros.clone(), zeros.clone(), zeros.clone())
    t0 = time.perf_counter()
    params = [p for n, p in module.named_parameters() if not n.startswith("q_u") and p.requires_grad]
    params = params if learn_hyperparameters and num_iters > 0 else []

    bar = Progress(int(num_iters * 1.25) + 1 if params else 1, enabled=progress, desc="fit_gfitc",
                   metric="log Z")

    def report(evaluation, st):
        bar.update(1, st.log_evidence[-1])
        if callback is not None:
            callback(evaluation, st)

    ep = (damping, tol, int(max_ep_iters), report)
    try:
        _lbfgs_then_ep(module, X, y, own, state, ep, params, num_iters)
    finally:
        bar.close()
    state.seconds += time.perf_counter() - t0
    return state


def _lbfgs_then_ep(module, X, y, own, state, ep, params, num_iters) -> None:
    """:func:`fit_gfitc`'s work: L-BFGS on ``-log Z_EP`` (EP to convergence at every evaluation), then EP at the final
    hyper-parameters and ``q(u)`` written into ``module``. ``X [N, D]``, ``own [N, K]``."""
    if params:
        opt = torch.optim.LBFGS(params, lr=1.0, max_iter=int(num_iters), line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            W, d, logz = _ep_at(module, X, y, own, state, ep, True)
            T, Nu = _totals(state.sites, own)
            live = _prior_term(W, d, T, Nu)
            loss = -(logz + live - live.detach())  # value -log Z_EP, gradient -d sum_k L_k (fixed point)
            if not torch.isfinite(loss):
                raise FloatingPointError("non-finite GFITC log evidence; check the kernel and data")
            loss.backward()
            return loss.detach()

        opt.step(closure)
        state.lbfgs_iterations += int(opt.state[opt._params[0]].get("n_iter", 0))
    with torch.no_grad():
        _ep_at(module, X, y, own, state, ep, False)  # EP at the final hyper-parameters
        L, W, d = _fitc_stats(module, X)
        Lam, eta, _ = _u_sites(W, d, *_totals(state.sites, own))
        _write_q(module, L, Lam, eta)
