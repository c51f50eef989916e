"""Properties of SOLVE-GP's orthogonal strategy (``pyro_sparsegp.variational.orthogonal``; Shi, Titsias, Mnih 2020,
eqs. 4-5 and appendix D) against dense linear algebra: ``p(f | u, v_perp)`` is ``N(Kfu Kuu^{-1} u + Cfv Cvv^{-1} v,
Kff - Kfu Kuu^{-1} Kuf - Cfv Cvv^{-1} Cvf)`` with ``Cvv = Kvv - Kvu Kuu^{-1} Kuv``, ``Cvf = Kvf - Kvu Kuu^{-1} Kuf``
(``u = Luu u'``, ``v = Lc v'`` when whitened); a cross-covariance probe ``C`` adds ``2 a_n^T C d_n`` to the marginal
variances (``a``, ``d`` the loadings of ``f_n`` on ``u`` and ``v_perp``); the un-whitened ODVGP's ``q(v_perp)`` has
the prior's covariance ``Cvv``."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps


def _layer(whiten, odvgp=False):
    torch.manual_seed(0)
    k = RBF(2, lengthscale=torch.tensor(0.8), variance=torch.tensor(1.2))
    Z, O = torch.randn(4, 2), torch.randn(3, 2) + 0.3
    gp = ps.SOLVEGP(k, Z, O, ps.Gaussian(0.1), whiten=whiten, odvgp=odvgp, jitter=1e-9)
    return gp, k, Z, O


def _dense(k, Z, O, X):
    Kuu, Kvv = k(Z) + 1e-9 * torch.eye(len(Z)), k(O)
    Kuv, Kuf, Kvf = k(Z, O), k(Z, X), k(O, X)
    Cvv = Kvv - Kuv.mT @ torch.linalg.solve(Kuu, Kuv) + 1e-9 * torch.eye(len(O))
    Cvf = Kvf - Kuv.mT @ torch.linalg.solve(Kuu, Kuf)
    return Kuu, Cvv, Kuf, Cvf, k(X, diag=True)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_conditional_against_dense(whiten):
    gp, k, Z, O = _layer(whiten)
    X, u, v = torch.randn(6, 2), torch.randn(4), torch.randn(3)
    with torch.no_grad():
        loc, var = gp.strategy.latent_moments(X, (u, v), consume=False)
        Kuu, Cvv, Kuf, Cvf, kff = _dense(k, Z, O, X)
        if whiten:
            u, v = torch.linalg.cholesky(Kuu) @ u, torch.linalg.cholesky(Cvv) @ v
        a, d = torch.linalg.solve(Kuu, Kuf), torch.linalg.solve(Cvv, Cvf)
    torch.testing.assert_close(loc, a.mT @ u + d.mT @ v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(var, kff - (Kuf * a).sum(0) - (Cvf * d).sum(0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_cross_probe_adds_twice_the_cross_covariance_term(whiten):
    gp, k, Z, O = _layer(whiten)
    X = torch.randn(6, 2)
    C = 0.05 * torch.randn(4, 3)
    with torch.no_grad():
        _, var0 = gp.strategy.latent_qf(X)
        gp.strategy.clear()
        gp.strategy.cross_probe = C
        _, var1 = gp.strategy.latent_qf(X)
        gp.strategy.cross_probe = None
        Kuu, Cvv, Kuf, Cvf, _ = _dense(k, Z, O, X)
        if whiten:  # loadings on the whitened variables u' = Luu^{-1} u, v' = Lc^{-1} v
            a = torch.linalg.solve_triangular(torch.linalg.cholesky(Kuu), Kuf, upper=False)
            d = torch.linalg.solve_triangular(torch.linalg.cholesky(Cvv), Cvf, upper=False)
        else:
            a, d = torch.linalg.solve(Kuu, Kuf), torch.linalg.solve(Cvv, Cvf)
    torch.testing.assert_close(var1 - var0, 2 * (a * (C @ d)).sum(0), rtol=1e-3, atol=1e-6)


def test_plain_odvgp_posterior_of_v_has_the_prior_covariance():
    gp, k, Z, O = _layer(whiten=False, odvgp=True)
    with torch.no_grad():
        q_u, q_v = gp.strategy.site_distributions(guide=True)
        _, Cvv, *_ = _dense(k, Z, O, torch.randn(2, 2))
    torch.testing.assert_close(q_v.covariance_matrix, Cvv, rtol=1e-4, atol=1e-6)
    assert len(gp.strategy.natgrad_families()) == 1


def test_the_closed_form_kl_reuses_the_factorisation_of_qf():
    """One Cholesky of ``Kuu`` and one of ``Cvv`` for ``qf`` and ``kl(consume=True)`` together (appendix D's
    algorithm factorises each once), whitened or not."""
    from unittest import mock

    for whiten in (False, True):
        gp, *_ = _layer(whiten)
        real = torch.linalg.cholesky_ex
        with torch.no_grad(), mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
            gp.strategy.qf(torch.randn(5, 2))
            gp.strategy.kl(consume=True)
        assert sorted(c.args[0].shape[-1] for c in chol.call_args_list) == [3, 4], whiten


@pytest.mark.parametrize("which", ["Z", "O"])
def test_only_the_plain_layer_warns_about_a_singular_prior_covariance(which, monkeypatch):
    """Near-duplicate inducing inputs make ``Kuu`` (``Z``) or ``Cvv`` (``O`` next to a point of ``Z``) numerically
    singular: the un-whitened bound inverts it and warns; the whitened one never inverts it and stays silent."""
    import warnings

    from pyro_sparsegp.context import reporting
    from pyro_sparsegp.linalg import IllConditionedWarning

    k = RBF(2, lengthscale=torch.tensor(1.0))
    Z = torch.tensor([[0.0, 0.0], [1.0, 0.5], [-1.0, 1.0]])
    O = torch.tensor([[2.0, 2.0], [-2.0, -1.5]])
    if which == "Z":
        Z = torch.cat([Z, Z[:1] + 1e-9])
    else:
        O = torch.cat([O, Z[1:2] + 1e-9])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the constructor's own checks of the inputs may warn too
        plain = ps.SOLVEGP(k, Z, O, ps.Gaussian(), whiten=False, jitter=1e-12)
        white = ps.SOLVEGP(k, Z, O, ps.Gaussian(), whiten=True, jitter=1e-12)
    monkeypatch.setattr(reporting, "_REPORTED", set())  # each warning is reported once per process
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        white.strategy.joint_factors()
    assert not [w for w in seen if issubclass(w.category, IllConditionedWarning)]
    monkeypatch.setattr(reporting, "_REPORTED", set())
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        plain.strategy.joint_factors()
    assert [w for w in seen if issubclass(w.category, IllConditionedWarning)]


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_full_covariance_agrees_with_the_marginals(whiten):
    """``qf_full`` (``full_terms``, eqs. 37-38 with the full covariance) and ``predict`` (the marginals of
    ``latent_qf``) are two computations of ``q(f*)``: the mean agrees and the diagonal is the variance; the covariance
    is symmetric positive semi-definite."""
    gp, *_ = _layer(whiten)
    with torch.no_grad():
        gp.q_u.set(torch.randn(4), torch.eye(4) * 0.5 + 0.1 * torch.randn(4, 4).tril(-1))
        gp.q_v.set(torch.randn(3), torch.eye(3) * 0.7)
    X = torch.randn(6, 2)
    mean_f, cov = gp.qf_full(X)
    mean, var = gp.predict(X)
    torch.testing.assert_close(mean_f.detach(), mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cov.detach().diagonal(), var, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cov, cov.mT)
    assert float(torch.linalg.eigvalsh(cov.detach()).min()) > -1e-4


@pytest.mark.parametrize("whiten, odvgp", [(False, False), (True, False), (True, True)],
                         ids=["plain-solvegp", "whitened-solvegp", "whitened-odvgp"])
def test_one_factorisation_of_each_prior_covariance_per_elbo(whiten, odvgp):
    """An ELBO evaluation (guide, then model) factorises ``Kuu`` once and ``Cvv`` once (appendix D's algorithm), for
    SOLVE-GP whitened or not and the whitened ODVGP. (The un-whitened ODVGP factorises twice: its guide's q(v) scale
    ``Lc`` is computed by ``joint_chol`` before ``factors``, which does not reuse it; a cost, not a wrong number.)"""
    from unittest import mock

    from pyro.infer import Trace_ELBO

    gp, *_ = _layer(whiten, odvgp)
    X, y = torch.randn(10, 2), torch.randn(10)
    real = torch.linalg.cholesky_ex
    with mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        Trace_ELBO().differentiable_loss(gp.model, gp.guide, X, y)
    assert sorted(c.args[0].shape[-1] for c in chol.call_args_list) == [3, 4]
