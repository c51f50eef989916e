"""The Pólya-Gamma augmented bound (Wenzel et al. 2019) in closed form: it is the Jaakkola-Jordan bound for every c,
below the exact logit ELBO, tight as q(f) concentrates; the closed-form natural-gradient step with fixed c lands on
the optimal q(u) for that c."""

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import polya_gamma as PG
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.infer.natgrad import polya_gamma_natgrad_step
from pyro_sparsegp.likelihoods.polya_gamma import jaakkola_jordan_bound, optimal_c

N, M, D = 30, 6, 2


def _problem(whiten=False):
    X = torch.rand(N, D) * 4 - 2
    y = (torch.sin(2 * X[:, 0]) + 0.3 * torch.randn(N) > 0).to(X.dtype)
    k = RBF(D, variance=torch.tensor(2.0), lengthscale=torch.tensor(0.8))
    Z = torch.rand(M, D) * 4 - 2
    gp = ps.SVGP(k, Z, ps.PolyaGammaLogit(), whiten=whiten)
    with torch.no_grad():
        L = torch.tril(0.2 * torch.randn(M, M), -1) + torch.diag(0.3 + 0.3 * torch.rand(M))
        gp.q_u.set(torch.randn(M), L)
    with torch.no_grad():
        Kuu, Kuf, kd = k(Z) + 1e-10 * torch.eye(M), k(Z, X), k(X, diag=True)
    return X, y, gp, Kuu, Kuf, kd


@pytest.mark.float64
def test_bound_equals_jaakkola_jordan_for_every_c():
    X, y, gp, Kuu, Kuf, kd = _problem()
    m, L = gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    mu, var = B.qf_dense(Kuu, Kuf, kd, m, L)
    kl = B.gauss_kl(m, L, Kuu)
    for c in (torch.rand(N) * 3 + 0.05, optimal_c(mu, var), torch.full((N,), 1e-6)):
        jj = jaakkola_jordan_bound(y, mu, var, c).sum() - kl
        torch.testing.assert_close(PG.pg_bound(y, Kuu, Kuf, kd, m, L, c=c), jj, rtol=1e-10, atol=1e-10)
    # the optimal c maximises the bound over c
    best = PG.pg_bound(y, Kuu, Kuf, kd, m, L)
    for _ in range(5):
        assert PG.pg_bound(y, Kuu, Kuf, kd, m, L, c=torch.rand(N) * 4) <= best + 1e-12


def test_bound_is_below_the_logit_elbo_and_tight_as_q_concentrates():
    X, y, gp, Kuu, Kuf, kd = _problem()
    logit = ps.Bernoulli("logit", num_gh=60)
    m, L = gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    gaps = []
    for shrink in (1.0, 0.1, 0.01):
        # Z = X makes p(f|u) deterministic; shrinking S concentrates q(f)
        K = gp.kernel(X).detach() + 1e-8 * torch.eye(N)
        mm = torch.linalg.cholesky(K) @ torch.randn(N) * 0.5
        LL = shrink * torch.linalg.cholesky(K)
        pg = PG.pg_bound(y, K, K, kd, mm, LL)
        exact = B.kl_sparse_bound(y, logit.expected_log_prob, K, K, kd, mm, LL)
        assert pg <= exact + 1e-9
        kl = B.gauss_kl(mm, LL, K)
        gaps.append(((exact + kl) - (pg + kl)).item())  # the gap of the expected log-likelihood terms
    assert gaps[0] > gaps[1] > gaps[2] >= 0
    assert gaps[2] < 1e-3 * gaps[0]
    # and with the random q(u) of the problem too
    assert PG.pg_bound(y, Kuu, Kuf, kd, m, L) <= B.kl_sparse_bound(y, logit.expected_log_prob, Kuu, Kuf, kd, m, L)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_natgrad_step_with_fixed_c_lands_on_the_optimum_for_that_c(whiten):
    X, y, gp, Kuu, Kuf, kd = _problem(whiten)
    c = torch.rand(N) * 2 + 0.1
    polya_gamma_natgrad_step(gp, X, y, lr=1.0, c=c)
    m = gp.q_u.u_loc.detach().clone().requires_grad_(True)
    Lraw = gp.q_u.u_scale_tril.detach().clone().requires_grad_(True)
    bound = PG.pg_bound(y, Kuu, Kuf, kd, m, torch.tril(Lraw), c=c, whiten=whiten)
    gm, gL = torch.autograd.grad(bound, (m, Lraw))
    assert gm.abs().max() < 1e-7 and torch.tril(gL).abs().max() < 1e-7
    # a different q(u) has a lower bound
    assert PG.pg_bound(y, Kuu, Kuf, kd, m + 0.05, torch.tril(Lraw), c=c, whiten=whiten) < bound


