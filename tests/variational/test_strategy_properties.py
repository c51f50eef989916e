"""Properties of the SVGP strategy (``pyro_sparsegp.variational.strategy``; Hensman, Fusi, Lawrence 2013, eq. 2):
``p(f | u)`` against the dense conditional ``N(Kfu Kuu^{-1} u, Kff - Kfu Kuu^{-1} Kuf)`` (``u = Luu u'`` when
whitened); ``qf`` leaves its factorisation for ``kl(consume=True)`` (one Cholesky for the closed-form bound), ``clear``
drops it; the prior's batch shape under a batched ``Luu`` keeps the data plate's singleton; the inputs' layout."""

import types
from unittest import mock

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.variational.strategy import Strategy


def _gp(whiten, M=5):
    torch.manual_seed(0)
    k = RBF(2, lengthscale=torch.tensor(0.9), variance=torch.tensor(1.3))
    return ps.SVGP(k, torch.randn(M, 2), ps.Gaussian(0.1), whiten=whiten, jitter=1e-8), k


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_conditional_moments_against_the_dense_conditional(whiten):
    gp, k = _gp(whiten)
    Z, X, u = gp.inducing.Z.detach(), torch.randn(7, 2), torch.randn(5)
    with torch.no_grad():
        loc, var = gp.strategy.latent_moments(X, u, consume=False)
        Kuu, Kuf, kff = k(Z) + 1e-8 * torch.eye(5), k(Z, X), k(X, diag=True)
        u_plain = torch.linalg.cholesky(Kuu) @ u if whiten else u
        A = torch.linalg.solve(Kuu, Kuf)  # Kuu^{-1} Kuf
    torch.testing.assert_close(loc, A.mT @ u_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var, kff - (Kuf * A).sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_qf_leaves_its_factorisation_for_the_kl(whiten):
    gp, _ = _gp(whiten)
    X = torch.randn(9, 2)
    real = torch.linalg.cholesky_ex
    with torch.no_grad(), mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        gp.strategy.qf(X)
        assert len(gp.strategy.cache) > 0
        gp.strategy.kl(consume=True)
    assert [c.args[0].shape[-1] for c in chol.call_args_list] == [5]
    gp.strategy.clear()
    assert len(gp.strategy.cache) == 0


def test_prior_keeps_the_data_plates_singleton_under_a_batched_factor():
    gp, _ = _gp(whiten=False)
    Luu = torch.linalg.cholesky(torch.eye(5) * 2.0).expand(4, 5, 5)  # e.g. vectorised hyperparameter particles
    p = gp.strategy.prior(Luu)
    assert p.batch_shape == (4, 1) and p.event_shape == (5,)
    torch.testing.assert_close(p.covariance_matrix, 2.0 * torch.eye(5).expand(4, 1, 5, 5))
    assert gp.strategy.prior(Luu[0]).batch_shape == ()


def test_inputs_layout():
    s = Strategy(types.SimpleNamespace(num_latent_gps=3))
    assert s.align(torch.randn(6, 2)).shape == (1, 6, 2)
    assert s.align(torch.randn(4, 1, 6, 2)).shape == (4, 1, 6, 2)
    single = Strategy(types.SimpleNamespace(num_latent_gps=None))
    assert single.align(torch.randn(6, 2)).shape == (6, 2)
