"""SOLVE-GP bounds (Shi, Titsias, Mnih 2020), :mod:`pyro_sparsegp.bounds.solvegp`, against independent dense
computations written here: SVGP over the union {Z, O} with the section-3.3 q(u, v) built from the linear map
(u, v⊥) -> (u, v), dense KLs and log-determinants of the (M + M2)-square joint matrices, Titsias' bound and the
exact log marginal likelihood by dense solves.

The package functions are called with ``jitter=0.0`` in the identities (the float64 test matrices are positive
definite), so that both sides factorise exactly the same matrices; the default jitter is exercised by the guard,
batch and float32 tests."""

from collections import Counter
from unittest import mock

import pytest
import torch

from pyro_sparsegp.bounds.solvegp import (
    count_cubic_operations,
    cubic_cost,
    kl_terms,
    odvgp_bound,
    solvegp_collapsed_bound,
    solvegp_elbo,
    solvegp_marginals,
    solvegp_optimal_q_v,
    solvegp_tight_bound,
    structured_svgp_params,
    unwhiten_params,
    whiten_params,
)
from pyro_sparsegp.linalg import gauss_hermite

pytestmark = pytest.mark.float64

N, M, M2, DIM = 40, 5, 7, 2
NOISE = 0.1
J = dict(jitter=0.0)


# -- problems -------------------------------------------------------------------------------------------------------
def rbf(A, B, var=1.3, ls=0.7):
    return var * torch.exp(-0.5 * (A.unsqueeze(-2) - B.unsqueeze(-3)).pow(2).sum(-1) / ls**2)


