"""Properties of the heteroscedastic Gaussian likelihood (``pyro_sparsegp.likelihoods.heteroscedastic``; Saul,
Hensman, Vehtari, Lawrence 2016): with batch dimensions, the predictive's mean is ``m_g`` and its variance
``v_g + E[e^{2h}] = v_g + e^{2 m_h + 2 v_h}`` (log-normal moment), the closed-form expected log-likelihood equals
the log-normal-moment formula member by member (``-log(2 pi)/2 - m_h - ((y - m_g)^2 + v_g) e^{2 v_h - 2 m_h} / 2``
from ``E[e^{-2h}]``) and the Monte Carlo average, and latent values without the two latents at dim -2 are named."""

import math

import pytest
import torch

import pyro_sparsegp as ps


def _marginals(batch=(3,), B=4):
    torch.manual_seed(0)
    f_loc = torch.randn(batch + (2, B)) * 0.5
    f_var = torch.rand(batch + (2, B)) * 0.3 + 0.05
    return f_loc, f_var


def test_predictive_moments_with_batch_dimensions():
    lik = ps.HeteroscedasticGaussian(num_gh=30)
    f_loc, f_var = _marginals()
    d = lik.predictive(f_loc, f_var)
    assert d.batch_shape == (3, 4)
    m_g, m_h, v_g, v_h = f_loc[..., 0, :], f_loc[..., 1, :], f_var[..., 0, :], f_var[..., 1, :]
    torch.testing.assert_close(d.mean, m_g)
    torch.testing.assert_close(d.variance, v_g + torch.exp(2 * m_h + 2 * v_h), rtol=1e-5, atol=1e-6)


def test_expected_log_prob_formula_and_monte_carlo():
    lik = ps.HeteroscedasticGaussian()
    f_loc, f_var = _marginals()
    y = torch.randn(3, 4)
    got = lik.expected_log_prob(y, f_loc, f_var)
    assert got.shape == (3, 1, 4)
    m_g, m_h, v_g, v_h = f_loc[..., 0, :], f_loc[..., 1, :], f_var[..., 0, :], f_var[..., 1, :]
    ref = -0.5 * math.log(2 * math.pi) - m_h - 0.5 * ((y - m_g) ** 2 + v_g) * torch.exp(2 * v_h - 2 * m_h)
    torch.testing.assert_close(got.squeeze(-2), ref)
    n = 200_000
    f = f_loc + f_var.sqrt() * torch.randn((n,) + f_loc.shape)
    lp = torch.distributions.Normal(f[..., 0, :], f[..., 1, :].exp()).log_prob(y)
    assert bool(((lp.mean(0) - ref).abs() < 5 * lp.std(0) / n ** 0.5).all())


def test_latent_values_must_have_two_latents_at_dim_minus_two():
    lik = ps.HeteroscedasticGaussian()
    bad = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="K=2"):
        lik.expected_log_prob(torch.zeros(4), bad, bad)
    with pytest.raises(ValueError, match="K=2"):
        lik.predictive(bad, bad)
    assert lik.latent_dim == 2 and lik.num_gh == 20
