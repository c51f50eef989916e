"""SOLVE-GP closed-form bounds (Shi, Titsias, Mnih 2020) against dense computations and each other."""
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import solvegp as S
from pyro_sparsegp.bounds import svgp as B

N, M, M2, D = 40, 5, 6, 2
NOISE = 0.1


def _mats(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(N, D, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    Z = torch.rand(M, D, generator=g, dtype=torch.float64) * 4 - 2
    O = torch.rand(M2, D, generator=g, dtype=torch.float64) * 4 - 2
    k = RBF(D, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.7))
    with torch.no_grad():
        mats = dict(Kuu=k(Z) + 1e-10 * torch.eye(M), Kuv=k(Z, O), Kvv=k(O) + 1e-10 * torch.eye(M2), Kuf=k(Z, X),
                    Kvf=k(O, X), kff_diag=k(X, diag=True))
        Kff = k(X)
    _mats.Z, _mats.O = Z, O  # for the module test
    return X, y, mats, Kff


def _q(seed=1):
    g = torch.Generator().manual_seed(seed)
    m_u = torch.randn(M, generator=g, dtype=torch.float64)
    L_u = torch.tril(0.2 * torch.randn(M, M, generator=g, dtype=torch.float64), -1) + torch.diag(
        0.3 + 0.3 * torch.rand(M, generator=g, dtype=torch.float64))
    m_v = 0.5 * torch.randn(M2, generator=g, dtype=torch.float64)
    L_v = torch.tril(0.1 * torch.randn(M2, M2, generator=g, dtype=torch.float64), -1) + torch.diag(
        0.1 + 0.2 * torch.rand(M2, generator=g, dtype=torch.float64))
    return m_u, L_u, m_v, L_v


def _cvv(m):
    return m["Kvv"] - m["Kuv"].mT @ torch.linalg.solve(m["Kuu"], m["Kuv"])


def _gauss_ell(y, mu, var):
    return ps.Gaussian(NOISE).expected_log_prob(y, mu, var)


pytestmark = pytest.mark.float64


def test_eq8_equals_the_structured_svgp_over_z_and_o():
    X, y, m, _ = _mats()
    m_u, L_u, m_v, L_v = _q()
    P = torch.linalg.solve(m["Kuu"], m["Kuv"]).mT
    S_u, S_v = L_u @ L_u.mT, L_v @ L_v.mT
    mm = torch.cat([m_u, m_v + P @ m_u])
    SS = torch.cat([torch.cat([S_u, S_u @ P.mT], 1), torch.cat([P @ S_u, S_v + P @ S_u @ P.mT], 1)], 0)
    K = torch.cat([torch.cat([m["Kuu"], m["Kuv"]], 1), torch.cat([m["Kuv"].mT, m["Kvv"]], 1)], 0)
    Kf = torch.cat([m["Kuf"], m["Kvf"]])
    dense = B.kl_sparse_bound(y, _gauss_ell, K, Kf, m["kff_diag"], mm, torch.linalg.cholesky(SS))
    ours = S.solvegp_bound(y, _gauss_ell, **m, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v)
    assert abs(ours - dense) < 1e-8 * abs(dense)
    mu, var = S.solvegp_marginals(**m, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v)
    mu_d, var_d = B.qf_dense(K, Kf, m["kff_diag"], mm, torch.linalg.cholesky(SS))
    torch.testing.assert_close(mu, mu_d, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(var, var_d, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("lik", ["gaussian", "probit"])
def test_eq8_with_prior_q_v_is_the_svgp_bound(lik):
    X, y, m, _ = _mats()
    m_u, L_u, _, _ = _q()
    if lik == "gaussian":
        ell = _gauss_ell
    else:
        y = (y > 0).to(y.dtype)
        ell = ps.Bernoulli("probit", num_gh=40).quadrature_expected_log_prob
    solve = S.solvegp_bound(y, ell, **m, m_u=m_u, L_u=L_u, m_v=torch.zeros(M2), L_v=torch.linalg.cholesky(_cvv(m)))
    svgp = B.kl_sparse_bound(y, ell, m["Kuu"], m["Kuf"], m["kff_diag"], m_u, L_u)
    assert abs(solve - svgp) < 1e-8 * abs(svgp)


def test_eq9_reduces_to_titsias_and_is_eq8_at_the_optimal_q_u():
    X, y, m, _ = _mats()
    m_u, L_u, m_v, L_v = _q()
    Lc = torch.linalg.cholesky(_cvv(m))
    eq9_prior = S.solvegp_collapsed_bound(y, NOISE, **m, m_v=torch.zeros(M2), L_v=Lc)
    tits = B.titsias_bound(y, torch.tensor(NOISE), m["Kuu"], m["Kuf"], m["kff_diag"])
    assert abs(eq9_prior - tits) < 1e-8 * abs(tits)
    # q*(u) for a given q(v⊥): the Gaussian optimum for the targets y - E[f⊥]
    Cfv = m["Kvf"].mT - m["Kuf"].mT @ torch.linalg.solve(m["Kuu"], m["Kuv"])
    shift = Cfv @ torch.linalg.solve(_cvv(m), m_v)
    m_opt, L_opt = B.optimal_qu(y - shift, torch.tensor(NOISE), m["Kuu"], m["Kuf"])
    eq9 = S.solvegp_collapsed_bound(y, NOISE, **m, m_v=m_v, L_v=L_v)
    eq8_opt = S.solvegp_bound(y, _gauss_ell, **m, m_u=m_opt, L_u=L_opt, m_v=m_v, L_v=L_v)
    assert abs(eq9 - eq8_opt) < 1e-8 * abs(eq9)
    assert S.solvegp_bound(y, _gauss_ell, **m, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v) < eq9


def test_eq10_is_eq9_at_the_odvgp_restriction():
    X, y, m, _ = _mats()
    _, _, m_v, _ = _q()
    eq10 = S.odvgp_bound(y, NOISE, **m, m_v=m_v)
    eq9 = S.solvegp_collapsed_bound(y, NOISE, **m, m_v=m_v, L_v=torch.linalg.cholesky(_cvv(m)))
    assert abs(eq10 - eq9) < 1e-8 * abs(eq9)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_eq14_is_between_titsias_and_the_exact_marginal_likelihood(seed):
    X, y, m, Kff = _mats(seed)
    tight = S.tight_collapsed_bound(y, NOISE, m["Kuu"], m["Kuf"], Kff)
    tits = B.titsias_bound(y, torch.tensor(NOISE), m["Kuu"], m["Kuf"], m["kff_diag"])
    exact = B.exact_log_marginal(y, NOISE, Kff)
    assert tits <= tight <= exact
    # the trace by the inversion lemma equals the dense trace
    Q = m["Kuf"].mT @ torch.linalg.solve(m["Kuu"], m["Kuf"])
    A = Q + NOISE * torch.eye(N)
    dense = torch.distributions.MultivariateNormal(torch.zeros(N), A).log_prob(y) - 0.5 * torch.trace(
        torch.linalg.solve(A, Kff - Q))
    assert abs(tight - dense) < 1e-8 * abs(dense)


def test_no_cholesky_of_the_joint_matrix():
    from unittest import mock

    X, y, m, _ = _mats()
    m_u, L_u, m_v, L_v = _q()
    real = torch.linalg.cholesky_ex
    with mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        S.solvegp_bound(y, _gauss_ell, **m, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v)
    sizes = {c.args[0].shape[-1] for c in chol.call_args_list}
    assert sizes == {M, M2}


def test_module_bound_equals_the_functional_eq8():
    X, y, m, _ = _mats()
    m_u, L_u, m_v, L_v = _q()
    k = RBF(D, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.7))
    gp = ps.SOLVEGP(k, _mats.Z, _mats.O, ps.Gaussian(NOISE), whiten=False)
    with torch.no_grad():
        gp.q_u.set(m_u, L_u)
        gp.q_v.set(m_v, L_v)
        ours = gp.analytic_elbo(X, y)
    ref = S.solvegp_bound(y, _gauss_ell, **m, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v)
    assert abs(ours - ref) < 1e-7 * abs(ref)


def test_cubic_operation_counts_follow_table_4():
    svgp, solve = S.count_cubic_operations("svgp"), S.count_cubic_operations("solvegp")
    assert sum(n for _, n in svgp["trisolve"]) == 3 and sum(n for _, n in solve["cholesky"]) == 2
    with pytest.raises(ValueError):
        S.count_cubic_operations("fitc")
