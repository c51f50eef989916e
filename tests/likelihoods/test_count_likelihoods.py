"""Count likelihoods: Poisson, negative binomial (NB2; NB1 with ``variance="NB1"``), zero-inflated Poisson and
negative binomial.

Expected log-likelihoods against scipy's adaptive quadrature of scipy's own probability mass functions (an
independent parameterisation check), the closed forms against the base class's generic Gauss-Hermite quadrature
with 200 nodes, predictive distributions against Monte Carlo, short fits that recover the rate, the dispersion and
the zero-inflation probability, and the errors for bad counts and bad initial values."""

import math

import numpy as np
import pytest
import torch
from likelihood_cases import CASES
from pyro.contrib.gp.kernels import RBF
from scipy import integrate, stats

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods import Likelihood

ALPHA, GATE = 0.5, 0.3


def _nb_logpmf(y, f):
    r = 1 / ALPHA
    return stats.nbinom.logpmf(y, r, r / (r + np.exp(f)))


SCIPY = {  # log p(y | f) from scipy, parameterised as the docstrings say
    "Poisson": lambda y, f: stats.poisson.logpmf(y, np.exp(f)),
    "NegativeBinomial": _nb_logpmf,
    "ZeroInflatedPoisson": lambda y, f: np.logaddexp(np.log(GATE) if y == 0 else -np.inf,
                                                     np.log1p(-GATE) + stats.poisson.logpmf(y, np.exp(f))),
    "ZeroInflatedNegativeBinomial": lambda y, f: np.logaddexp(np.log(GATE) if y == 0 else -np.inf,
                                                              np.log1p(-GATE) + _nb_logpmf(y, f)),
}
MEAN = {  # E[y | f]
    "Poisson": np.exp, "NegativeBinomial": np.exp,
    "ZeroInflatedPoisson": lambda f: (1 - GATE) * np.exp(f),
    "ZeroInflatedNegativeBinomial": lambda f: (1 - GATE) * np.exp(f),
}


def _tol(float64_tol):
    return float64_tol if torch.get_default_dtype() == torch.float64 else 2e-4


@pytest.mark.parametrize("name", list(SCIPY))
def test_expected_log_prob_matches_scipy_quadrature(name):
    lik = CASES[name][0]()
    for sd in (0.3, 1.0, 2.0):
        for m in (-1.0, 0.5, 2.0):
            ys = [0.0, 1.0, 4.0, 12.0]
            ref = [integrate.quad(lambda f, y=y, m=m, sd=sd: stats.norm.pdf(f, m, sd) * SCIPY[name](y, f), m - 8 * sd,
                                  m + 8 * sd, epsabs=1e-12, epsrel=1e-11, limit=200)[0] for y in ys]
            got = lik.expected_log_prob(torch.tensor(ys), torch.full((4,), m), torch.full((4,), sd * sd))
            # as the module docstring states: below 1e-5 nats at sd <= 1, 1e-4 at sd 2
            torch.testing.assert_close(got, torch.tensor(ref), rtol=0, atol=_tol(1e-5 if sd <= 1 else 1e-4))


@pytest.mark.parametrize("name", ["Poisson", "ZeroInflatedPoisson"])
def test_closed_forms_equal_the_generic_quadrature(name):
    lik = CASES[name][0]()
    lik.num_gh = 200
    y = torch.tensor([0.0, 0.0, 1.0, 3.0, 7.0, 0.0])
    m, v = torch.tensor([-1.0, 1.5, 0.2, 1.0, 2.0, 0.0]), torch.tensor([0.1, 2.0, 1.0, 0.5, 3.0, 4.0])
    assert type(lik).quadrature_expected_log_prob is Likelihood.quadrature_expected_log_prob
    with torch.no_grad():
        torch.testing.assert_close(lik.expected_log_prob(y, m, v), lik.quadrature_expected_log_prob(y, m, v),
                                   rtol=_tol(1e-10), atol=_tol(1e-10))


@pytest.mark.parametrize("name", list(SCIPY))
def test_predictive_matches_monte_carlo(name):
    lik = CASES[name][0]()
    m, v = torch.tensor([-0.5, 0.8, 1.5]), torch.tensor([0.3, 0.6, 0.2])
    S = 400_000
    f = (m + v.sqrt() * torch.randn(S, 3)).double().numpy()
    with torch.no_grad():
        pred = lik.predictive(m, v)
    assert pred.batch_shape == (3,)
    mean_draws = MEAN[name](f)
    mc, se = mean_draws.mean(0), mean_draws.std(0) / math.sqrt(S)
    assert (np.abs(pred.mean.double().numpy() - mc) < 4 * se + 1e-9).all(), (pred.mean, mc, se)
    for y in (0.0, 2.0, 5.0):
        p = np.exp(SCIPY[name](y, f))
        mc, se = p.mean(0), p.std(0) / math.sqrt(S)
        got = pred.log_prob(torch.full((3,), y)).exp().double().numpy()
        assert (np.abs(got - mc) < 4 * se + 1e-9).all(), (y, got, mc, se)


@pytest.mark.float64  # lgamma(y + 1e8) - lgamma(1e8) cancels in float32
def test_negative_binomial_parameterisation_and_poisson_limit():
    f = torch.tensor([-1.0, 0.5, 2.0])
    d = ps.NegativeBinomial(dispersion=ALPHA).distribution(f)
    torch.testing.assert_close(d.mean, f.exp())
    torch.testing.assert_close(d.variance, f.exp() + ALPHA * f.exp() ** 2)  # NB2: mu + alpha mu^2
    near_poisson = ps.NegativeBinomial(dispersion=1e-8)
    y, m, v = torch.tensor([0.0, 2.0, 9.0]), torch.tensor([0.1, 1.0, 2.0]), torch.tensor([0.2, 0.5, 1.0])
    torch.testing.assert_close(near_poisson.expected_log_prob(y, m, v), ps.Poisson().expected_log_prob(y, m, v),
                               rtol=0, atol=_tol(1e-4))