def test_natgrad_iterations_with_local_updates_increase_the_bound():
    X, y, gp, Kuu, Kuf, kd = _problem()
    values = []
    for _ in range(10):
        polya_gamma_natgrad_step(gp, X, y, lr=1.0)
        values.append(PG.pg_bound(y, Kuu, Kuf, kd, gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()).item())
    # monotone up to rounding: float64 resolves 1e-9, float32 about 1e-6 of the bound's magnitude
    tol = 1e-9 if torch.get_default_dtype() == torch.float64 else 1e-5 * abs(values[-1])
    assert all(b >= a - tol for a, b in zip(values[:-1], values[1:], strict=True))


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_module_analytic_elbo_is_the_augmented_bound(whiten):
    X, y, gp, Kuu, Kuf, kd = _problem(whiten)
    with torch.no_grad():
        dense = PG.pg_bound(y, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=whiten)
        torch.testing.assert_close(gp.analytic_elbo(X, y), dense, rtol=1e-8, atol=1e-8)


def test_pg_fit_with_natural_gradients_classifies():
    # 200 points (not _problem's 30, whose training accuracy swings from 0.67 to 0.93 with the draw): over 20 seeds
    # the fit's accuracy stays within 0.07 of the noiseless rule sin(2 x_0) > 0 and above 0.82
    X = torch.rand(200, D) * 4 - 2
    y = (torch.sin(2 * X[:, 0]) + 0.3 * torch.randn(200) > 0).to(X.dtype)
    k = RBF(D, variance=torch.tensor(2.0), lengthscale=torch.tensor(0.8))
    gp = ps.SVGP(k, torch.rand(10, D) * 4 - 2, ps.PolyaGammaLogit(), whiten=True)
    state = ps.infer.fit(gp, X, y, num_steps=60, batch_size=200, lr=0.02, natgrad=1.0, elbo="analytic",
                         progress=False)
    assert state.losses[-1] < state.losses[0]
    mean, var = gp.predict(X)
    acc = ((mean > 0).to(y.dtype) == y).to(torch.float64).mean()
    rule = ((torch.sin(2 * X[:, 0]) > 0).to(y.dtype) == y).to(torch.float64).mean()
    assert acc > 0.8 and acc >= rule - 0.1, (acc, rule)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("elbo_cls", ["Trace", "MeanField"])
def test_augmented_sites_estimate_the_closed_form_bound(elbo_cls, whiten):
    """Model: u, f, omega ~ PG(1, 0), y from the augmented factor; guide: q(u), p(f|u), omega ~ PG(1, c*).
    Trace_ELBO with many particles matches L(c*) within 4 standard errors; TraceMeanField_ELBO uses the
    closed-form PG KL."""
    import math

    from pyro.infer import Trace_ELBO, TraceMeanField_ELBO

    X, y, gp, Kuu, Kuf, kd = _problem(whiten)
    cls = Trace_ELBO if elbo_cls == "Trace" else TraceMeanField_ELBO
    with torch.no_grad():
        exact = PG.pg_bound(y, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=whiten).item()
        elbo = cls(num_particles=400, vectorize_particles=True, max_plate_nesting=1)
        vals = torch.tensor([-elbo.loss(gp.model, gp.guide, X, y) for _ in range(40)])
    est, se = vals.mean().item(), (vals.std() / math.sqrt(len(vals))).item()
    assert abs(est - exact) < 4 * se, (est, exact, se)
    tr = pyro.poutine.trace(gp.guide).get_trace(X, y)
    assert isinstance(tr.nodes["gp.omega"]["fn"], ps.distributions.PolyaGamma)
