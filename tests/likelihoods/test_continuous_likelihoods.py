"""Continuous likelihoods: Student-t (robust), Gamma (positive, log link), Beta (unit interval, logit link).

Expected log-likelihoods against scipy's adaptive quadrature of scipy's own densities, within the errors the
docstrings state; the Gamma's closed form against the base class's generic quadrature; predictive distributions
against Monte Carlo; short fits that recover what they should; the errors for bad responses and initial values."""

import math

import numpy as np
import pytest
import torch
from likelihood_cases import CASES
from pyro.contrib.gp.kernels import RBF
from scipy import integrate, special, stats

import pyro_sparsegp as ps

SCALE, DF, SHAPE, PRECISION = 0.3, 4.0, 3.0, 20.0
SCIPY = {
    "StudentT": lambda y, f: stats.t.logpdf(y, DF, f, SCALE),
    "Gamma": lambda y, f: stats.gamma.logpdf(y, SHAPE, scale=np.exp(f) / SHAPE),
    "Beta": lambda y, f: stats.beta.logpdf(y, PRECISION * special.expit(f), PRECISION * special.expit(-f)),
}
MEAN = {"StudentT": lambda f: f, "Gamma": np.exp, "Beta": special.expit}
YS = {"StudentT": [-1.0, 0.2, 0.6, 3.0], "Gamma": [0.05, 0.7, 2.0, 9.0], "Beta": [0.01, 0.3, 0.8, 0.995]}
# (sd of q(f)) -> the bound each docstring states (Student-t: sd / scale = 1 and 2; Beta: precision 20)
BOUNDS = {"StudentT": {0.3: 1e-6, 0.6: 2e-5}, "Gamma": {0.5: 1e-9, 2.0: 1e-9},
          "Beta": {1.0: 1e-8 * PRECISION, 2.0: 8e-6 * PRECISION / 100 * 2}}


def _tol(float64_tol):
    return float64_tol if torch.get_default_dtype() == torch.float64 else 5e-4


@pytest.mark.parametrize("name", list(SCIPY))
def test_expected_log_prob_matches_scipy_quadrature(name):
    lik = CASES[name][0]()
    for sd, bound in BOUNDS[name].items():
        for m in (-1.0, 0.2, 1.5):
            ys = YS[name]
            ref = [integrate.quad(lambda f, y=y, m=m, sd=sd: stats.norm.pdf(f, m, sd) * SCIPY[name](y, f), m - 9 * sd,
                                  m + 9 * sd, points=[y] if name == "StudentT" else None, epsabs=1e-13,
                                  epsrel=1e-12, limit=400)[0] for y in ys]
            got = lik.expected_log_prob(torch.tensor(ys), torch.full((4,), m), torch.full((4,), sd * sd))
            torch.testing.assert_close(got, torch.tensor(ref), rtol=0, atol=_tol(bound))


def test_gamma_closed_form_equals_the_generic_quadrature():
    lik = ps.Gamma(shape=2.5, num_gh=200)
    y = torch.tensor([0.05, 0.5, 1.0, 3.0, 10.0])
    m, v = torch.tensor([-1.0, 0.0, 0.3, 1.0, 2.0]), torch.tensor([0.1, 2.0, 1.0, 0.5, 4.0])
    with torch.no_grad():
        torch.testing.assert_close(lik.expected_log_prob(y, m, v), lik.quadrature_expected_log_prob(y, m, v),
                                   rtol=_tol(1e-10), atol=_tol(1e-10))


def test_student_t_nodes_grow_with_the_width_of_q_relative_to_the_scale():
    lik = ps.StudentT(scale=0.5)
    assert lik.num_nodes(torch.tensor([0.1, 0.25])) == 20  # sd / scale <= 1
    assert lik.num_nodes(torch.tensor([1.0])) == 40  # ratio 2
    assert lik.num_nodes(torch.tensor([100.0])) == 100  # the cap
    assert ps.Beta().num_nodes(torch.tensor([4.0])) == 40 and ps.Beta().num_nodes(torch.tensor([0.9])) == 20