def _nb1_logpmf(y, f):  # NB1: mean mu, variance mu (1 + alpha): n = mu / alpha, p (of a failure) = 1 / (1 + alpha)
    return stats.nbinom.logpmf(y, np.exp(f) / ALPHA, 1 / (1 + ALPHA))


def test_negative_binomial_nb1_against_scipy():
    """``variance="NB1"``: mean mu, variance mu (1 + alpha) and the pmf of scipy's nbinom(mu / alpha, 1 / (1 + alpha));
    its expected log-likelihood against scipy's adaptive quadrature of that pmf, its predictive mean e^{m + v/2}."""
    lik = ps.NegativeBinomial(dispersion=ALPHA, variance="NB1")
    f = torch.tensor([-1.0, 0.5, 2.0])
    with torch.no_grad():
        d = lik.distribution(f)
        torch.testing.assert_close(d.mean, f.exp())
        torch.testing.assert_close(d.variance, f.exp() * (1 + ALPHA))
        for y in (0.0, 3.0, 11.0):
            want = torch.tensor([_nb1_logpmf(y, v) for v in f.tolist()], dtype=f.dtype)
            torch.testing.assert_close(d.log_prob(torch.full((3,), y)), want, rtol=0, atol=_tol(1e-10))
        ys = [0.0, 1.0, 4.0, 12.0]
        for m, sd in ((-1.0, 0.3), (0.5, 1.0), (2.0, 0.7)):
            ref = [integrate.quad(lambda x, y=y, m=m, sd=sd: stats.norm.pdf(x, m, sd) * _nb1_logpmf(y, x), m - 8 * sd,
                                  m + 8 * sd, epsabs=1e-12, epsrel=1e-11, limit=200)[0] for y in ys]
            got = lik.expected_log_prob(torch.tensor(ys), torch.full((4,), m), torch.full((4,), sd * sd))
            torch.testing.assert_close(got, torch.tensor(ref, dtype=got.dtype), rtol=0, atol=_tol(1e-5))
        pred = lik.predictive(torch.tensor([0.3]), torch.tensor([0.4]))
        torch.testing.assert_close(pred.mean, torch.tensor([0.5]).exp(), rtol=_tol(1e-6), atol=0)
    with pytest.raises(ValueError, match="variance must be 'NB2'"):
        ps.NegativeBinomial(variance="nb1")


# -- fits -----------------------------------------------------------------------------------------------------------
def _fit(lik, X, y, steps=100):
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.5)), X[::20].clone(), lik)
    ps.infer.fit(gp, X, y, num_steps=steps, lr=0.08, progress=False)
    return gp


def test_poisson_fit_recovers_the_rate():
    X = torch.linspace(-2, 2, 200).unsqueeze(-1)
    rate = torch.exp(1.0 + torch.sin(2 * X[:, 0]))
    gp = _fit(ps.Poisson(), X, torch.poisson(rate))
    mean, var, pred = gp.predict(X, full=True)
    torch.testing.assert_close(pred.mean, (mean + var / 2).exp(), rtol=1e-4, atol=0)  # E[exp f] by quadrature
    assert ((pred.mean - rate).abs() / rate).mean() < 0.15


def test_negative_binomial_and_zero_inflation_fits_recover_their_parameters():
    X = torch.linspace(-2, 2, 300).unsqueeze(-1)
    f = 1.0 + 0.5 * torch.sin(2 * X[:, 0])
    y = CASES["NegativeBinomial"][1](f)
    nb = _fit(ps.NegativeBinomial(dispersion=2.0), X, y).likelihood.dispersion.item()
    assert 0.25 < nb < 1.0, nb  # true 0.5, from 2.0 (0.43 to 0.71 over four draws of 300 points)
    y0 = CASES["ZeroInflatedPoisson"][1](f)
    gate = _fit(ps.ZeroInflatedPoisson(gate=0.05), X, y0).likelihood.gate.item()
    assert 0.15 < gate < 0.45, gate  # true 0.3, from 0.05 (0.25 to 0.34 over four draws)


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCIPY))
def test_bad_counts_and_initial_values_are_named(name):
    make = CASES[name][0]
    X = torch.randn(4, 1)
    for bad in (-1.0, 2.5):
        gp = ps.SVGP(RBF(1), X[:2].clone(), make())
        with pytest.raises(ValueError, match="counts must be non-negative integers"):
            ps.infer.fit(gp, X, torch.tensor([0.0, 1.0, 3.0, bad]), num_steps=1, progress=False)
    with pytest.raises(ValueError, match="NaN or inf"):
        make().check_y(torch.tensor([1.0, float("nan")]))
    if "NegativeBinomial" in name:
        for bad in (-0.5, 0.0, float("inf")):
            with pytest.raises(ValueError, match="dispersion must be one finite number greater than 0"):
                getattr(ps, name)(dispersion=bad)
    if "ZeroInflated" in name:
        for bad in (0.0, 1.0, -0.1):
            with pytest.raises(ValueError, match=r"gate must be one finite number in \(0, 1\)"):
                getattr(ps, name)(gate=bad)