def problem(seed, batch=(), dtype=torch.float64):
    """Kernel matrices (as keyword arguments), targets and the full Kff of a random 2-d regression problem."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.rand(batch + (N, DIM), generator=g, dtype=dtype) * 4 - 2
    Z = torch.rand(batch + (M, DIM), generator=g, dtype=dtype) * 4 - 2
    O = torch.rand(batch + (M2, DIM), generator=g, dtype=dtype) * 4 - 2
    f = torch.sin(2 * X[..., 0]) + 0.5 * X[..., 1]
    y = f + 0.3 * torch.randn(batch + (N,), generator=g, dtype=dtype)
    K = dict(
        Kuu=rbf(Z, Z),
        Kuv=rbf(Z, O),
        Kvv=rbf(O, O),
        Kuf=rbf(Z, X),
        Kvf=rbf(O, X),
        kff_diag=torch.full(batch + (N,), 1.3, dtype=dtype),
    )
    return K, y, rbf(X, X)


def q_params(seed, batch=(), dtype=torch.float64):
    """Random (m_u, L_u, m_v, L_v), lower-triangular scales with positive diagonals."""
    g = torch.Generator(torch.get_default_device()).manual_seed(1000 + seed)

    def tril(k, off, diag):
        L = torch.tril(off * torch.randn(batch + (k, k), generator=g, dtype=dtype), -1)
        return L + torch.diag_embed(diag[0] + diag[1] * torch.rand(batch + (k,), generator=g, dtype=dtype))

    m_u = torch.randn(batch + (M,), generator=g, dtype=dtype)
    m_v = 0.5 * torch.randn(batch + (M2,), generator=g, dtype=dtype)
    return m_u, tril(M, 0.2, (0.3, 0.3)), m_v, tril(M2, 0.1, (0.1, 0.2))


# -- dense oracles --------------------------------------------------------------------------------------------------
def cvv(K):
    return K["Kvv"] - K["Kuv"].mT @ torch.linalg.solve(K["Kuu"], K["Kuv"])


def cfv(K):
    return K["Kvf"].mT - K["Kuf"].mT @ torch.linalg.solve(K["Kuu"], K["Kuv"])


def joint(K):
    """Prior covariance of (u, v) over {Z, O} [M + M2, M + M2] and its cross-covariance with f [M + M2, N]."""
    Kj = torch.cat([torch.cat([K["Kuu"], K["Kuv"]], -1), torch.cat([K["Kuv"].mT, K["Kvv"]], -1)], -2)
    return Kj, torch.cat([K["Kuf"], K["Kvf"]], -2)


def structured_dense(K, m_u, S_u, m_v, S_v):
    """q(u, v) as the image of q(u) q(v⊥) under (u, v⊥) -> (u, v⊥ + Kvu Kuu^-1 u), by the linear map T."""
    T = torch.eye(M + M2)
    T[M:, :M] = torch.linalg.solve(K["Kuu"], K["Kuv"]).mT
    return T @ torch.cat([m_u, m_v]), T @ torch.block_diag(S_u, S_v) @ T.mT


def qf_dense(Kuu, Kuf, kff_diag, m, S):
    """SVGP marginals q(f_n) = N(a_n^T m, k_nn - a_n^T (Kuu - S) a_n), a_n = Kuu^-1 k_un (Hensman 2015)."""
    a = torch.linalg.solve(Kuu, Kuf)
    return a.mT @ m, kff_diag - (a * ((Kuu - S) @ a)).sum(-2)


def kl_dense(m, S, K):
    Kinv_S = torch.linalg.solve(K, S)
    return 0.5 * (torch.trace(Kinv_S) + m @ torch.linalg.solve(K, m) - m.shape[-1] + torch.logdet(K) - torch.logdet(S))


def svgp_elbo(y, elp, Kuu, Kuf, kff_diag, m, S):
    """Hensman 2015 eq. 21, dense."""
    mu, var = qf_dense(Kuu, Kuf, kff_diag, m, S)
    return elp(y, mu, var).sum(-1) - kl_dense(m, S, Kuu)


def qff(K):
    return K["Kuf"].mT @ torch.linalg.solve(K["Kuu"], K["Kuf"])


def titsias_bound(y, s, K):
    """Titsias 2009 (the paper's eq. 3), dense."""
    Q = qff(K)
    mvn = torch.distributions.MultivariateNormal(torch.zeros(N), Q + s * torch.eye(N))
    return mvn.log_prob(y) - 0.5 * (K["kff_diag"].sum() - torch.trace(Q)) / s


def exact_lml(y, s, Kff):
    return torch.distributions.MultivariateNormal(torch.zeros(N), Kff + s * torch.eye(N)).log_prob(y)


def gaussian_elp(y, mu, var, s=NOISE):
    return torch.distributions.Normal(mu, s**0.5).log_prob(y) - 0.5 * var / s


def probit_elp(y, mu, var, n=40):
    x, w = gauss_hermite(n, mu.dtype)
    f = mu.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * x
    return (torch.special.log_ndtr((2 * y - 1).unsqueeze(-1) * f) * w).sum(-1)


def optimal_qu_dense(r, s, Kuu, Kuf):
    """argmax over q(u) of E_q(u) log N(r | Kfu Kuu^-1 u, s I) - KL[q(u) || p(u)] (Titsias 2009; dense inverses)."""
    Ki = torch.linalg.inv(Kuu)
    S = torch.linalg.inv(Ki + Ki @ Kuf @ Kuf.mT @ Ki / s)
    S = 0.5 * (S + S.mT)
    return S @ Ki @ Kuf @ r / s, S


def close(a, b, rel=1e-8):
    assert torch.allclose(a, b, rtol=rel, atol=rel), (a, b, (a - b).abs().max())


def chol(S):
    return torch.linalg.cholesky(S)


# -- section 3.3 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_marginals_kl_and_eq8_equal_the_structured_svgp_over_the_union(seed):
    K, y, _ = problem(seed)
    m_u, L_u, m_v, L_v = q_params(seed)
    m_uv, S_uv = structured_dense(K, m_u, L_u @ L_u.mT, m_v, L_v @ L_v.mT)
    Kj, Kjf = joint(K)
    mu_d, var_d = qf_dense(Kj, Kjf, K["kff_diag"], m_uv, S_uv)
    mu, var = solvegp_marginals(**K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, **J)
    close(mu, mu_d)
    close(var, var_d)
    kl = kl_terms(K["Kuu"], K["Kuv"], K["Kvv"], m_u, L_u, m_v, L_v, **J)
    close(kl, kl_dense(m_uv, S_uv, Kj))
    ours = solvegp_elbo(y, gaussian_elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, **J)
    close(ours, svgp_elbo(y, gaussian_elp, Kj, Kjf, K["kff_diag"], m_uv, S_uv))


def test_structured_svgp_params_is_section_3_3():
    K, _, _ = problem(3)
    m_u, L_u, m_v, L_v = q_params(3)
    m_d, S_d = structured_dense(K, m_u, L_u @ L_u.mT, m_v, L_v @ L_v.mT)
    m_uv, S_uv = structured_svgp_params(K["Kuu"], K["Kuv"], m_u, L_u, m_v, L_v, **J)
    close(m_uv, m_d)
    close(S_uv, S_d)
    # the paper's block form of S_uv
    P = torch.linalg.solve(K["Kuu"], K["Kuv"]).mT
    S_u, S_v = L_u @ L_u.mT, L_v @ L_v.mT
    close(S_uv[:M, M:], S_u @ P.mT)
    close(S_uv[M:, M:], S_v + P @ S_u @ P.mT)
    _, L_uv = structured_svgp_params(K["Kuu"], K["Kuv"], m_u, L_u, m_v, L_v, return_scale_tril=True, **J)
    assert torch.equal(L_uv, L_uv.tril())
    close(L_uv @ L_uv.mT, S_d)
    # ODVGP (section 5): S_v = Cvv gives S'_uv's corner Kvv + Kvu Kuu^-1 (S_u - Kuu) Kuu^-1 Kuv
    _, S_od = structured_svgp_params(K["Kuu"], K["Kuv"], m_u, L_u, m_v, chol(cvv(K)), **J)
    close(S_od[M:, M:], K["Kvv"] + P @ (S_u - K["Kuu"]) @ P.mT)


# -- eq. 8 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lik", ["gaussian", "probit"])
def test_eq8_with_the_prior_q_v_is_svgp_with_z_alone(lik):
    K, y, _ = problem(4)
    m_u, L_u, _, _ = q_params(4)
    elp = gaussian_elp
    if lik == "probit":
        y, elp = (y > 0).to(y.dtype), probit_elp
    ours = solvegp_elbo(y, elp, **K, m_u=m_u, L_u=L_u, m_v=torch.zeros(M2), L_v=chol(cvv(K)), **J)
    close(ours, svgp_elbo(y, elp, K["Kuu"], K["Kuf"], K["kff_diag"], m_u, L_u @ L_u.mT))
    # and q(v⊥) away from the prior changes it (the test can fail)
    _, _, m_v, L_v = q_params(4)
    other = solvegp_elbo(y, elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, **J)
    assert (other - ours).abs() > 1e-3


def test_eq8_minibatch_scaling():
    K, y, _ = problem(5)
    q = dict(zip(["m_u", "L_u", "m_v", "L_v"], q_params(5), strict=False))
    kl = kl_terms(K["Kuu"], K["Kuv"], K["Kvv"], **q, **J)
    full = solvegp_elbo(y, gaussian_elp, **K, **q, **J)
    scaled = solvegp_elbo(y, gaussian_elp, **K, **q, num_data=4 * N, **J)
    close(scaled, 4 * (full + kl) - kl)


# -- eqs. 9, 10 and 28-30 -------------------------------------------------------------------------------------------
def test_eq9_with_the_prior_q_v_is_titsias():
    K, y, _ = problem(6)
    eq9 = solvegp_collapsed_bound(y, NOISE, **K, m_v=torch.zeros(M2), L_v=chol(cvv(K)), **J)
    close(eq9, titsias_bound(y, NOISE, K))


@pytest.mark.parametrize("seed", [0, 1])
def test_eq9_is_eq8_at_the_optimal_q_u_and_dominates_eq8(seed):
    K, y, _ = problem(seed)
    m_u, L_u, m_v, L_v = q_params(seed)
    eq9 = solvegp_collapsed_bound(y, NOISE, **K, m_v=m_v, L_v=L_v, **J)
    # given q(v⊥), eq. 8's data term is that of SVGP with targets y - E[f⊥] (appendix C, eq. 24)
    shift = cfv(K) @ torch.linalg.solve(cvv(K), m_v)
    m_opt, S_opt = optimal_qu_dense(y - shift, NOISE, K["Kuu"], K["Kuf"])
    eq8_opt = solvegp_elbo(y, gaussian_elp, **K, m_u=m_opt, L_u=chol(S_opt), m_v=m_v, L_v=L_v, **J)
    close(eq9, eq8_opt)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    for _ in range(5):  # arbitrary q(u), and small perturbations of the optimum
        assert solvegp_elbo(y, gaussian_elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, **J) < eq9
        dm = 1e-3 * torch.randn(M, generator=g)
        dL = torch.eye(M) + 1e-3 * torch.randn(M, M, generator=g).tril()
        m_u, L_u = m_opt + dm, chol(S_opt) @ dL
        assert solvegp_elbo(y, gaussian_elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, **J) < eq9


def test_eq10_is_eq9_and_eq8_at_the_odvgp_restriction():
    K, y, _ = problem(7)
    _, _, m_v, _ = q_params(7)
    Lc = chol(cvv(K))
    eq10 = odvgp_bound(y, NOISE, **K, m_v=m_v, **J)
    close(eq10, solvegp_collapsed_bound(y, NOISE, **K, m_v=m_v, L_v=Lc, **J))
    m_opt, S_opt = optimal_qu_dense(y - cfv(K) @ torch.linalg.solve(cvv(K), m_v), NOISE, K["Kuu"], K["Kuf"])
    close(eq10, solvegp_elbo(y, gaussian_elp, **K, m_u=m_opt, L_u=chol(S_opt), m_v=m_v, L_v=Lc, **J))
    # eq. 10 written out densely
    A = qff(K) + NOISE * torch.eye(N)
    mean = cfv(K) @ torch.linalg.solve(cvv(K), m_v)
    dense = (
        torch.distributions.MultivariateNormal(mean, A).log_prob(y)
        - 0.5 * (K["kff_diag"].sum() - torch.trace(qff(K))) / NOISE
        - 0.5 * m_v @ torch.linalg.solve(cvv(K), m_v)
    )
    close(eq10, dense)


def test_optimal_q_v_maximises_eq9_eqs_28_to_30():
    K, y, Kff = problem(8)
    m_v, L_v = solvegp_optimal_q_v(y, NOISE, K["Kuu"], K["Kuv"], K["Kvv"], K["Kuf"], K["Kvf"], **J)
    # eqs. 28-29, dense
    C, Cf, A = cvv(K), cfv(K), qff(K) + NOISE * torch.eye(N)
    m_d = C @ torch.linalg.solve(C + Cf.mT @ torch.linalg.solve(A, Cf), Cf.mT @ torch.linalg.solve(A, y))
    S_d = C @ torch.linalg.solve(C + Cf.mT @ Cf / NOISE, C)
    close(m_v, m_d, 1e-7)
    close(L_v @ L_v.mT, S_d, 1e-7)
    # a stationary point of eq. 9
    mv, Lv = m_v.clone().requires_grad_(), L_v.clone().requires_grad_()
    eq9 = solvegp_collapsed_bound(y, NOISE, **K, m_v=mv, L_v=Lv, **J)
    gm, gL = torch.autograd.grad(eq9, (mv, Lv))
    assert gm.abs().max() < 1e-6 and gL.tril().abs().max() < 1e-6
    # eq. 30, dense
    Bm = Cf @ torch.linalg.solve(C, Cf.mT)
    Cff = Kff - qff(K)
    eq30 = (
        torch.distributions.MultivariateNormal(Cf @ torch.linalg.solve(C, m_d), A).log_prob(y)
        - 0.5 * torch.trace(Cff - Bm @ torch.linalg.solve(Bm + NOISE * torch.eye(N), Bm)) / NOISE
        - kl_dense(m_d, S_d, C)
    )
    close(eq9.detach(), eq30, 1e-7)
    # it dominates random q(v⊥), Titsias (the prior q(v⊥)), and stays below the evidence
    for seed in range(3):
        _, _, mr, Lr = q_params(seed)
        assert solvegp_collapsed_bound(y, NOISE, **K, m_v=mr, L_v=Lr, **J) < eq9
    assert titsias_bound(y, NOISE, K) < eq9 < exact_lml(y, NOISE, Kff)


# -- eq. 14 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_eq14_lies_between_titsias_eq3_and_the_evidence(seed):
    K, y, Kff = problem(seed)
    tight = solvegp_tight_bound(y, NOISE, K["Kuu"], K["Kuf"], Kff, **J)
    tits, exact = titsias_bound(y, NOISE, K), exact_lml(y, NOISE, Kff)
    assert tits < tight < exact
    # eq. 14 and the eq. 15 decomposition, dense
    Q = qff(K)
    A = Q + NOISE * torch.eye(N)
    dense14 = torch.distributions.MultivariateNormal(torch.zeros(N), A).log_prob(y) - 0.5 * torch.trace(
        torch.linalg.solve(A, Kff - Q)
    )
    close(tight, dense14)
    extra = torch.trace(
        K["Kuf"].mT @ torch.linalg.solve(K["Kuu"] + K["Kuf"] @ K["Kuf"].mT / NOISE, K["Kuf"]) @ (Kff - Q)
    ) / (2 * NOISE**2)
    close(tight, tits + extra)
    # eq. 9 at an arbitrary q(v⊥) is a bound too
    _, _, m_v, L_v = q_params(seed)
    assert solvegp_collapsed_bound(y, NOISE, **K, m_v=m_v, L_v=L_v, **J) < exact


# -- appendix F -----------------------------------------------------------------------------------------------------
def test_whitened_and_unwhitened_parameterisations_agree():
    K, y, _ = problem(9)
    w = q_params(9)  # whitened parameters
    Luu, Lcc = chol(K["Kuu"]), chol(cvv(K))
    m_u, L_u, m_v, L_v = Luu @ w[0], Luu @ w[1], Lcc @ w[2], Lcc @ w[3]
    for got, want in zip(unwhiten_params(K["Kuu"], K["Kuv"], K["Kvv"], *w, **J), (m_u, L_u, m_v, L_v), strict=False):
        close(got, want)
    for got, want in zip(whiten_params(K["Kuu"], K["Kuv"], K["Kvv"], m_u, L_u, m_v, L_v, **J), w, strict=False):
        close(got, want)
    qw = dict(m_u=w[0], L_u=w[1], m_v=w[2], L_v=w[3])
    qp = dict(m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v)
    for a, b in zip(solvegp_marginals(**K, **qw, whiten=True, **J), solvegp_marginals(**K, **qp, **J), strict=False):
        close(a, b)
    Kp = (K["Kuu"], K["Kuv"], K["Kvv"])
    close(kl_terms(*Kp, *w, whiten=True, **J), kl_terms(*Kp, m_u, L_u, m_v, L_v, **J))
    for elp in (gaussian_elp, probit_elp):
        yy = y if elp is gaussian_elp else (y > 0).to(y.dtype)
        close(solvegp_elbo(yy, elp, **K, **qw, whiten=True, **J), solvegp_elbo(yy, elp, **K, **qp, **J))
    close(
        solvegp_collapsed_bound(y, NOISE, **K, m_v=w[2], L_v=w[3], whiten=True, **J),
        solvegp_collapsed_bound(y, NOISE, **K, m_v=m_v, L_v=L_v, **J),
    )
    close(odvgp_bound(y, NOISE, **K, m_v=w[2], whiten=True, **J), odvgp_bound(y, NOISE, **K, m_v=m_v, **J))
    no_kff = {k: v for k, v in K.items() if k != "kff_diag"}
    mw, Lw = solvegp_optimal_q_v(y, NOISE, **no_kff, whiten=True, **J)
    mp, Lp = solvegp_optimal_q_v(y, NOISE, **no_kff, **J)
    close(Lcc @ mw, mp)
    close(Lcc @ Lw @ Lw.mT @ Lcc.mT, Lp @ Lp.mT)


# -- shapes and dtypes ----------------------------------------------------------------------------------------------
def test_leading_batch_dimensions_give_per_batch_results():
    K, y, Kff = problem(10, batch=(2,))
    q = q_params(10, batch=(2,))
    noise = torch.tensor([0.1, 0.3])
    no_kff = {k: v for k, v in K.items() if k != "kff_diag"}

    def calls(K, y, Kff, q, s):
        kw = dict(zip(["m_u", "L_u", "m_v", "L_v"], q, strict=False))
        nk = {k: v for k, v in K.items() if k != "kff_diag"}
        out = list(solvegp_marginals(**K, **kw))
        out += list(solvegp_marginals(**K, **kw, whiten=True))
        out.append(kl_terms(K["Kuu"], K["Kuv"], K["Kvv"], *q))
        out.append(solvegp_elbo(y, lambda y, m, v: gaussian_elp(y, m, v, s.unsqueeze(-1) if s.dim() else s), **K, **kw))
        out.append(solvegp_collapsed_bound(y, s, **K, m_v=q[2], L_v=q[3]))
        out.append(odvgp_bound(y, s, **K, m_v=q[2]))
        out += list(solvegp_optimal_q_v(y, s, **nk))
        out.append(solvegp_tight_bound(y, s, K["Kuu"], K["Kuf"], Kff))
        out += list(structured_svgp_params(K["Kuu"], K["Kuv"], *q))
        return out

    batched = calls(K, y, Kff, q, noise)
    assert batched[0].shape == (2, N) and batched[4].shape == (2,) and batched[-1].shape == (2, M + M2, M + M2)
    for b in range(2):
        single = calls({k: v[b] for k, v in K.items()}, y[b], Kff[b], [t[b] for t in q], noise[b])
        for got, want in zip(batched, single, strict=False):
            close(got[b], want, 1e-10)
    # a q shared across the batch broadcasts against batched kernel matrices
    q0 = [t[0] for t in q]
    shared = solvegp_elbo(y, gaussian_elp, **K, m_u=q0[0], L_u=q0[1], m_v=q0[2], L_v=q0[3])
    assert shared.shape == (2,)
    close(
        shared[1],
        solvegp_elbo(y[1], gaussian_elp, **{k: v[1] for k, v in K.items()}, m_u=q0[0], L_u=q0[1], m_v=q0[2], L_v=q0[3]),
        1e-10,
    )
    del no_kff


def test_float32_inputs_give_float32_bounds():
    K64, y64, Kff64 = problem(11)
    q64 = q_params(11)
    K32, y32, Kff32 = {k: v.float() for k, v in K64.items()}, y64.float(), Kff64.float()
    q32 = [t.float() for t in q64]
    for K, y, Kff, q, tol in ((K32, y32, Kff32, q32, 1e-3), (K64, y64, Kff64, q64, None)):
        kw = dict(zip(["m_u", "L_u", "m_v", "L_v"], q, strict=False))
        vals = [
            solvegp_elbo(y, lambda y, m, v: gaussian_elp(y, m, v), **K, **kw),
            solvegp_elbo(y, lambda y, m, v: gaussian_elp(y, m, v), **K, **kw, whiten=True),
            solvegp_collapsed_bound(y, NOISE, **K, m_v=q[2], L_v=q[3]),
            odvgp_bound(y, NOISE, **K, m_v=q[2]),
            solvegp_tight_bound(y, NOISE, K["Kuu"], K["Kuf"], Kff),
        ]
        if tol is not None:
            assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in vals)
            vals32 = vals
        else:
            for a, b in zip(vals32, vals, strict=False):
                assert abs(a.double() - b) < 1e-3 * abs(b), (a, b)


