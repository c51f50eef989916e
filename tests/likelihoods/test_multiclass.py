"""Robust-max and softmax likelihoods (Hernández-Lobato et al. 2011; Villacampa-Calvo and Hernández-Lobato 2017).

Every expectation is checked against an independent computation: Monte Carlo of the argmax (not through
``distribution``), scipy's adaptive quadrature of the probability that a class's latent is the largest, closed forms
for two classes, and a multi-class SVGP whose ``Trace_ELBO`` is compared with eq. 15 built from dense matrices."""
import math
import warnings

import numpy as np
import pyro
import pytest
import torch
from gradient_checks import assert_gradients, parameter_gradients
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from scipy import integrate, special, stats

import pyro_sparsegp as ps
from pyro_sparsegp.distributions import MarginalizedLikelihood


def _p_max_scipy(m, v, k):
    """P(f_k > f_j for all j != k), f_j ~ N(m_j, v_j) independent, by scipy's adaptive quadrature (numpy)."""
    m, s = np.asarray(m.cpu(), float), np.sqrt(np.asarray(v.cpu(), float))
    others = [j for j in range(len(m)) if j != k]

    def g(t):
        return stats.norm.pdf(t, m[k], s[k]) * np.prod(stats.norm.cdf((t - m[others]) / s[others]))

    lo, hi = m[k] - 12 * s[k], m[k] + 12 * s[k]
    steps = sorted(t for t in m[others] if lo < t < hi)  # where the factors Phi change fastest
    return integrate.quad(g, lo, hi, epsabs=1e-13, epsrel=1e-11, limit=200, points=steps or None)[0]


def _mc_robust_max(loc, var, S):
    """Monte-Carlo draws of f [S, K, n] and the frequency of each class being the argmax, [K, n]."""
    K = loc.shape[-2]
    f = loc + var.sqrt() * torch.randn((S,) + loc.shape)
    top = f.argmax(-2)  # [S, n]
    freq = torch.stack([(top == k).to(loc.dtype).mean(0) for k in range(K)])  # [K, n]
    return top, freq


# -- (a) expected log-likelihood -------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [2, 3, 5, 8])
def test_robust_max_expected_log_prob_matches_monte_carlo(K):
    eps, n, S = 0.05, 6, 200_000
    lik = ps.RobustMax(K, epsilon=eps)  # default num_gh = 20
    loc, var = 0.7 * torch.randn(K, n), 0.5 + torch.rand(K, n)
    y = torch.randint(0, K, (n,)).to(loc.dtype)
    quad = lik.expected_log_prob(y, loc, var)
    assert quad.shape == (1, n)
    top, _ = _mc_robust_max(loc, var, S)
    vals = torch.where(top == y.long(), math.log(1 - eps), math.log(eps / (K - 1)))  # [S, n]
    mc, se = vals.mean(0), vals.std(0) / math.sqrt(S)
    assert (se > 0).all()
    assert ((quad[0] - mc).abs() < 4 * se).all(), (quad, mc, se)


@pytest.mark.float64  # tolerances down to 4e-6
def test_robust_max_two_classes_closed_form():
    """K = 2: P(f_y > f_o) = Phi((m_y - m_o) / sqrt(v_y + v_o)) exactly."""
    eps = 0.01
    loc, var = 1.5 * torch.randn(2, 50), 0.5 + torch.rand(2, 50)  # variances within a factor 3
    y = torch.randint(0, 2, (50,))
    sign = 1 - 2 * y.to(loc.dtype)  # +1 for class 0, -1 for class 1
    P = torch.special.ndtr(sign * (loc[0] - loc[1]) / (var[0] + var[1]).sqrt())
    P0 = torch.special.ndtr((loc[0] - loc[1]) / (var[0] + var[1]).sqrt())
    lr, lw = math.log(1 - eps), math.log(eps)
    for num_gh, tol in ((20, 5e-4), (40, 4e-6)):  # the accuracy in P stated by RobustMax.prob_max
        lik = ps.RobustMax(2, epsilon=eps, num_gh=num_gh)
        P_quad = (lik.expected_log_prob(y, loc, var)[0] - lw) / (lr - lw)
        assert (P_quad - P).abs().max() < tol
        probs = lik.predictive(loc, var).probs[:, 0]
        assert (probs - ((1 - eps) * P0 + eps * (1 - P0))).abs().max() < tol