@pytest.mark.parametrize("name", list(SCIPY))
def test_predictive_matches_monte_carlo(name):
    lik = CASES[name][0]()
    m, v = torch.tensor([-0.7, 0.4, 1.2]), torch.tensor([0.05, 0.3, 0.15])
    S = 400_000
    f = (m + v.sqrt() * torch.randn(S, 3)).double().numpy()
    with torch.no_grad():
        pred = lik.predictive(m, v)
    assert pred.batch_shape == (3,)
    draws = MEAN[name](f)
    mc, se = draws.mean(0), draws.std(0) / math.sqrt(S)
    assert (np.abs(pred.mean.double().numpy() - mc) < 4 * se + 1e-9).all(), (pred.mean, mc, se)
    for y in YS[name][1:3]:
        p = np.exp(SCIPY[name](y, f))
        mc, se = p.mean(0), p.std(0) / math.sqrt(S)
        got = pred.log_prob(torch.full((3,), y)).exp().double().numpy()
        assert (np.abs(got - mc) < 4 * se + 1e-9).all(), (y, got, mc, se)


# -- fits -------------------------------------------------------------------------------------------------------------
def _fit(lik, X, y, steps=120):
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.5)), X[::20].clone(), lik)
    ps.infer.fit(gp, X, y, num_steps=steps, lr=0.08, progress=False)
    return gp


def test_student_t_fit_is_robust_to_outliers():
    X = torch.linspace(-2, 2, 200).unsqueeze(-1)
    g = torch.sin(2 * X[:, 0])
    y = g + 0.1 * torch.randn(200)
    y[::10] += 6.0  # 10% gross outliers, all upwards
    mean = _fit(ps.StudentT(scale=0.5, df=3.0), X, y).predict(X)[0]
    assert (mean - g).abs().mean() < 0.1  # a Gaussian likelihood's mean shifts by ~0.6 (checked below)
    gauss = _fit(ps.Gaussian(0.5), X, y).predict(X)[0]
    assert (gauss - g).mean() > 0.3


def test_gamma_and_beta_fits_recover_their_parameters():
    X = torch.linspace(-2, 2, 300).unsqueeze(-1)
    f = 0.5 * torch.sin(2 * X[:, 0])
    shape = _fit(ps.Gamma(shape=1.0), X, CASES["Gamma"][1](f)).likelihood.shape.item()
    assert 2.2 < shape < 4.0, shape  # true 3, from 1
    precision = _fit(ps.Beta(precision=5.0), X, CASES["Beta"][1](f)).likelihood.precision.item()
    assert 14 < precision < 28, precision  # true 20, from 5


# -- bad input ------------------------------------------------------------------------------------------------------
def test_bad_responses_and_initial_values_are_named():
    X = torch.randn(4, 1)
    for lik, bad, match in ((ps.Gamma(), 0.0, "Gamma needs positive responses"),
                            (ps.Gamma(), -1.0, "Gamma needs positive responses"),
                            (ps.Beta(), 0.0, r"y must lie strictly inside \(0, 1\)"),
                            (ps.Beta(), 1.0, r"y must lie strictly inside \(0, 1\)"),
                            (ps.Beta(), 1.5, r"y must lie strictly inside \(0, 1\)")):
        gp = ps.SVGP(RBF(1), X[:2].clone(), lik)
        with pytest.raises(ValueError, match=match):
            ps.infer.fit(gp, X, torch.tensor([0.5, 0.25, 0.75, bad]), num_steps=1, progress=False)
    for lik in (ps.StudentT(), ps.Gamma(), ps.Beta()):
        with pytest.raises(ValueError, match="NaN or inf"):
            lik.check_y(torch.tensor([0.5, float("inf")]))
    for make, arg in ((ps.StudentT, "scale"), (ps.StudentT, "df"), (ps.Gamma, "shape"), (ps.Beta, "precision")):
        for bad in (0.0, -1.0, float("nan"), [1.0, 2.0]):
            with pytest.raises(ValueError, match=f"{arg} must be one finite number greater than 0"):
                make(**{arg: bad})