# -- appendix D.3 ---------------------------------------------------------------------------------------------------
def _trisolve_cost(n, k):
    """Name a triangular solve of an [n, n] system with k right-hand sides by table 4's monomials."""
    if n == M:
        return {N: "N M^2", M2: "M^2 M2", M: "M^3", M + 1: "M^3"}.get(k, f"other {n}x{k}")
    if n == M2:
        return {N: "N M2^2", M: "M M2^2", M2: "M2^3", M2 + 1: "M2^3"}.get(k, f"other {n}x{k}")
    return f"other {n}x{k}"


def _num_rhs(call):
    """Right-hand sides of a recorded ``solve_triangular`` call (``left=False`` solves ``X A = B``: rows of B)."""
    B = call.args[1]
    return B.shape[-2] if call.kwargs.get("left", True) is False else B.shape[-1]


@pytest.mark.parametrize("whiten", [False, True])
def test_elbo_factorises_only_kuu_and_cvv_and_follows_table_4(whiten):
    K, y, _ = problem(12)
    m_u, L_u, m_v, L_v = q_params(12)
    real_chol, real_tri = torch.linalg.cholesky_ex, torch.linalg.solve_triangular
    with (
        mock.patch("torch.linalg.cholesky_ex", side_effect=real_chol) as ch,
        mock.patch("torch.linalg.cholesky", side_effect=torch.linalg.cholesky) as ch2,
        mock.patch("torch.linalg.solve_triangular", side_effect=real_tri) as tri,
    ):
        val = solvegp_elbo(y, gaussian_elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, whiten=whiten)
    assert torch.isfinite(val)
    sizes = sorted(c.args[0].shape[-1] for c in ch.call_args_list)
    assert sizes == sorted([M, M2]) and ch2.call_count == 0  # once each, never M + M2 = 12
    found = Counter(_trisolve_cost(c.args[0].shape[-1], _num_rhs(c)) for c in tri.call_args_list)
    if whiten:  # E = B, G = D and the KLs against N(0, I) need no solves
        assert found == Counter({"M^2 M2": 1, "N M^2": 1, "N M2^2": 1})
    else:  # algorithm 1 exactly: the trisolve column of table 4
        assert found == Counter(count_cubic_operations(M, M2, "solvegp")["trisolve"])