@pytest.mark.float64  # tolerances down to 4e-6
@pytest.mark.parametrize("K", [3, 6])
def test_robust_max_prob_max_matches_adaptive_quadrature(K):
    """P_k against scipy's adaptive quadrature, within the accuracy the docstring states for variances within a
    factor 3 of each other (5e-4 with 20 nodes, 4e-6 with 40)."""
    n = 5
    loc, var = torch.randn(K, n), 0.5 + torch.rand(K, n)
    ref = torch.tensor([[_p_max_scipy(loc[:, b], var[:, b], k) for b in range(n)] for k in range(K)])
    torch.testing.assert_close(ref.sum(0), torch.ones(n), rtol=0, atol=1e-9)  # the reference itself
    for num_gh, tol in ((20, 5e-4), (40, 4e-6)):
        P = ps.RobustMax(K, num_gh=num_gh).prob_max(loc, var)
        assert P.shape == (K, n)
        assert (P - ref).abs().max() < tol
        assert (P.sum(0) - 1).abs().max() < 2 * tol


def test_robust_max_gradients_are_finite_for_tiny_variances():
    lik = ps.RobustMax(4)
    loc = torch.randn(4, 6, requires_grad=True)
    var = torch.tensor([0.0, 1e-300, 0.5, 2.0])[:, None].repeat(1, 6).requires_grad_(True)
    ell = lik.expected_log_prob(torch.tensor([0, 1, 2, 3, 0, 1]), loc, var)
    ell.sum().backward()
    assert torch.isfinite(ell).all()
    assert_gradients({"loc": loc.grad, "var": var.grad})


def test_multiclass_likelihoods_refuse_one_dimensional_quadrature():
    for lik in (ps.RobustMax(3), ps.Softmax(3)):
        with pytest.raises(NotImplementedError, match="latent values"):
            lik.quadrature_expected_log_prob(torch.zeros(4), torch.zeros(3, 4), torch.ones(3, 4))


# -- (b) predictive ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [3, 5])
def test_robust_max_predictive_matches_monte_carlo(K):
    eps, n, S = 0.02, 5, 200_000
    lik = ps.RobustMax(K, epsilon=eps, num_gh=40)
    loc, var = 0.6 * torch.randn(K, n), 0.5 + torch.rand(K, n)
    d = lik.predictive(loc, var)
    assert isinstance(d, pyro.distributions.Categorical) and d.batch_shape == (n,)
    probs = d.probs  # [n, K]
    torch.testing.assert_close(probs.sum(-1), torch.ones(n), rtol=0, atol=10 * torch.finfo(loc.dtype).eps)
    # the un-normalised P_k already sum to one up to the quadrature error
    assert (lik.prob_max(loc, var).sum(-2) - 1).abs().max() < 1e-5
    _, freq = _mc_robust_max(loc, var, S)
    mix = 1 - eps - eps / (K - 1)
    mc = mix * freq + eps / (K - 1)
    se = mix * (freq * (1 - freq) / S).sqrt()
    assert (freq > 1e-3).all()  # every class is the argmax often enough for a meaningful standard error
    assert ((probs.T - mc).abs() < 4 * se).all(), (probs.T, mc, se)


