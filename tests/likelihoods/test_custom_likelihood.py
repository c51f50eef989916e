"""A user's own likelihood (docs/extending.md): only ``distribution`` and ``support`` defined, the defaults give the
expected log-likelihood and the predictive distribution by Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani
2015, section 4), checked against a dense grid integral; a likelihood without ``distribution`` is refused when the
model is built, and one with event dimensions gets a message."""

import math

import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from torch.distributions import constraints

import pyro_sparsegp as ps


class Poisson(ps.Likelihood):
    support = constraints.nonnegative_integer

    def distribution(self, f):
        return dist.Poisson(f.exp())


def _grid_integral(fn, m, v, n=20001):
    """int fn(f) N(f; m, v) df on a dense grid (trapezoid, +-12 sd)."""
    sd = math.sqrt(v)
    f = torch.linspace(m - 12 * sd, m + 12 * sd, n, dtype=torch.float64)
    dens = torch.exp(-0.5 * ((f - m) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
    return torch.trapezoid(fn(f) * dens, f).item()


def test_default_predictive_and_expected_log_prob_match_a_dense_integral():
    lik = Poisson()
    m = torch.tensor([0.3, -1.0, 1.2], dtype=torch.float64)
    v = torch.tensor([0.2, 0.5, 0.05], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64)
    pred = lik.predictive(m, v)
    assert pred.batch_shape == (3,)
    for i in range(3):
        yi, mi, vi = y[i], m[i].item(), v[i].item()
        p_y = _grid_integral(lambda f, yi=yi: dist.Poisson(f.exp()).log_prob(yi).exp(), mi, vi)
        assert pred.log_prob(y)[i].item() == pytest.approx(math.log(p_y), rel=1e-8)
        mean = _grid_integral(torch.exp, mi, vi)  # E[y] = E[exp f]
        assert pred.mean[i].item() == pytest.approx(mean, rel=1e-8)
        ell = _grid_integral(lambda f, yi=yi: dist.Poisson(f.exp()).log_prob(yi), mi, vi)
        assert lik.expected_log_prob(y, m, v)[i].item() == pytest.approx(ell, rel=1e-8)


def test_a_layer_with_a_custom_likelihood_predicts_its_distribution():
    X = torch.linspace(-2, 2, 30).unsqueeze(-1)
    y = torch.poisson(torch.exp(torch.sin(2 * X[:, 0])))
    gp = ps.SVGP(RBF(1), X[::5].clone(), Poisson())
    ps.infer.fit(gp, X, y, num_steps=20, batch_size=30, progress=False)
    mean, var, pred = gp.predict(X[:4], full=True)
    assert pred.batch_shape == (4,) and torch.isfinite(pred.log_prob(y[:4])).all()
    assert torch.allclose(pred.log_prob(y[:4]), gp.likelihood.predictive_log_prob(y[:4], mean, var))


def test_a_likelihood_without_distribution_or_with_event_dimensions_is_named():
    class NoDistribution(ps.Likelihood):
        support = constraints.real

    with pytest.raises(TypeError, match="NoDistribution must define distribution"):
        ps.SVGP(RBF(1), torch.randn(3, 1), NoDistribution())

    class EventDims(ps.Likelihood):
        support = constraints.real

        def distribution(self, f):
            return dist.Normal(f, 1.0).to_event(1)

    with pytest.raises(ValueError, match="no event dimensions"):
        EventDims().expected_log_prob(torch.zeros(5), torch.zeros(5), torch.ones(5))


def test_the_default_predictive_is_laid_out_like_y_with_several_outputs():
    X = torch.linspace(-2, 2, 40).unsqueeze(-1)
    Y = torch.poisson(torch.exp(torch.stack([torch.sin(2 * X[:, 0]), torch.cos(X[:, 0])], -1)))
    gp = ps.SVGP(RBF(1), X[::8].clone(), Poisson(), num_outputs=2)
    ps.infer.fit(gp, X, Y, num_steps=10, batch_size=40, progress=False)
    mean, var, pred = gp.predict(X[:5], full=True)
    assert mean.shape == pred.batch_shape == (5, 2) and pred.log_prob(Y[:5]).shape == (5, 2)
    assert torch.allclose(pred.log_prob(Y[:5]), gp.likelihood.predictive_log_prob(Y[:5], mean, var))
