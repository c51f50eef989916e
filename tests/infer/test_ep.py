"""EP and SEP for multi-class GP classification (Villacampa-Calvo and Hernández-Lobato 2017), checked against
independent computations: Monte Carlo tilted moments, a dense EP with explicit matrix sites, a dense binary EP
(Hernández-Lobato and Hernández-Lobato 2016) for K = 2, finite differences of log Z for eq. 10, eq. 11 by dense
algebra."""
import copy
import math
import warnings

import pytest
import torch
from finite_differences import central_difference
from pyro.contrib.gp.kernels import RBF, Sum, WhiteNoise

import pyro_sparsegp as ps
from pyro_sparsegp.infer import EPState, fit_ep
from pyro_sparsegp.infer.ep import ep_log_evidence, ep_refine, ep_surrogate
from pyro_sparsegp.kernels import kernel_diag, kernel_matrix
from pyro_sparsegp.linalg import cholesky

Phi = torch.special.ndtr


def _problem(N=8, K=3, M=3, D=2, noise=0.3, whiten=False, seed=0, far_last=False):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.randn(N, D, generator=g)
    y = torch.arange(N) % K
    X = X + 0.8 * torch.nn.functional.one_hot(y, K)[:, :D].to(X.dtype)  # some class structure
    Z = torch.randn(K, M, D, generator=g)
    if far_last:
        Z[-1] += 100.0  # the last class's inducing inputs far from all data: its GP mean is 0 on the data
    kern = Sum(RBF(D, lengthscale=torch.tensor(1.3)), WhiteNoise(D, variance=torch.tensor(noise)))
    gp = ps.SVGP(kern, Z, ps.RobustMax(K), num_outputs=K, whiten=whiten)
    return gp, X, y.to(X.dtype)


def _q(gp):
    """Unwhitened ``(mean [K, M], cov [K, M, M])`` of the module's q(u)."""
    m, L = gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    S = L @ L.mT
    if gp.whiten:
        Luu = cholesky(kernel_matrix(gp.kernel, gp.Z).detach(), gp.jitter)
        m, S = (Luu @ m.unsqueeze(-1)).squeeze(-1), Luu @ S @ Luu.mT
    return m, S


def _dense_pieces(gp, X):
    """``Kuu`` (with the module's jitter), ``upsilon = Kuu^{-1} k(Z, x)`` ``[K, N, M]``, FITC ``d`` ``[K, N]``."""
    with torch.no_grad():
        Luu = cholesky(kernel_matrix(gp.kernel, gp.Z), gp.jitter)
        Kuu = Luu @ Luu.mT
        Kuf = kernel_matrix(gp.kernel, gp.Z, X.unsqueeze(0))
        ups = torch.linalg.solve(Kuu, Kuf).mT
        d = kernel_diag(gp.kernel, X) - (ups * Kuf.mT).sum(-1)
    return Kuu, ups, d.clamp(min=0)


def _A(P, h):
    """Log-normaliser ``1/2 log|S| + 1/2 m^T S^{-1} m`` of the Gaussian with precision ``P``, natural mean ``h``."""
    return -0.5 * torch.logdet(P) + 0.5 * h @ torch.linalg.solve(P, h)