# -- (c) labels ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ps.RobustMax, ps.Softmax])
@pytest.mark.parametrize("bad", [-1.0, 3.0, 1.5, 2.5, float("nan"), float("inf")])
def test_labels_outside_the_classes_are_refused(cls, bad):
    K = 3
    lik = cls(K)
    y = torch.tensor([0.0, 1.0, 2.0, bad])
    with pytest.raises(ValueError, match="labels must be integers in 0..2|NaN or inf"):
        lik.check_y(y)
    if bad not in (3.0, float("nan")):
        return
    # through the model (the SVGP checks y before any site) and the training loop
    gp = ps.SVGP(RBF(2), torch.randn(4, 2), lik, num_outputs=K)
    X = torch.randn(4, 2)
    with pytest.raises(ValueError, match="labels must be integers in 0..2|NaN or inf"):
        Trace_ELBO(max_plate_nesting=2).loss(gp.model, gp.guide, X, y)
    with pytest.raises(ValueError, match="labels must be integers in 0..2|NaN or inf"):
        ps.infer.fit(gp, X, y, num_steps=1, progress=False)


def test_valid_labels_and_bad_arguments():
    lik = ps.RobustMax(3)
    lik.check_y(torch.tensor([0, 1, 2]))  # integer dtype
    lik.check_y(torch.tensor([0.0, 2.0]))  # integral floats
    with pytest.raises(ValueError, match="labels must be integers"):
        lik.check_y(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="K=3"):
        lik.expected_log_prob(torch.zeros(4), torch.zeros(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="K=3"):
        lik.distribution(torch.zeros(4))
    with pytest.raises(ValueError, match="at least 2"):
        ps.RobustMax(1)
    with pytest.raises(ValueError, match="epsilon"):
        ps.RobustMax(3, epsilon=1.0)
    with pytest.raises(ValueError, match="num_samples"):
        ps.Softmax(3, num_samples=0)


# -- (d) a multi-class SVGP: eq. 15 and training -------------------------------------------------------------------
def _dense_qf_kl(gp, X):
    """Per class, from dense matrices: Kuu and Kuf from the Pyro kernel's own 2-D forward, q(f) marginals with an
    explicit inverse of Kuu and the Gaussian KL in closed form. Returns ``(loc [K, N], var [K, N], KL)``."""
    K, M = gp.num_outputs, gp.Z.shape[-2]
    kern = gp.kernel
    locs, vars_, kl = [], [], 0.0
    for c in range(K):
        Z = gp.Z[c] if gp.Z.dim() == 3 else gp.Z
        Kuu = kern(Z) + 1e-10 * kern.variance * torch.eye(M)
        Kuf, kff = kern(Z, X), kern(X, diag=True)
        m, L = gp.q_u.u_loc[c], gp.q_u.u_scale_tril[c]
        S = L @ L.T
        if gp.whiten:  # u = Luu v, q(v) = N(m, S), p(v) = N(0, I)
            Luu = torch.linalg.cholesky(Kuu)
            mu_u, S_u, P_cov = Luu @ m, Luu @ S @ Luu.T, torch.eye(M)
            P_mean = m
        else:
            mu_u, S_u, P_cov, P_mean = m, S, Kuu, m
        P_inv = torch.linalg.inv(P_cov)
        kl = kl + 0.5 * (torch.trace(P_inv @ S) + P_mean @ P_inv @ P_mean - M
                         + torch.logdet(P_cov) - torch.logdet(S))
        A = Kuf.T @ torch.linalg.inv(Kuu)  # [N, M]
        locs.append(A @ mu_u)
        vars_.append(kff - (A * Kuf.T).sum(-1) + (A * (A @ S_u)).sum(-1))
    return torch.stack(locs).detach(), torch.stack(vars_).detach(), kl


def _dense_eq15(gp, X, y, eps):
    """Villacampa-Calvo and Hernández-Lobato (2017), eq. 15, from dense matrices (:func:`_dense_qf_kl`) and
    E_q log p(y_n | f_n) with P_n by scipy's adaptive quadrature."""
    K = gp.num_outputs
    loc, var, kl = _dense_qf_kl(gp, X)
    P = torch.tensor([_p_max_scipy(loc[:, n], var[:, n], int(y[n])) for n in range(X.shape[0])])
    ell = math.log(1 - eps) * P + math.log(eps / (K - 1)) * (1 - P)
    return (ell.sum() - kl).item()


def _three_class_data(N):
    X = torch.randn(N, 2)
    y = ((X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()).to(X.dtype)
    return X, y


@pytest.mark.float64  # the dense reference inverts Kuu explicitly
@pytest.mark.parametrize(
    "per_class_Z, whiten, integrate_f",
    [(False, False, False), (False, True, False), (True, False, False), (True, True, False),
     (True, False, True), (False, True, True)],
    ids=["shared_Z-plain", "shared_Z-whitened", "per_class_Z-plain", "per_class_Z-whitened",
         "per_class_Z-plain-integrated_f", "shared_Z-whitened-integrated_f"],
)
def test_multiclass_svgp_trace_elbo_estimates_eq15(per_class_Z, whiten, integrate_f):
    """Trace_ELBO with vectorised particles (sampled f by default; f integrated out by quadrature given u with
    integrate_f=True) is an unbiased estimate of eq. 15."""
    K, M, N, eps = 3, 5, 20, 0.02
    X, y = _three_class_data(N)
    Z = torch.randn(K, M, 2) if per_class_Z else torch.randn(M, 2)
    with warnings.catch_warnings():  # integrate_f=False: an unbiased estimate that trains nothing (it warns)
        warnings.simplefilter("ignore", ps.layers.UntrainableWarning)
        gp = ps.SVGP(RBF(2, lengthscale=torch.tensor(0.9)), Z, ps.RobustMax(K, epsilon=eps, num_gh=40),
                     num_outputs=K, whiten=whiten, integrate_f=integrate_f)
    with torch.no_grad():
        gp.q_u.set(0.8 * torch.randn(K, M),
                   torch.tril(0.2 * torch.randn(K, M, M), -1) + torch.diag_embed(0.3 + 0.3 * torch.rand(K, M)))
    exact = _dense_eq15(gp, X, y, eps)
    with torch.no_grad():
        # the closed-form bound (what fit(elbo="analytic") maximises) is eq. 15 up to the Gauss-Hermite error
        assert abs(gp.analytic_elbo(X, y).item() - exact) < 1e-3
        elbo = Trace_ELBO(num_particles=100 if integrate_f else 250, vectorize_particles=True, max_plate_nesting=2)
        vals = torch.tensor([-elbo.loss(gp.model, gp.guide, X, y) for _ in range(10)])
    est, se = vals.mean().item(), (vals.std() / math.sqrt(len(vals))).item()
    assert se > 0 and abs(est - exact) < 4 * se, (est, exact, se)


@pytest.mark.parametrize("per_class_Z", [False, True], ids=["shared_Z", "per_class_Z"])
def test_multiclass_svgp_svi_gives_every_parameter_a_gradient(per_class_Z):
    """With f integrated out (quadrature) every parameter gets a gradient (whiten=False: with whitening the bound
    is invariant to the kernel's variance, checked below). SVI then runs a few steps and moves every parameter."""
    K, M, N = 3, 6, 40
    X, y = _three_class_data(N)
    Z = X[:M].clone().expand(K, M, 2).clone() if per_class_Z else X[:M].clone()
    gp = ps.SVGP(RBF(2), Z, ps.RobustMax(K), num_outputs=K, whiten=False, integrate_f=True)
    loss = TraceMeanField_ELBO(max_plate_nesting=2).differentiable_loss(gp.model, gp.guide, X, y)
    loss.backward()
    names = {n for n, _ in gp.named_parameters()}
    assert {"inducing.Z_unconstrained", "kernel.variance_unconstrained", "kernel.lengthscale_unconstrained",
            "q_u.u_loc_unconstrained", "q_u.u_scale_tril_unconstrained"} <= names
    assert_gradients(parameter_gradients(gp))
    gp.zero_grad()
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    svi = SVI(gp.model, gp.guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO(max_plate_nesting=2))
    losses = [svi.step(X, y) for _ in range(5)]
    assert all(math.isfinite(v) for v in losses)
    for name, p in gp.named_parameters():
        assert (p.detach() - before[name]).abs().max() > 0, name
    # a sampled f site also runs (it estimates the same bound; robust-max gives it no pathwise gradient)
    gp2 = ps.SVGP(RBF(2), Z, ps.RobustMax(K), num_outputs=K)
    svi2 = SVI(gp2.model, gp2.guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO(max_plate_nesting=2))
    assert all(math.isfinite(svi2.step(X, y)) for _ in range(3))


def test_robust_max_whitened_bound_is_invariant_to_the_kernel_variance():
    K, M, N = 3, 6, 40
    X, y = _three_class_data(N)
    gp = ps.SVGP(RBF(2), X[:M].clone(), ps.RobustMax(K), num_outputs=K, whiten=True)
    with torch.no_grad():
        gp.q_u.set(torch.randn(K, M), 0.5 * torch.eye(M).expand(K, M, M))
        a = gp.analytic_elbo(X, y).item()
        gp.kernel.variance = torch.tensor(7.0)
        b = gp.analytic_elbo(X, y).item()
        gp.kernel.lengthscale = torch.tensor(3.0)
        c = gp.analytic_elbo(X, y).item()
    assert abs(a - b) < 100 * torch.finfo(X.dtype).eps * abs(a) and abs(a - c) > 1.0


def test_multiclass_svgp_learns():
    K, N = 3, 60
    X, y = _three_class_data(N)
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(K), num_outputs=K, integrate_f=True)
    state = ps.infer.fit(gp, X, y, num_steps=30, batch_size=N, lr=0.1, elbo="analytic", progress=False)
    assert state.losses[-1] < state.losses[0]
    probs = gp.predict(X, full=True)[2].probs  # [N, K]
    assert probs.shape == (N, K)
    assert (probs.argmax(-1).to(y.dtype) == y).to(X.dtype).mean() > 0.8


# -- (e) softmax ---------------------------------------------------------------------------------------------------
def test_softmax_two_classes_is_unbiased_against_exact_quadrature():
    """K = 2: log softmax(f)_y = log sigmoid(d), d = f_y - f_o ~ N(m_y - m_o, v_y + v_o); its expectation and its
    gradient in m_y (E[1 - sigmoid(d)]) by scipy's quadrature."""
    lik = ps.Softmax(2, num_samples=20)
    loc, var = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.3, -0.5]]), torch.tensor([[0.5, 1.0, 2.0], [1.0, 0.2, 0.7]])
    y = torch.tensor([0, 1, 0])
    R = 2000
    locr = loc.expand(R, 2, 3).clone().requires_grad_(True)
    ell = lik.expected_log_prob(y, locr, var)  # R independent estimates, [R, 1, 3]
    (g,) = torch.autograd.grad(ell.sum(), locr)
    g = g.gather(-2, y.expand(R, 1, 3))[:, 0]  # d/dm_y, [R, 3]
    ell = ell[:, 0].detach()
    for b in range(3):
        o = 1 - int(y[b])
        mu, sd = (loc[y[b], b] - loc[o, b]).item(), (var[0, b] + var[1, b]).sqrt().item()
        exact = integrate.quad(lambda d, mu=mu, sd=sd: stats.norm.pdf(d, mu, sd) * -np.logaddexp(0, -d), -np.inf,
                               np.inf)[0]
        dexact = integrate.quad(lambda d, mu=mu, sd=sd: stats.norm.pdf(d, mu, sd) * special.expit(-d), -np.inf,
                                np.inf)[0]
        assert abs(ell[:, b].mean().item() - exact) < 4 * ell[:, b].std().item() / math.sqrt(R)
        assert abs(g[:, b].mean().item() - dexact) < 4 * g[:, b].std().item() / math.sqrt(R)


