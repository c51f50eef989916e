"""Likelihoods: quadrature against Monte Carlo, closed forms against the generic quadrature, predictive
distributions against numerical integration; gradients of the bound against finite differences."""

import math

import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.likelihoods import Likelihood

LIKELIHOODS = {
    "gaussian": lambda: ps.Gaussian(noise=0.4),
    "probit": lambda: ps.Bernoulli("probit"),
    "logit": lambda: ps.Bernoulli("logit"),
}


def _labels(name, n):
    if name == "gaussian":
        return torch.randn(n)
    return torch.randint(0, 2, (n,)).to(torch.get_default_dtype())


@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_expected_log_prob_matches_monte_carlo(name):
    lik = LIKELIHOODS[name]()
    n = 7
    y = _labels(name, n)
    loc, var = torch.randn(n), 0.1 + torch.rand(n) * 2
    with torch.no_grad():
        quad = lik.expected_log_prob(y, loc, var)
        f = loc + var.sqrt() * torch.randn(400_000, n)
        vals = lik.distribution(f).log_prob(y)
    mc, se = vals.mean(0), vals.std(0) / math.sqrt(vals.shape[0])
    assert ((quad - mc).abs() < 4 * se + 1e-12).all(), (quad, mc, se)


def test_gaussian_closed_form_equals_generic_quadrature():
    lik = ps.Gaussian(noise=0.3)
    y, loc, var = torch.randn(5), torch.randn(5), torch.rand(5)
    with torch.no_grad():
        torch.testing.assert_close(lik.expected_log_prob(y, loc, var), lik.quadrature_expected_log_prob(y, loc, var))
    # the generic method is the base-class one, not an override
    assert type(lik).quadrature_expected_log_prob is Likelihood.quadrature_expected_log_prob


@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_predictive_matches_numerical_integration(name):
    lik = LIKELIHOODS[name]()
    y = _labels(name, 4)
    loc, var = torch.randn(4), torch.rand(4) + 0.2
    grid = torch.linspace(-12, 12, 20001)
    with torch.no_grad():
        dens = dist.Normal(loc[:, None], var.sqrt()[:, None]).log_prob(grid).exp()
        integrand = dens * lik.distribution(grid.expand(4, -1)).log_prob(y[:, None]).exp()
        numeric = torch.trapezoid(integrand, grid, dim=-1).log()
        torch.testing.assert_close(lik.predictive_log_prob(y, loc, var), numeric, rtol=1e-6, atol=1e-6)


@pytest.mark.float64
@pytest.mark.parametrize("name", ["gaussian", "probit"])
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_gradients_of_the_bound_match_finite_differences(name, whiten):
    """gradcheck of eq. 21 (our fast q(f) path) with respect to Z, kernel hyperparameters, m and L."""
    N, M, D = 12, 4, 2
    X = torch.randn(N, D)
    y = _labels(name, N)
    lik = LIKELIHOODS[name]()

    kernel = RBF(D)
    gp = ps.SVGP(kernel, torch.randn(M, D), lik, whiten=whiten)
    del kernel.variance, kernel.lengthscale, gp.Z  # replaced by the differentiable test inputs at each call

    def bound(Z, log_var, log_ls, m, L_raw):
        kernel.variance, kernel.lengthscale, gp.Z = log_var.exp(), log_ls.exp(), Z
        Luu, W, kd = gp.strategy.factors(X, consume=True)
        L = torch.tril(L_raw, -1) + torch.diag_embed(L_raw.diagonal().exp())
        loc, var = ps.conditionals.qf_marginals(W, kd, m, L, None if whiten else Luu)
        kl = B.gauss_kl(m, L, None if whiten else Luu @ Luu.mT)
        return lik.expected_log_prob(y, loc, var).sum() - kl

    args = (
        torch.randn(M, D),
        torch.tensor(0.2),
        torch.tensor([-0.1, 0.3]),
        torch.randn(M),
        0.3 * torch.randn(M, M),
    )
    args = tuple(a.clone().requires_grad_(True) for a in args)
    assert torch.autograd.gradcheck(bound, args, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_bernoulli_rejects_bad_link():
    with pytest.raises(ValueError, match="link"):
        ps.Bernoulli("cloglog")
