"""Properties of a layer's predictions (``pyro_sparsegp.layers.prediction`` and the SVGP layer's conditional;
Hensman, Matthews, Ghahramani 2015, eq. 19): ``predict``'s marginals are the diagonal of ``qf_full``'s covariance,
chunking the inputs changes nothing, the per-point output covariance has the variances on its diagonal and leaves
``y*``'s predictive unchanged, joint posterior draws have ``qf_full``'s mean and covariance (Monte Carlo) and need
no warning at more points than inducing inputs, and the mean function is added to ``p(f | u)``'s mean."""

import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import Constant


def _gp(num_outputs=None, whiten=True, mean_function=None):
    torch.manual_seed(0)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), torch.linspace(-2, 2, 5).unsqueeze(-1), ps.Gaussian(0.1),
                 num_outputs=num_outputs, whiten=whiten, mean_function=mean_function)
    batch = () if num_outputs is None else (num_outputs,)
    with torch.no_grad():
        gp.q_u.set(torch.randn(batch + (5,)), (0.3 * torch.eye(5) + 0.05 * torch.randn(5, 5).tril()).expand(
            batch + (5, 5)).clone())
    return gp


@pytest.mark.parametrize("num_outputs", [None, 2], ids=["single", "two_outputs"])
def test_marginals_are_the_diagonal_of_the_full_covariance_and_chunking_changes_nothing(num_outputs):
    gp = _gp(num_outputs, whiten=False)
    X = torch.linspace(-3, 3, 7).unsqueeze(-1)
    mean, var = gp.predict(X)
    mean_c, var_c = gp.predict(X, batch_size=2)
    torch.testing.assert_close(mean_c, mean)
    torch.testing.assert_close(var_c, var)
    m_full, cov = gp.qf_full(X)
    diag = cov.detach().diagonal(dim1=-2, dim2=-1)
    if num_outputs is not None:  # predict gives [N, L]; qf_full [L, N(, N)]
        m_full, diag = m_full.mT, diag.mT
    torch.testing.assert_close(m_full.detach(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(diag, var, rtol=1e-5, atol=1e-6)


def test_output_covariance_has_the_variances_on_its_diagonal():
    gp = _gp(3)
    X = torch.randn(4, 1)
    mean, var = gp.predict(X)
    mean_c, cov = gp.predict(X, full_output_cov=True)
    assert cov.shape == (4, 3, 3)
    torch.testing.assert_close(mean_c, mean)
    torch.testing.assert_close(cov.diagonal(dim1=-2, dim2=-1), var)
    torch.testing.assert_close(cov, torch.diag_embed(var))  # independent outputs
    d1 = gp.predict(X, full=True)[-1]
    d2 = gp.predict(X, full=True, full_output_cov=True)[-1]
    torch.testing.assert_close(d2.mean, d1.mean)
    torch.testing.assert_close(d2.variance, d1.variance)


def test_posterior_draws_have_the_full_mean_and_covariance():
    gp = _gp()
    X = torch.linspace(-3, 3, 12).unsqueeze(-1)  # 12 points, 5 inducing inputs: a low-rank covariance
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = gp.sample_posterior(X, num_samples=40_000)
    assert gp.sample_posterior(X).shape == (1, 12)
    mean, cov = gp.qf_full(X)
    mean, cov = mean.detach(), cov.detach()
    n = f.shape[0]
    sd = cov.diagonal().sqrt()
    assert bool(((f.mean(0) - mean).abs() < 5 * sd / n ** 0.5 + 1e-6).all())
    emp = torch.cov(f.mT)
    se = (sd[:, None] * sd[None, :] + cov.abs()) / n ** 0.5
    assert bool(((emp - cov).abs() < 5 * se + 1e-6).all())


def test_the_mean_function_is_added_to_the_conditional_mean():
    c = 1.7
    gp0, gp1 = _gp(), _gp(mean_function=Constant(value=c))
    X, u = torch.randn(6, 1), torch.randn(5)
    with torch.no_grad():
        loc0, var0 = gp0.moments(X, u)
        loc1, var1 = gp1.moments(X, u)
    torch.testing.assert_close(loc1, loc0 + c)
    torch.testing.assert_close(var1, var0)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_a_new_layer_starts_at_its_prior(whiten):
    """``q(u) = p(u)`` at construction (``N(0, Kuu)`` un-whitened, ``N(0, I)`` whitened): the KL term is zero."""
    torch.manual_seed(0)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), torch.randn(5, 1), ps.Gaussian(), whiten=whiten)
    with torch.no_grad():
        kl = gp.strategy.kl()
    assert abs(float(kl)) < 1e-5


def test_the_predictive_of_several_outputs_is_laid_out_like_y():
    """``predict(full=True)`` for ``L`` outputs of an element-wise likelihood: ``y*`` ``[N, L]`` like the targets, with
    mean ``mean`` and variance ``var + noise`` per entry (the Gaussian predictive, Hensman 2015 section 4)."""
    gp = _gp(3)
    X = torch.randn(4, 1)
    mean, var, pred = gp.predict(X, full=True)
    assert mean.shape == (4, 3) and pred.batch_shape == (4, 3)
    torch.testing.assert_close(pred.mean, mean)
    noise = float(gp.likelihood.noise.detach())
    torch.testing.assert_close(pred.variance, var + noise)


def test_the_full_covariance_of_batched_inputs_is_each_slice_s():
    """``qf_full`` at ``X`` ``[S, 1, N, D]`` (the outputs' dimension a singleton, as ``predict`` lays it out) is
    ``qf_full`` of each slice: ``[S, L, N(, N)]``."""
    gp = _gp(2, whiten=False)
    X = torch.randn(3, 4, 1)
    mean, cov = gp.qf_full(X.unsqueeze(-3))
    assert mean.shape == (3, 2, 4) and cov.shape == (3, 2, 4, 4)
    for s in range(3):
        ms, cs = gp.qf_full(X[s])
        torch.testing.assert_close(mean[s].detach(), ms.detach())
        torch.testing.assert_close(cov[s].detach(), cs.detach())


def test_draws_at_many_close_points_need_no_warning():
    """Joint draws at 300 points within two lengthscales (``Kff - Qff`` numerically singular: with ``jitter=0`` the
    factorisation has to raise the jitter) warn about nothing, and their marginals match ``predict``'s within Monte
    Carlo error."""
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), torch.linspace(-2, 2, 5).unsqueeze(-1), ps.Gaussian(0.1),
                 jitter=0)
    X = torch.linspace(-1, 1, 300).unsqueeze(-1)
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = gp.sample_posterior(X, num_samples=4000)
    mean, var = gp.predict(X)
    n = f.shape[0]
    assert bool(((f.mean(0) - mean).abs() < 5 * var.sqrt() / n**0.5 + 1e-3).all())
    assert bool(((f.var(0) - var).abs() < 5 * var * (2 / n) ** 0.5 + 1e-3).all())


def test_batched_output_covariance_predicts_each_slice_s_y():
    """``predict(full=True, full_output_cov=True)`` at ``X`` ``[S, N, D]``: ``y*``'s predictive is each slice's."""
    gp = _gp(3)
    X = torch.randn(2, 4, 1)
    pred = gp.predict(X, full=True, full_output_cov=True)[-1]
    assert pred.batch_shape == (2, 4, 3)
    for s in range(2):
        ps_ = gp.predict(X[s], full=True)[-1]
        torch.testing.assert_close(pred.mean[s], ps_.mean)
        torch.testing.assert_close(pred.variance[s], ps_.variance)