def test_softmax_expected_log_prob_is_unbiased():
    K, n, R, S = 4, 5, 400, 400_000
    lik = ps.Softmax(K, num_samples=50)
    loc, var = torch.randn(K, n), 0.3 + torch.rand(K, n)
    y = torch.randint(0, K, (n,))
    with torch.no_grad():
        reps = lik.expected_log_prob(y, loc.expand(R, K, n), var)[:, 0]  # R estimates, [R, n]
        f = loc + var.sqrt() * torch.randn(S, K, n)
        ref = torch.log_softmax(f, dim=-2).gather(-2, y.expand(S, 1, n))[:, 0]
    se = (reps.var(0) / R + ref.var(0) / S).sqrt()
    assert ((reps.mean(0) - ref.mean(0)).abs() < 4 * se).all()
    # predictive: normalised, and unbiased for E softmax(f)
    probs = lik.predictive(loc, var).probs  # [n, K], 100 draws
    torch.testing.assert_close(probs.sum(-1), torch.ones(n))
    sm = torch.softmax(f, dim=-2)
    assert ((probs.T - sm.mean(0)).abs() < 5 * sm.std(0) / math.sqrt(lik.num_samples)).all()


def test_softmax_svgp_trains_through_a_sampled_f():
    """Softmax is smooth in f: with the default sampled f site every parameter gets a pathwise gradient."""
    K, N = 3, 30
    X, y = _three_class_data(N)
    gp = ps.SVGP(RBF(2), torch.randn(K, 5, 2), ps.Softmax(K), num_outputs=K, whiten=False)
    with torch.no_grad():
        gp.q_u.set(torch.randn(K, 5), gp.q_u.u_scale_tril.detach() * 0.5)
    loss = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2).differentiable_loss(
        gp.model, gp.guide, X, y)
    loss.backward()
    assert_gradients(parameter_gradients(gp))


