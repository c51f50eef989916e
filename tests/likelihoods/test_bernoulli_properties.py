"""Properties of the Bernoulli likelihood's predictive (``pyro_sparsegp.likelihoods.bernoulli``; Hensman, Matthews,
Ghahramani 2015, section 4): the logit predictive ``E_q sigmoid(f)`` matches a fine trapezoid quadrature at moderate
means; at means far beyond the labels' noise both labels keep a finite log-probability (a confident miss scores
finitely in a test log-likelihood), and the logit predictive is symmetric, ``p(y=0 | mu) = p(y=1 | -mu)``, also where
its probabilities are clamped."""

import pytest
import torch

import pyro_sparsegp as ps


def test_the_logit_predictive_is_the_expected_sigmoid():
    lik = ps.Bernoulli(link="logit")
    loc, var = torch.tensor([-2.0, -0.3, 0.0, 0.8, 2.5]), torch.tensor([0.1, 1.0, 2.0, 0.5, 3.0])
    p = lik.predictive(loc, var).probs
    f = torch.linspace(-12, 12, 20001)
    dens = torch.exp(-0.5 * (f - loc[:, None]) ** 2 / var[:, None]) / (2 * torch.pi * var[:, None]).sqrt()
    ref = torch.trapezoid(torch.sigmoid(f) * dens, f, dim=-1)
    torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5)


def test_extreme_means_keep_both_labels_finite():
    for link in ("logit", "probit"):
        lik = ps.Bernoulli(link=link)
        d = lik.predictive(torch.tensor([60.0, -60.0, 300.0]), torch.tensor([0.5, 0.5, 0.01]))
        for y in (0.0, 1.0):
            assert bool(torch.isfinite(d.log_prob(torch.full((3,), y))).all())


@pytest.mark.float64  # float32 cannot hold 1 - 1e-12: its upper clamp is 1 and torch's own clamp takes over
def test_the_logit_predictive_is_symmetric_in_the_mean():
    lik = ps.Bernoulli(link="logit")
    loc, var = torch.tensor([0.4, 3.0, 25.0, 60.0, 200.0]), torch.tensor([0.3, 2.0, 0.5, 0.5, 1.0])
    up, down = lik.predictive(loc, var), lik.predictive(-loc, var)
    # 1 - (1 - 1e-12) is 1e-12 to 1e-4 relative in float64
    torch.testing.assert_close(up.log_prob(torch.zeros(5)), down.log_prob(torch.ones(5)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(up.log_prob(torch.ones(5)), down.log_prob(torch.zeros(5)), rtol=1e-4, atol=1e-4)