def test_count_cubic_operations_is_table_4():
    svgp, solve = count_cubic_operations(256, 256, "svgp"), count_cubic_operations(256, 256, "solvegp")
    assert svgp == {"matmul": {"N M^2": 1}, "cholesky": {"M^3": 1}, "trisolve": {"M^3": 1, "N M^2": 2}}
    assert {op: sum(c.values()) for op, c in svgp.items()} == {"matmul": 1, "cholesky": 1, "trisolve": 3}
    assert {op: sum(c.values()) for op, c in solve.items()} == {"matmul": 4, "cholesky": 2, "trisolve": 7}
    assert solve["cholesky"] == {"M^3": 1, "M2^3": 1}
    assert count_cubic_operations(64, 0, "solvegp") == svgp  # no orthogonal points: SVGP
    # figure 4, in units of one op on M x M matrices: (a) N = M, (b) M >> N
    m = 100

    def units(method, M_, M2_, N_):
        return {op: v / m**3 for op, v in cubic_cost(M_, M2_, method, N_).items()}

    assert units("svgp", m, 0, m) == {"matmul": 1, "cholesky": 1, "trisolve": 3}
    assert units("svgp", 2 * m, 0, 2 * m) == {"matmul": 8, "cholesky": 8, "trisolve": 24}
    assert units("solvegp", m, m, m) == {"matmul": 4, "cholesky": 2, "trisolve": 7}
    assert units("svgp", 2 * m, 0, 0) == {"matmul": 0, "cholesky": 8, "trisolve": 8}
    assert units("solvegp", m, m, 0) == {"matmul": 1, "cholesky": 2, "trisolve": 3}
    with pytest.raises(ValueError):
        count_cubic_operations(10, 10, "fitc")
    with pytest.raises(ValueError):
        count_cubic_operations(10, -1, "solvegp")