# -- (f) shapes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
@pytest.mark.parametrize("cls", [ps.RobustMax, ps.Softmax])
def test_shapes(cls, batch_shape):
    K, n = 3, 5
    lik = cls(K)
    f = torch.randn(batch_shape + (K, n))
    var = 0.5 + torch.rand(batch_shape + (K, n))
    site = batch_shape + (1, n)  # the classes' dimension stays as a singleton (Pyro's outputs plate)
    assert lik.y_shape(f.shape) == site
    d = lik.distribution(f)
    assert isinstance(d, pyro.distributions.Categorical) and d.batch_shape == site and d.event_shape == ()
    assert d.sample().shape == site and d.sample((7,)).shape == (7,) + site
    y = torch.randint(0, K, (n,))
    assert d.log_prob(y).shape == site
    p = lik.predictive(f, var)
    assert isinstance(p, pyro.distributions.Categorical) and p.batch_shape == batch_shape + (n,)
    assert p.probs.shape == batch_shape + (n, K)
    assert lik.predictive_log_prob(y, f, var).shape == batch_shape + (n,)
    yb = torch.randint(0, K, batch_shape + (n,))
    torch.manual_seed(1)
    e_flat = lik.expected_log_prob(yb, f, var)  # labels shaped like f without its classes
    torch.manual_seed(1)
    e_site = lik.expected_log_prob(yb.unsqueeze(-2), f, var)  # labels shaped like the site
    assert e_flat.shape == site
    torch.testing.assert_close(e_flat, e_site)
    assert lik.expected_log_prob(y, f, var).shape == site
    if cls is ps.RobustMax:  # deterministic: equal to the computation one batch element at a time
        if batch_shape:
            per = torch.stack([lik.expected_log_prob(yi, fi, vi) for yi, fi, vi in
                               zip(yb.reshape(-1, n), f.reshape(-1, K, n), var.reshape(-1, K, n), strict=True)])
            torch.testing.assert_close(e_flat, per.reshape(site))
            per_p = torch.stack([lik.predictive(fi, vi).probs for fi, vi in
                                 zip(f.reshape(-1, K, n), var.reshape(-1, K, n), strict=True)])
            torch.testing.assert_close(p.probs, per_p.reshape(batch_shape + (n, K)))
        # the labels of the distribution's argmax: probability 1 - eps
        top = f.argmax(-2).unsqueeze(-2)
        torch.testing.assert_close(d.log_prob(top), torch.full(site, math.log(1 - lik.epsilon)))
    # the observed site with f integrated out (SVGP(..., integrate_f=True)) follows the same shapes
    md = MarginalizedLikelihood(lik, f, var)
    assert md.batch_shape == site and md.sample().shape == site
    torch.manual_seed(2)
    a = md.log_prob(y)
    torch.manual_seed(2)
    torch.testing.assert_close(a, lik.expected_log_prob(y, f, var))
    assert md.expand((6,) + site).log_prob(y).shape == (6,) + site


