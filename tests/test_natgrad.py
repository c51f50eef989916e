"""Natural-gradient steps (Hensman 2013, section 3.2) against the dense optimum of section 2."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.infer import gaussian_natgrad_step, natgrad_step

N, M, D = 60, 8, 2


def _gp(whiten, num_outputs=None):
    X = torch.rand(N, D) * 4 - 2
    f = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1]
    y = f + 0.2 * torch.randn(N)
    if num_outputs:
        y = torch.stack([y, -y + 0.1 * torch.randn(N)], -1)
    gp = ps.SVGP(
        RBF(D, lengthscale=torch.tensor(0.8)),
        torch.rand(M, D) * 4 - 2,
        ps.Gaussian(0.05),
        num_outputs=num_outputs,
        whiten=whiten,
    )
    return X, y, gp


def _optimum(gp, X, y):
    k = gp.kernel
    Kuu = k(gp.Z) + 1e-10 * torch.eye(M)
    m, L = B.optimal_qu(y, gp.likelihood.noise, Kuu, k(gp.Z, X))
    if gp.whiten:
        Luu = torch.linalg.cholesky(Kuu)
        m = torch.linalg.solve_triangular(Luu, m.unsqueeze(-1), upper=False).squeeze(-1)
        L = torch.linalg.cholesky(
            torch.linalg.solve_triangular(
                Luu, torch.linalg.solve_triangular(Luu, L @ L.mT, upper=False).mT, upper=False
            )
        )
    return m, L


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("step", [gaussian_natgrad_step, natgrad_step], ids=["closed_form", "autograd"])
def test_one_full_batch_step_of_length_one_lands_on_the_optimum(step, whiten):
    X, y, gp = _gp(whiten)
    step(gp, X, y, lr=1.0)
    m, L = _optimum(gp, X, y)
    torch.testing.assert_close(gp.q_u.u_loc, m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gp.q_u.u_scale_tril @ gp.q_u.u_scale_tril.mT, L @ L.mT, rtol=1e-6, atol=1e-6)
    # and the bound there is Titsias' collapsed bound (Hensman 2013 section 2)
    k = gp.kernel
    with torch.no_grad():
        Kuu, Kuf, kd = k(gp.Z) + 1e-10 * torch.eye(M), k(gp.Z, X), k(X, diag=True)
        bound = B.kl_sparse_bound(
            y, gp.likelihood.expected_log_prob, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=whiten
        )
        assert abs(bound - B.titsias_bound(y, gp.likelihood.noise, Kuu, Kuf, kd)) < 1e-6 * abs(bound)


def test_minibatch_steps_converge_to_the_optimum():
    """With N/B scaling and decreasing steps, minibatch natural gradients approach the full-batch optimum."""
    X, y, gp = _gp(whiten=True)
    g = torch.Generator().manual_seed(0)
    for t in range(1000):
        idx = torch.randperm(N, generator=g)[:30]
        gaussian_natgrad_step(gp, X[idx], y[idx], lr=1.0 / (t + 2) ** 0.7, num_data=N)
    m, L = _optimum(gp, X, y)
    # from the prior (error = |m|) to within a few per cent of the optimum
    assert (gp.q_u.u_loc - m).abs().max() < 0.05 * m.abs().max()


def test_multi_output_step_matches_each_output_alone():
    X, y, gp = _gp(whiten=True, num_outputs=2)
    gaussian_natgrad_step(gp, X, y, lr=1.0)
    for out in range(2):
        X1, _, gp1 = X, None, ps.SVGP(gp.kernel, gp.Z.detach(), gp.likelihood, whiten=True)
        gaussian_natgrad_step(gp1, X1, y[:, out], lr=1.0)
        torch.testing.assert_close(gp.q_u.u_loc[out], gp1.q_u.u_loc)


@pytest.mark.float64
def test_non_conjugate_step_increases_the_bound():
    X, y, gp = _gp(whiten=True)
    y = (y > 0).to(X.dtype)
    gp.likelihood = ps.Bernoulli("probit")
    k = gp.kernel

    def bound():
        with torch.no_grad():
            Kuu, Kuf, kd = k(gp.Z) + 1e-10 * torch.eye(M), k(gp.Z, X), k(X, diag=True)
            return B.kl_sparse_bound(
                y, gp.likelihood.expected_log_prob, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=True
            )

    values = [bound()]
    for _ in range(15):
        natgrad_step(gp, X, y, lr=0.5)
        values.append(bound())
    assert all(b > a - 1e-9 for a, b in zip(values[:-1], values[1:], strict=True))
    assert values[-1] > values[0] + 1.0