def _dense_ep(gp, X, y, iters=300, damping=0.5):
    """EP with explicit M x M sites per (factor, side) and the tilted moments of the joint two-class cavity
    (Rasmussen and Williams 2006, eqs. 3.58, for the probit of a linear function), then the site = q_new / q_cav
    on each class's block. Returns per-class ``(mean, cov)`` and ``log Z_EP`` with explicit normalisers (eq. 56)."""
    Kuu, ups, d = _dense_pieces(gp, X)
    K, N, M = ups.shape
    y = y.long()
    facs = [(i, k) for i in range(N) for k in range(K) if k != y[i]]
    Lam = {(f, s): torch.zeros(M, M) for f in facs for s in range(2)}
    eta = {(f, s): torch.zeros(M) for f in facs for s in range(2)}
    Kinv = torch.linalg.inv(Kuu)

    def post():
        P = [Kinv[c].clone() for c in range(K)]
        h = [torch.zeros(M) for _ in range(K)]
        for (i, k) in facs:
            for s, c in enumerate((int(y[i]), k)):
                P[c] += Lam[((i, k), s)]
                h[c] += eta[((i, k), s)]
        return P, h

    def tilted(f, P, h):
        i, k = f
        cls = (int(y[i]), k)
        Pc = [P[c] - Lam[(f, s)] for s, c in enumerate(cls)]
        hc = [h[c] - eta[(f, s)] for s, c in enumerate(cls)]
        Sc = [torch.linalg.inv(p) for p in Pc]
        mc = [S @ hh for S, hh in zip(Sc, hc, strict=True)]
        a = torch.cat([ups[cls[0], i], -ups[cls[1], i]])
        S = torch.block_diag(*Sc)
        m = torch.cat(mc)
        s = d[cls[0], i] + d[cls[1], i] + a @ S @ a
        z = a @ m / s.sqrt()
        r = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi) / Phi(z)
        Sa = S @ a
        m_new = m + Sa * r / s.sqrt()
        S_new = S - torch.outer(Sa, Sa) * r * (z + r) / s
        blocks = [(m_new[:M], S_new[:M, :M]), (m_new[M:], S_new[M:, M:])]
        return Pc, hc, blocks, torch.log(Phi(z))

    for _ in range(iters):
        P, h = post()
        upd = {}
        for f in facs:
            Pc, hc, blocks, _ = tilted(f, P, h)
            for s in range(2):
                Pn = torch.linalg.inv(blocks[s][1])
                upd[(f, s)] = (Pn - Pc[s], Pn @ blocks[s][0] - hc[s])
        for key, (l, e) in upd.items():
            Lam[key] = damping * l + (1 - damping) * Lam[key]
            eta[key] = damping * e + (1 - damping) * eta[key]
    P, h = post()
    logz = sum(_A(P[c], h[c]) - _A(Kinv[c], torch.zeros(M)) for c in range(K))
    for f in facs:
        Pc, hc, blocks, logZf = tilted(f, P, h)
        logz = logz + logZf + sum(_A(Pc[s], hc[s]) - _A(P[c], h[c]) for s, c in enumerate((int(y[f[0]]), f[1])))
    return [(torch.linalg.solve(P[c], h[c]), torch.linalg.inv(P[c])) for c in range(K)], float(logz)


@pytest.mark.float64
def test_refine_matches_monte_carlo_tilted_moments():
    """Sec. 3's (C1, C2) = q_new / q_cav of the class marginals of the tilted distribution, by 2e6 draws."""
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    mu_a, v_a, mu_k, v_k, d_a, d_k = torch.tensor([0.3, 0.7, -0.2, 0.4, 0.1, 0.25])
    (C1y, C2y, C1c, C2c), ok, logZ = ep_refine(mu_a, v_a, mu_k, v_k, d_a, d_k)
    assert ok
    n = 2_000_000
    fa = mu_a + v_a.sqrt() * torch.randn(n, generator=g)
    fk = mu_k + v_k.sqrt() * torch.randn(n, generator=g)
    w = Phi((fa - fk) / (d_a + d_k).sqrt())
    # 4 standard errors, by the delta method (log of a mean; self-normalised importance-weighted moments)
    assert abs(w.mean().log() - logZ) < 4 * w.std() / (w.mean() * math.sqrt(n))
    for f, mu, v, C1, C2 in ((fa, mu_a, v_a, C1y, C2y), (fk, mu_k, v_k, C1c, C2c)):
        m_mc = (w * f).sum() / w.sum()
        v_mc = (w * (f - m_mc) ** 2).sum() / w.sum()
        se_m = (w.pow(2) * (f - m_mc).pow(2)).sum().sqrt() / w.sum()
        se_v = (w.pow(2) * ((f - m_mc).pow(2) - v_mc).pow(2)).sum().sqrt() / w.sum()
        v_new = 1 / (1 / v + C1)
        m_new = v_new * (mu / v + C2)
        assert abs(m_mc - m_new) < 4 * se_m and abs(v_mc - v_new) < 4 * se_v, (m_mc - m_new, se_m, v_mc - v_new)