@pytest.mark.parametrize("integrate_f", [False, True], ids=["sampled_f", "integrated_f"])
def test_multiclass_svgp_predictive_samples_labels(integrate_f):
    K, N = 4, 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ps.layers.UntrainableWarning)
        gp = ps.SVGP(RBF(2), torch.randn(K, 5, 2), ps.RobustMax(K), num_outputs=K, integrate_f=integrate_f)
    # Predictive pads every site to the model's plate nesting (2: the classes' plate): [S, 1, N]
    s = Predictive(gp.model, guide=gp.guide, num_samples=6, return_sites=["gp.u", "y"])(torch.randn(N, 2))
    assert s["gp.u"].shape == (6, K, 1, 5) and s["y"].shape == (6, 1, N)
    gp.likelihood.check_y(s["y"])


@pytest.mark.float64  # the dense reference inverts Kuu explicitly
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_softmax_bound_trace_elbo_and_closed_form_estimate_the_dense_bound(whiten):
    """The softmax bound sum_n E_q log softmax(f_n)_{y_n} - KL (Hensman, Matthews, Ghahramani 2015, eq. 15 with the
    softmax likelihood): Trace_ELBO (sampled u and f) and ``analytic_elbo`` (q(f) in closed form, Monte Carlo over
    f) both estimate it without bias. The reference: dense q(f) marginals and KL, and 400,000 draws of f per point;
    every tolerance is 4 computed standard errors."""
    K, M, N = 3, 5, 20
    X, y = _three_class_data(N)
    gp = ps.SVGP(RBF(2, lengthscale=torch.tensor(0.9)), torch.randn(M, 2), ps.Softmax(K, num_samples=64),
                 num_outputs=K, whiten=whiten)
    with torch.no_grad():
        gp.q_u.set(0.8 * torch.randn(K, M),
                   torch.tril(0.2 * torch.randn(K, M, M), -1) + torch.diag_embed(0.3 + 0.3 * torch.rand(K, M)))
    loc, var, kl = _dense_qf_kl(gp, X)
    S = 200_000
    f = loc + var.sqrt() * torch.randn(S, K, N)  # q(f) factorises over classes: independent GPs
    ell = torch.log_softmax(f, dim=-2).gather(-2, y.long().expand(S, 1, N))[:, 0]  # [S, N]
    ref, ref_se = (ell.mean(0).sum() - kl).item(), (ell.var(0).sum() / S).sqrt().item()
    with torch.no_grad():
        elbo = Trace_ELBO(num_particles=100, vectorize_particles=True, max_plate_nesting=2)
        traced = torch.tensor([-elbo.loss(gp.model, gp.guide, X, y) for _ in range(8)])
        closed = torch.stack([gp.analytic_elbo(X, y) for _ in range(20)])
    for vals in (traced, closed):
        est, se = vals.mean().item(), (vals.std() / math.sqrt(len(vals))).item()
        assert se > 0 and abs(est - ref) < 4 * math.hypot(se, ref_se), (est, ref, se, ref_se)