# -- the module ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("whiten", [False, True])
def test_solvegp_module_analytic_elbo_uses_the_same_parameterisation(whiten):
    """Cross-check against :class:`pyro_sparsegp.SOLVEGP` (whose whitening is appendix F's, like ours)."""
    from pyro.contrib.gp.kernels import RBF

    import pyro_sparsegp as ps

    g = torch.Generator(torch.get_default_device()).manual_seed(13)
    X, Z, O = (torch.rand(n, DIM, generator=g) * 4 - 2 for n in (N, M, M2))
    y = torch.sin(2 * X[:, 0]) + 0.3 * torch.randn(N, generator=g)
    k = RBF(DIM, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.7))
    gp = ps.SOLVEGP(k, Z, O, ps.Gaussian(NOISE), whiten=whiten)
    m_u, L_u, m_v, L_v = q_params(13)
    with torch.no_grad():
        gp.q_u.set(m_u, L_u)
        gp.q_v.set(m_v, L_v)
        ours = gp.analytic_elbo(X, y)
        K = dict(Kuu=k(Z), Kuv=k(Z, O), Kvv=k(O), Kuf=k(Z, X), Kvf=k(O, X), kff_diag=k(X, diag=True))
    ref = solvegp_elbo(y, gaussian_elp, **K, m_u=m_u, L_u=L_u, m_v=m_v, L_v=L_v, whiten=whiten)
    assert abs(ours - ref) < 1e-7 * abs(ref)


def test_library_structured_svgp_params_is_the_oracle():
    """The library's section-3.3 map (pyro_sparsegp.variational.structured, used by SOLVEGP.to_svgp) against this
    oracle's block-by-block formulas, batched and not, for the covariance and for its scale factor."""
    from pyro_sparsegp.variational.structured import structured_svgp_params as library

    for batch in ((), (2,)):
        K, _, _ = problem(3)
        m_u, L_u, m_v, L_v = q_params(3)
        if batch:
            m_u, L_u = m_u.expand(batch + m_u.shape), L_u.expand(batch + L_u.shape)
        for tril in (False, True):
            ours = library(K["Kuu"], K["Kuv"], m_u, L_u, m_v, L_v, return_scale_tril=tril, **J)
            oracle = structured_svgp_params(K["Kuu"], K["Kuv"], m_u, L_u, m_v, L_v, return_scale_tril=tril, **J)
            for a, b in zip(ours, oracle, strict=True):
                assert a.shape == b.shape
                close(a, b)