def test_eq6_is_exact_for_two_classes_only():
    """Eq. 6's product of probits equals the exact 1-D integral (eq. 3) for K = 2, not for K = 3."""
    x, w = ps.linalg.gauss_hermite(80)
    m = torch.tensor([0.4, -0.3, 0.1])
    s = torch.tensor([0.5, 0.8, 0.3])
    exact3 = (w * Phi((m[0] + s[0].sqrt() * x - m[1]) / s[1].sqrt())
              * Phi((m[0] + s[0].sqrt() * x - m[2]) / s[2].sqrt())).sum()
    exact2 = (w * Phi((m[0] + s[0].sqrt() * x - m[1]) / s[1].sqrt())).sum()
    probit = lambda k: Phi((m[0] - m[k]) / (s[0] + s[k]).sqrt())  # noqa: E731
    assert abs(exact2 - probit(1)) < 1e-5
    assert abs(exact3 - probit(1) * probit(2)) > 1e-2


@pytest.mark.float64
def test_ep_fixed_point_and_log_z_match_dense_ep():
    gp, X, y = _problem(N=6)
    st = fit_ep(gp, X, y, method="ep", num_iters=50, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    dense, logz = _dense_ep(gp, X, y, iters=50, damping=0.8)
    m, S = _q(gp)
    for c, (mc, Sc) in enumerate(dense):
        assert torch.allclose(m[c], mc, atol=1e-6), (m[c], mc)
        assert torch.allclose(S[c], Sc, atol=1e-6)
    assert abs(ep_log_evidence(gp, X, y, st) - logz) < 1e-6
    assert st.skipped == 0


@pytest.mark.float64
def test_two_classes_equal_binary_ep():
    """K = 2 with class 1's inducing inputs far from the data (its GP mean is exactly 0 there, its FITC variance
    the prior's) is binary EP on f^0 with the probit Phi(+-f / sqrt(d_0 + d_1)) and the same FITC prior (the
    construction of Hernández-Lobato and Hernández-Lobato 2016), written densely here with scalar sites."""
    gp, X, y = _problem(N=10, K=2, M=4, far_last=True)
    st = fit_ep(gp, X, y, method="ep", num_iters=60, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    Kuu, ups, d = _dense_pieces(gp, X)
    assert ups[1].abs().max() <= 1e3 * torch.finfo(ups.dtype).eps * ups[0].abs().max()  # class 1: zero up to round-off
    sgn = 1.0 - 2.0 * y  # class 0 -> +1
    u, dd, Kinv = ups[0], d[0] + d[1], torch.linalg.inv(Kuu[0])
    tau, nu = torch.zeros(10), torch.zeros(10)
    for _ in range(60):
        P = Kinv + (u.T * tau) @ u
        S = torch.linalg.inv(P)
        mu = S @ (u.T @ nu)
        v, m = ((u @ S) * u).sum(-1), u @ mu
        v_c = 1 / (1 / v - tau)
        m_c = v_c * (m / v - nu)
        z = sgn * m_c / (dd + v_c).sqrt()
        r = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi) / Phi(z)
        m_new = m_c + sgn * v_c * r / (dd + v_c).sqrt()
        v_new = v_c - v_c**2 * r * (z + r) / (dd + v_c)
        tau = 0.8 * (1 / v_new - 1 / v_c) + 0.2 * tau
        nu = 0.8 * (m_new / v_new - m_c / v_c) + 0.2 * nu
    P = Kinv + (u.T * tau) @ u
    h = u.T @ nu
    mq, Sq = _q(gp)
    assert torch.allclose(mq[0], torch.linalg.solve(P, h), atol=1e-7)
    assert torch.allclose(Sq[0], torch.linalg.inv(P), atol=1e-7)
    assert torch.allclose(Sq[1], Kuu[1], atol=1e-7)  # the far class keeps its prior
    v, m = ((u @ torch.linalg.inv(P)) * u).sum(-1), u @ torch.linalg.solve(P, h)
    v_c, den = 1 / (1 / v - tau), 1 - tau * v
    m_c = v_c * (m / v - nu)
    logz = (_A(P, h) - _A(Kinv, torch.zeros(4)) + torch.log(Phi(sgn * m_c / (dd + v_c).sqrt())).sum()
            + (-0.5 * den.log() + 0.5 * (tau * m**2 - 2 * nu * m + nu**2 * v) / den).sum())
    assert abs(ep_log_evidence(gp, X, y, st) - float(logz)) < 1e-7


@pytest.mark.float64
def test_eq10_gradient_matches_finite_differences_at_convergence():
    """At an EP fixed point the surrogate's gradient (eq. 10) equals central differences of log Z_EP, each side
    re-converged by EP: for a length-scale, the label-noise variance and one inducing input coordinate."""
    gp, X, y = _problem(N=9, whiten=True)
    st = fit_ep(gp, X, y, num_iters=80, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    params = dict(gp.named_parameters())
    names = ["kernel.kern0.lengthscale_unconstrained", "kernel.kern1.variance_unconstrained",
             "inducing.Z_unconstrained"]
    grads = torch.autograd.grad(ep_surrogate(gp, X, y, st), [params[n] for n in names])
    h = 1e-4
    for name, grad in zip(names, grads, strict=True):
        p = params[name]
        idx = (0,) * p.dim()
        fd = central_difference(p, idx, h, lambda: ep_log_evidence(gp, X, y, fit_ep(
            gp, X, y, num_iters=40, learn_hyperparameters=False, damping=0.8, damping_decay=1.0,
            state=copy.deepcopy(st))))
        assert abs(grad[idx].item() - fd) < 1e-5 * max(1.0, abs(fd)), (name, grad[idx].item(), fd)


@pytest.mark.float64
def test_sep_with_one_factor_per_class_is_ep():
    gp, X, y = _problem(N=1, K=2, M=2)
    fit_ep(gp, X, y, method="ep", num_iters=40, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    m1, S1 = _q(gp)
    fit_ep(gp, X, y, method="sep", num_iters=40, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    m2, S2 = _q(gp)
    assert torch.allclose(m1, m2, atol=1e-8) and torch.allclose(S1, S2, atol=1e-8)


def test_sep_memory_does_not_grow_with_n():
    """The state SEP keeps (measured in bytes) is K (M^2 + M) numbers for any N; EP's grows like N."""
    sizes = {}
    for N in (30, 300):
        for method, bs in (("sep", None), ("sep", 10), ("ep", None), ("ep", 10)):
            gp, X, y = _problem(N=N, K=3, M=4)
            st = fit_ep(gp, X, y, method=method, num_iters=2, batch_size=bs, learn_hyperparameters=False)
            sizes[(method, bs, N)] = st.state_bytes()
    item = torch.zeros((), dtype=torch.get_default_dtype()).element_size()
    for bs in (None, 10):
        assert sizes[("sep", bs, 30)] == sizes[("sep", bs, 300)] == 3 * (16 + 4) * item
        assert sizes[("ep", bs, 300)] >= 9 * sizes[("ep", bs, 30)] * 0.9


@pytest.mark.float64
def test_minibatch_ep_bookkeeping_and_evidence():
    """After minibatch EP steps the running natural parameters equal the sum of the stored sites on their stored
    directions, and the minibatch evidence approaches the batch one."""
    gp, X, y = _problem(N=12, K=3, M=3)
    st = fit_ep(gp, X, y, method="ep", num_iters=45, batch_size=4, learn_hyperparameters=False)
    assert st.ups is not None and st.skipped == 0
    Luu = cholesky(kernel_matrix(gp.kernel, gp.Z).detach(), gp.jitter)
    W = Luu.mT @ st.ups.mT
    own = torch.nn.functional.one_hot(y.long(), 3).bool()
    C1y, C2y, C1c, C2c = st.sites
    c1 = torch.where(own, C1y.sum(-1, keepdim=True), C1c).T
    c2 = torch.where(own, C2y.sum(-1, keepdim=True), C2c).T
    assert torch.allclose(st.Lam, (W * c1.unsqueeze(-2)) @ W.mT, atol=1e-8)
    assert torch.allclose(st.eta, (W * c2.unsqueeze(-2)).sum(-1), atol=1e-8)
    st_b = fit_ep(gp, X, y, method="ep", num_iters=60, learn_hyperparameters=False, damping=0.8, damping_decay=1.0)
    assert abs(ep_log_evidence(gp, X, y, st) - ep_log_evidence(gp, X, y, st_b)) < 1e-3


def test_updates_never_leave_a_non_positive_precision():
    """A hard case: no label noise, inducing inputs on data points (FITC d = 0), the same input repeated with
    contradicting labels, undamped parallel updates. Invalid updates are detected and skipped, never applied."""
    # direct: s <= 0 and an improper cavity are refused
    _, ok, _ = ep_refine(torch.tensor(1.0), torch.tensor(0.1), torch.tensor(0.0), torch.tensor(0.1),
                         torch.tensor(-0.5), torch.tensor(0.0))
    assert not ok
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    X = torch.cat([torch.zeros(6, 2), torch.randn(10, 2, generator=g)])
    y = torch.tensor([0, 1, 2, 0, 1, 2] + [0, 1] * 5, dtype=X.dtype)
    gp = ps.SVGP(RBF(2, lengthscale=torch.tensor(0.5), variance=torch.tensor(5.0)), X[4:10].expand(3, 6, 2).clone(),
                 ps.RobustMax(3), num_outputs=3)
    seen = []

    def check(it, state):
        C1y, _, C1c, _ = state.sites
        assert torch.isfinite(torch.stack(state.sites)).all()
        assert (C1y >= 0).all() and (C1c >= 0).all()
        seen.append(state.skipped)

    with warnings.catch_warnings():  # duplicate inducing inputs on purpose: Kuu is numerically singular (it warns)
        warnings.simplefilter("ignore", ps.linalg.IllConditionedWarning)
        st = fit_ep(gp, X, y, num_iters=40, learn_hyperparameters=True, damping=1.0, damping_decay=1.0,
                    callback=check)
    assert st.skipped + st.updated == 40 * 16 * 2
    assert math.isfinite(ep_log_evidence(gp, X, y, st))
    mean, var = gp.predict(X)
    assert torch.isfinite(mean).all() and (var > 0).all()
    # a state with an improper cavity: point 6 (label 0) has C1y = 5 on factor (6, 1) and -4.9 on (6, 2), so q
    # keeps a precision of 0.1 along its direction and removing the first site leaves 1 - 5 v <= 0
    z = torch.zeros(16, 3)
    C1y = z.clone()
    C1y[6, 1], C1y[6, 2] = 5.0, -4.9
    bad = EPState("ep", sites=(C1y, z.clone(), z.clone(), z.clone()))
    st = fit_ep(gp, X, y, num_iters=1, learn_hyperparameters=False, damping=1.0, state=bad)
    assert st.skipped >= 1 and st.sites[0][6, 1] == 5.0  # skipped, kept as it was
    assert st.updated + st.skipped == 32


@pytest.mark.float64
def test_predict_is_eq11_in_both_parameterisations():
    """``predict`` after EP is eq. 11 (dense), and whitened and unwhitened modules predict the same."""
    outs = []
    Xs = torch.randn(5, 2, generator=torch.Generator(torch.get_default_device()).manual_seed(5))
    for whiten in (False, True):
        gp, X, y = _problem(whiten=whiten)
        fit_ep(gp, X, y, num_iters=60, learn_hyperparameters=False)
        mean, var, pred = gp.predict(Xs, full=True)
        mean, var = mean.mT, var.mT  # predict gives [N, K], like the targets of K outputs
        m, S = _q(gp)
        Kuu = _dense_pieces(gp, X)[0]
        ks = kernel_matrix(gp.kernel, gp.Z, Xs.unsqueeze(0)).detach()  # [K, M, 5]
        A = torch.linalg.solve(Kuu, ks)
        kss = kernel_diag(gp.kernel, Xs).detach()
        assert torch.allclose(mean, (A * m.unsqueeze(-1)).sum(-2), atol=1e-8)
        v = kss - (ks * A).sum(-2) + (A * (S @ A)).sum(-2)
        assert torch.allclose(var, v, atol=1e-8)
        assert torch.allclose(pred.probs.sum(-1), torch.ones(5))
        outs.append((mean, var))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-7) and torch.allclose(outs[0][1], outs[1][1], atol=1e-7)


def test_training_raises_the_evidence_and_classifies():
    """Batch EP with hyper-parameter learning raises log Z; minibatch SEP (Adam on eq. 12) runs; both classify
    held-out data."""
    gp0, X, y = _problem(N=60, K=3, M=5, noise=0.5)
    _, Xt, yt = _problem(N=30, K=3, M=5, noise=0.5, seed=1)  # held out: fresh draws of the same distribution

    def clusters(X, y):  # three well separated clusters
        ang = 2 * math.pi * y / 3
        return 0.5 * X + 2.0 * torch.stack([ang.cos(), ang.sin()], -1)

    X, Xt = clusters(X, y), clusters(Xt, yt)
    for method, bs in (("ep", None), ("sep", 20)):
        gp = copy.deepcopy(gp0)
        st = fit_ep(gp, X, y, method=method, num_iters=20, batch_size=bs, lr=1e-2)
        if bs is None:
            assert st.log_evidence[-1] > st.log_evidence[1]
        err = (gp.predict(Xt, full=True)[2].probs.argmax(-1) != yt).double().mean()
        assert err < 0.15


def test_frozen_parameters_stay_fixed():
    """A parameter frozen with ``requires_grad_(False)`` (here the inducing inputs) is not moved by EP's
    hyper-parameter steps, in batch (sign-adaptive) and minibatch (Adam) mode, while the kernel still trains."""
    gp0, X, y = _problem(N=40, K=3, M=4, noise=0.5)
    for method, bs in (("ep", None), ("sep", 10)):
        gp = copy.deepcopy(gp0)
        gp.inducing.Z_unconstrained.requires_grad_(False)
        Z0, ls0 = gp.Z.detach().clone(), gp.kernel.kern0.lengthscale.detach().clone()
        fit_ep(gp, X, y, method=method, num_iters=5, batch_size=bs, lr=1e-2)
        assert torch.equal(gp.Z.detach(), Z0)
        assert not torch.equal(gp.kernel.kern0.lengthscale.detach(), ls0)


def test_errors():
    gp, X, y = _problem()
    with pytest.raises(ValueError, match="method"):
        fit_ep(gp, X, y, method="vi")
    with pytest.raises(ValueError, match="labels"):
        fit_ep(gp, X, y + 5)
    with pytest.raises(ValueError, match="RobustMax"):
        fit_ep(ps.SVGP(RBF(2), X[:3], ps.Bernoulli()), X, y)
    with pytest.raises(ValueError, match="state"):
        fit_ep(gp, X, y, method="sep", state=EPState("ep"))
    for bad in (0, -5, 2.5, True):  # not a ZeroDivisionError in the minibatch loop
        with pytest.raises(ValueError, match="batch_size .*must be a positive integer or None"):
            fit_ep(gp, X, y, batch_size=bad)


@pytest.mark.float64  # the dense reference inverts Kuu explicitly
@torch.no_grad()
def test_ep_gfitc_and_mfsp_use_the_pair_covariances_of_inducing_patches():
    """EP, GFITC (one shared ``_fitc_stats``) and MFSp factorise the covariances of the module's (inducing variable,
    kernel) pair: with inducing patches of a convolutional kernel, ``W^T W = Kfu Kuu^{-1} Kuf`` and the FITC
    diagonal equal a dense computation from ``torch.nn.functional.unfold`` patches (van der Wilk et al. 2017,
    eq. 6 with the mean normalisation ``c = 1/P``), and both methods then fit and predict."""
    from pyro_sparsegp.covariances import Kdiag
    from pyro_sparsegp.infer import fit_gfitc
    from pyro_sparsegp.infer.ep.mfsp import _pieces
    from pyro_sparsegp.infer.ep.sites import _fitc_stats

    H = W = 5
    base = RBF(9, variance=torch.tensor(1.3), lengthscale=torch.tensor(2.0))
    X, Z = torch.randn(15, H * W), torch.randn(4, 9)
    Xp = torch.nn.functional.unfold(X.reshape(15, 1, H, W), 3).mT  # [N, P, 9], row-major patches
    P = Xp.shape[1]
    Kuu = base(Z) + 1e-10 * torch.eye(4)
    Kuf = base(Z, Xp.reshape(-1, 9)).reshape(4, 15, P).sum(-1) / P
    kff = torch.stack([base(x).sum() for x in Xp]) / P**2
    Q = Kuf.T @ torch.linalg.solve(Kuu, Kuf)
    for K, lik in ((3, ps.RobustMax(3)), (None, ps.Bernoulli())):
        gp = ps.SVGP(ps.ConvKernel(base, (H, W, 1), 3, 1), ps.InducingPatches(Z.clone()), lik, num_outputs=K)
        Wm, d = (_fitc_stats(gp, X)[1:] if K else (_pieces(gp, X)[1], None))
        for w in Wm if K else [Wm]:
            torch.testing.assert_close(w.T @ w, Q, atol=1e-8, rtol=1e-6)
        if K:
            torch.testing.assert_close(d, (kff - Q.diagonal()).expand(3, 15), atol=1e-8, rtol=1e-6)
            torch.testing.assert_close(Kdiag(gp.kernel, X), kff)
    y = torch.arange(15) % 3
    for fn in (fit_ep, fit_gfitc):
        gp = ps.SVGP(ps.ConvKernel(base, (H, W, 1), 3, 1), ps.InducingPatches(Z.clone()), ps.RobustMax(3),
                     num_outputs=3)
        with torch.enable_grad():
            fn(gp, X, y, num_iters=2)
        assert torch.isfinite(gp.predict(X)[0]).all()


def test_progress_writes_plain_lines_to_a_log(capsys):
    """fit_ep shows its iterations as fit shows its steps: in a log file (stderr not a terminal) plain lines, the
    last one at 100 % with the log evidence (batch EP), no carriage returns; progress=False writes nothing."""
    gp, X, y = _problem()
    fit_ep(gp, X, y, num_iters=20, learn_hyperparameters=False)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("fit_ep (ep): step")]
    assert lines and lines[-1].startswith("fit_ep (ep): step 20/20 (100%)  log Z ") and "\r" not in err
    gp, X, y = _problem()
    fit_ep(gp, X, y, num_iters=5, learn_hyperparameters=False, progress=False)
    assert "fit_ep" not in capsys.readouterr().err
