"""Robust-max and softmax likelihoods (Villacampa-Calvo and Hernández-Lobato 2017): expectations against Monte
Carlo, predictive probabilities, label validation, and a multi-class SVGP whose Trace_ELBO estimates eq. 15."""
import math

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B


@pytest.mark.parametrize("K", [2, 3, 6])
def test_robust_max_expected_log_prob_matches_monte_carlo(K):
    lik = ps.RobustMax(K, epsilon=0.05, num_gh=40)
    n = 6
    loc, var = torch.randn(K, n), 0.2 + torch.rand(K, n)
    y = torch.randint(0, K, (n,)).to(loc.dtype)
    with torch.no_grad():
        quad = lik.expected_log_prob(y, loc, var)[0]
        f = loc + var.sqrt() * torch.randn(200_000, K, n)
        vals = lik.distribution(f).log_prob(y)[:, 0]
    mc, se = vals.mean(0), vals.std(0) / math.sqrt(vals.shape[0])
    assert ((quad - mc).abs() < 4 * se + 1e-10).all(), (quad, mc, se)


@pytest.mark.parametrize("K", [3, 5])
def test_robust_max_predictive_probabilities(K):
    lik = ps.RobustMax(K, epsilon=0.01, num_gh=40)
    loc, var = torch.randn(K, 4), 0.1 + torch.rand(K, 4)
    probs = lik.predictive(loc, var).probs  # [4, K]
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    f = loc + var.sqrt() * torch.randn(200_000, K, 4)
    mc = lik.distribution(f).probs[:, 0].mean(0)
    assert (probs - mc).abs().max() < 5e-3


def test_labels_outside_the_classes_are_refused():
    lik = ps.RobustMax(3)
    loc, var = torch.zeros(3, 4), torch.ones(3, 4)
    for bad in (-1.0, 3.0, 1.5, float("nan")):
        y = torch.tensor([0.0, 1.0, 2.0, bad])
        with pytest.raises(ValueError):
            lik.check_y(y)
    gp = ps.SVGP(RBF(2), torch.randn(4, 2), lik, num_outputs=3)
    with pytest.raises(ValueError, match="labels must be integers"):
        Trace_ELBO().loss(gp.model, gp.guide, torch.randn(4, 2), torch.tensor([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="at least 2"):
        ps.RobustMax(1)


def test_softmax_expected_log_prob_is_unbiased():
    K, n = 4, 5
    lik = ps.Softmax(K, num_samples=50)
    loc, var = torch.randn(K, n), 0.3 + torch.rand(K, n)
    y = torch.randint(0, K, (n,)).to(loc.dtype)
    with torch.no_grad():
        reps = torch.stack([lik.expected_log_prob(y, loc, var)[0] for _ in range(400)])
        f = loc + var.sqrt() * torch.randn(400_000, K, n)
        ref = lik.distribution(f).log_prob(y)[:, 0]
    se = (reps.var(0) / 400 + ref.var(0) / 400_000).sqrt()
    assert ((reps.mean(0) - ref.mean(0)).abs() < 4 * se).all()
    torch.testing.assert_close(lik.predictive(loc, var).probs.sum(-1), torch.ones(n))


@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
@pytest.mark.parametrize("cls", [ps.RobustMax, ps.Softmax])
def test_shapes(cls, batch_shape):
    K, n = 3, 5
    lik = cls(K)
    f = torch.randn(batch_shape + (K, n))
    d = lik.distribution(f)
    assert d.batch_shape == batch_shape + (1, n)  # the classes' dimension stays as a singleton (plates)
    assert lik.predictive(f, torch.ones_like(f)).batch_shape == batch_shape + (n,)
    y = torch.randint(0, K, batch_shape + (n,)).to(f.dtype)
    assert lik.expected_log_prob(y, f, torch.ones_like(f)).shape == batch_shape + (1, n)


def _eq15_dense(gp, X, y):
    """Villacampa-Calvo eq. 15: sum_n E_q log p(y_n | f_n) - sum_k KL[q(u_k) || p(u_k)], from dense matrices
    built per class with Pyro's 2-D kernel."""
    K, M = gp.num_outputs, gp.Z.shape[-2]
    k = gp.kernel
    locs, vars_, kl = [], [], 0.0
    for c in range(K):
        Z = gp.Z[c] if gp.Z.dim() == 3 else gp.Z
        Kuu = k(Z) + 1e-10 * torch.eye(M)
        m, L = gp.q_u.u_loc[c], gp.q_u.u_scale_tril[c]
        if gp.whiten:
            Luu = torch.linalg.cholesky(Kuu)
            mu, var = B.qf_dense(Kuu, k(Z, X), k(X, diag=True), Luu @ m, Luu @ L)
            kl = kl + B.gauss_kl(m, L)
        else:
            mu, var = B.qf_dense(Kuu, k(Z, X), k(X, diag=True), m, L)
            kl = kl + B.gauss_kl(m, L, Kuu)
        locs.append(mu)
        vars_.append(var)
    ell = gp.likelihood.expected_log_prob(y, torch.stack(locs), torch.stack(vars_))
    return ell.sum() - kl


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("per_class_Z", [False, True], ids=["shared_Z", "per_class_Z"])
def test_multiclass_svgp_estimates_eq15(per_class_Z, whiten):
    K, M, N = 3, 5, 25
    X = torch.randn(N, 2)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    y = y.to(X.dtype)
    Z = torch.randn(K, M, 2) if per_class_Z else torch.randn(M, 2)
    gp = ps.SVGP(RBF(2, lengthscale=torch.tensor(0.8)), Z, ps.RobustMax(K, epsilon=0.02, num_gh=30),
                 num_outputs=K, whiten=whiten)
    with torch.no_grad():
        gp.q_u.set(torch.randn(K, M), torch.tril(0.2 * torch.randn(K, M, M), -1) + torch.diag_embed(
            0.3 + 0.3 * torch.rand(K, M)))
        exact = _eq15_dense(gp, X, y).item()
        torch.testing.assert_close(gp.analytic_elbo(X, y).item(), exact, rtol=1e-7, atol=1e-7)
        elbo = Trace_ELBO(num_particles=400, vectorize_particles=True, max_plate_nesting=2)
        vals = torch.tensor([-elbo.loss(gp.model, gp.guide, X, y) for _ in range(40)])
    est, se = vals.mean().item(), (vals.std() / math.sqrt(len(vals))).item()
    assert abs(est - exact) < 4 * se, (est, exact, se)


def test_multiclass_training_gives_every_parameter_a_gradient_and_learns():
    """With f integrated out (quadrature) every parameter gets a gradient; a sampled f would give none to the
    kernel and Z, since robust-max is piecewise constant in f."""
    K, N = 3, 90
    X = torch.randn(N, 2)
    y = ((X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()).to(X.dtype)
    gp = ps.SVGP(RBF(2), torch.randn(8, 2), ps.RobustMax(K), num_outputs=K, integrate_f=True)
    loss = TraceMeanField_ELBO(max_plate_nesting=2).differentiable_loss(gp.model, gp.guide, X, y)
    loss.backward()
    for name, p in gp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    state = ps.infer.fit(gp, X, y, num_steps=150, batch_size=N, lr=0.05, elbo="analytic", progress=False)
    assert state.losses[-1] < state.losses[0]
    probs = gp.predict(X, full=True)[2].probs
    assert (probs.argmax(-1).to(y.dtype) == y).to(torch.float64).mean() > 0.8
