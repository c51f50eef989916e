"""The heteroscedastic Gaussian likelihood (two latents: the mean and the log noise standard deviation).

Its closed-form expected log-likelihood against the generic two-dimensional product rule over its own
``distribution`` and against Monte Carlo; its predictive mixture against Monte Carlo; the ``[..., 1, B]`` shape
convention; a fit that recovers the noise function; and it is not a conjugate :class:`~pyro_sparsegp.Gaussian`."""

import math

import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods import live_gaussian_likelihoods


def _marginals(n=6):
    m = torch.stack([torch.randn(n), -0.5 + 0.5 * torch.randn(n)])  # [2, n]: mean, log noise sd
    v = 0.05 + 0.6 * torch.rand(2, n)
    return m, v


def test_closed_form_equals_the_generic_product_rule_and_monte_carlo():
    lik = ps.HeteroscedasticGaussian(num_gh=40)
    m, v = _marginals()
    y = torch.randn(6)
    closed = lik.expected_log_prob(y, m, v)
    assert closed.shape == (1, 6)
    # the generic rule integrates distribution(f) over both latents (40 x 40 Gauss-Hermite nodes)
    torch.testing.assert_close(closed, lik.quadrature_expected_log_prob(y, m, v),
                               rtol=0, atol=1e-10 if torch.get_default_dtype() == torch.float64 else 1e-4)
    S = 400_000
    g = m[0] + v[0].sqrt() * torch.randn(S, 6)
    h = m[1] + v[1].sqrt() * torch.randn(S, 6)
    vals = dist.Normal(g, h.exp()).log_prob(y)  # written from torch's Normal, not the likelihood
    mc, se = vals.mean(0), vals.std(0) / math.sqrt(S)
    assert ((closed[0] - mc).abs() < 4 * se).all(), (closed, mc, se)


def test_predictive_matches_monte_carlo():
    lik = ps.HeteroscedasticGaussian()
    m, v = _marginals(4)
    pred = lik.predictive(m, v)
    assert pred.batch_shape == (4,)
    torch.testing.assert_close(pred.mean, m[0])  # the mean latent integrates exactly
    S = 400_000
    g = m[0] + v[0].sqrt() * torch.randn(S, 4)
    h = m[1] + v[1].sqrt() * torch.randn(S, 4)
    y_draws = g + h.exp() * torch.randn(S, 4)
    torch.testing.assert_close(pred.variance, y_draws.var(0), rtol=0.02, atol=0)
    for y in (m[0] - 0.3, m[0] + 1.0):
        dens = dist.Normal(g, h.exp()).log_prob(y).exp()
        mc, se = dens.mean(0), dens.std(0) / math.sqrt(S)
        assert ((pred.log_prob(y).exp() - mc).abs() < 4 * se).all()


@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3)], ids=str)
def test_shapes_follow_the_singleton_convention(batch_shape):
    lik = ps.HeteroscedasticGaussian()
    n = 5
    f, var = torch.randn(batch_shape + (2, n)), 0.1 + torch.rand(batch_shape + (2, n))
    site = batch_shape + (1, n)
    assert lik.latent_dim == 2 and lik.y_shape(f.shape) == site
    d = lik.distribution(f)
    assert d.batch_shape == site
    torch.testing.assert_close(d.scale, f[..., 1:2, :].exp())
    y = torch.randn(batch_shape + (n,))
    e = lik.expected_log_prob(y, f, var)
    assert e.shape == site
    torch.testing.assert_close(e, lik.expected_log_prob(y.unsqueeze(-2), f, var))
    assert lik.predictive(f, var).batch_shape == batch_shape + (n,)
    with pytest.raises(ValueError, match="K=2"):
        lik.expected_log_prob(y, torch.randn(3, n), torch.ones(3, n))


def test_is_not_a_conjugate_gaussian():
    lik = ps.HeteroscedasticGaussian()
    assert not isinstance(lik, ps.Gaussian) and lik not in live_gaussian_likelihoods()
    assert list(lik.parameters()) == []


def test_fit_recovers_the_noise_function():
    """y = sin(2x) + exp(-1.5 + 0.6 x) eps on 400 points: the fitted mean and noise sd exp(m_h) follow the truth."""
    N = 400
    X = torch.linspace(-2, 2, N).unsqueeze(-1)
    g, log_sd = torch.sin(2 * X[:, 0]), -1.5 + 0.6 * X[:, 0]
    y = g + log_sd.exp() * torch.randn(N)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), X[::25].clone(), ps.HeteroscedasticGaussian())
    assert gp.num_outputs == 2  # inferred from latent_dim
    ps.infer.fit(gp, X, y, num_steps=200, lr=0.05, progress=False)
    mean, var, pred = gp.predict(X, full=True)
    assert mean.shape == (N, 2) and pred.batch_shape == (N,)
    assert (mean[:, 0] - g).abs().mean() < 0.1
    sd_hat = mean[:, 1].exp()
    assert ((sd_hat - log_sd.exp()).abs() / log_sd.exp()).mean() < 0.25  # the noise sd grows 11-fold over [-2, 2]
    # the predictive log-likelihood beats a homoscedastic fit's
    homo = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), X[::25].clone(), ps.Gaussian(0.1))
    ps.infer.fit(homo, X, y, num_steps=200, lr=0.05, progress=False)
    assert pred.log_prob(y).mean() > homo.predict(X, full=True)[2].log_prob(y).mean() + 0.1
    # Trace_ELBO runs on the sampled two-latent site
    loss = Trace_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=2).loss(gp.model, gp.guide, X, y)
    assert math.isfinite(loss)


def test_two_columns_of_y_are_refused_with_what_y_is():
    """``y [N, 2]`` for a heteroscedastic layer is a mistake about the latents (they are not outputs): the error says
    so, where a multi-class layer's says labels, not one-hot rows."""
    X = torch.linspace(-1, 1, 30).unsqueeze(-1)
    het = ps.SVGP(RBF(1), X[::5].clone(), ps.HeteroscedasticGaussian())
    with pytest.raises(ValueError, match=r"HeteroscedasticGaussian's 2 latent functions are not outputs"):
        het.check_inputs(X, torch.randn(30, 2))
    assert het.check_inputs(X, torch.randn(30, 1))[1].shape == (30,)
    mc = ps.SVGP(RBF(1), X[::5].clone(), ps.RobustMax(3), num_outputs=3)
    with pytest.raises(ValueError, match="not one-hot rows"):
        mc.check_inputs(X, torch.zeros(30, 3))
