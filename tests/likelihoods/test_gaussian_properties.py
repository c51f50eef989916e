"""Properties of the Gaussian likelihood (``pyro_sparsegp.likelihoods.gaussian``; Hensman, Fusi, Lawrence 2013,
eq. 4): the closed-form expected log-likelihood equals the Monte Carlo average of ``log N(y; f, sigma^2)`` under
``q(f)`` (and the generic Gauss-Hermite quadrature, exact for a quadratic), the predictive is ``N(m, v + sigma^2)``
(its samples' mean and variance), the documented defaults, the noise check, and the registry of live Gaussian
likelihoods (copies and unpickled ones included)."""

import copy
import pickle

import pytest
import torch

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods import Likelihood
from pyro_sparsegp.likelihoods.base import live_gaussian_likelihoods


def test_expected_log_prob_is_the_average_log_density():
    lik = ps.Gaussian(noise=0.3)
    y, m, v = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.0, -0.5, 3.0]), torch.tensor([0.2, 1.0, 4.0])
    got = lik.expected_log_prob(y, m, v)
    generic = Likelihood.quadrature_expected_log_prob(lik, y, m, v)  # GH is exact for the quadratic log-density
    torch.testing.assert_close(got, generic, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    n = 200_000
    f = m + v.sqrt() * torch.randn(n, 3)
    lp = torch.distributions.Normal(f, 0.3 ** 0.5).log_prob(y)
    assert bool(((lp.mean(0) - got).abs() < 5 * lp.std(0) / n ** 0.5).all())


def test_predictive_is_the_convolution():
    lik = ps.Gaussian(noise=0.5)
    m, v = torch.tensor([1.0, -2.0]), torch.tensor([0.25, 3.0])
    d = lik.predictive(m, v)
    torch.testing.assert_close(d.mean, m)
    torch.testing.assert_close(d.variance, v + 0.5)
    torch.manual_seed(1)
    n = 200_000
    y = m + v.sqrt() * torch.randn(n, 2) + 0.5 ** 0.5 * torch.randn(n, 2)
    assert bool(((y.var(0) - d.variance).abs() < 5 * d.variance * (2 / n) ** 0.5).all())


def test_defaults_and_noise_check():
    lik = ps.Gaussian()
    assert float(lik.noise.detach()) == pytest.approx(1.0) and lik.num_gh == 20
    for bad in (0.0, -1.0, float("nan"), float("inf"), [0.1, 0.2]):
        with pytest.raises(ValueError, match="noise .* must be one finite positive number"):
            ps.Gaussian(noise=bad)
    assert float(ps.Gaussian(noise=torch.tensor(2.0)).noise.detach()) == pytest.approx(2.0)


def test_live_registry_counts_copies():
    lik = ps.Gaussian(0.2)
    c = copy.deepcopy(lik)
    u = pickle.loads(pickle.dumps(lik))
    live = live_gaussian_likelihoods()
    assert all(any(x is obj for x in live) for obj in (lik, c, u))
    assert float(u.noise.detach()) == pytest.approx(0.2)
