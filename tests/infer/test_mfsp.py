"""MFSp (Hensman, Matthews, Ghahramani 2015, sec. 3.1): eq. 12 against Monte Carlo and the exact marginal
likelihood, the q(u) it writes against dense algebra, and its fit."""
import math

import numpy as np
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from scipy import stats

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit_mfsp
from pyro_sparsegp.infer.ep import mfsp_bound
from pyro_sparsegp.kernels import kernel_diag, kernel_matrix
from pyro_sparsegp.linalg import cholesky


def _problem(N=5, M=3, whiten=True, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.randn(N, 2, generator=g)
    y = (X[:, 0] + 0.3 * torch.randn(N, generator=g) > 0).to(X.dtype)
    gp = ps.SVGP(RBF(2, lengthscale=torch.tensor(1.2), variance=torch.tensor(1.5)), X[:M].clone() + 0.1,
                 ps.Bernoulli("probit"), whiten=whiten)
    return gp, X, y


def _dense(gp, X):
    with torch.no_grad():
        L = cholesky(kernel_matrix(gp.kernel, gp.Z), gp.jitter)
        Kmm = L @ L.mT
        Kmn = kernel_matrix(gp.kernel, gp.Z, X)
        Q = Kmn.mT @ torch.linalg.solve(Kmm, Kmn)
        return Kmm, Kmn, Q, kernel_diag(gp.kernel, X)


@pytest.mark.float64
def test_bound_matches_monte_carlo_and_lies_below_log_marginal():
    gp, X, y = _problem()
    a = torch.tensor([0.3, -0.5, 1.0, 0.1, -1.2])
    with torch.no_grad():
        bound = mfsp_bound(gp, X, y, a).item()
    Kmm, Kmn, Q, kdiag = _dense(gp, X)
    A = (Q + torch.eye(5)).cpu().numpy()
    Ainv = np.linalg.inv(A)
    s = 1 / np.sqrt(np.diag(Ainv))
    sgn = 2 * y.cpu().numpy() - 1
    lo = np.where(sgn > 0, -a.cpu().numpy() / s, -np.inf)
    hi = np.where(sgn > 0, np.inf, -a.cpu().numpy() / s)
    tn = stats.truncnorm(lo, hi, loc=a.cpu().numpy(), scale=s)
    rng = np.random.default_rng(0)
    G = tn.rvs(size=(200_000, 5), random_state=rng)  # q(g) = prod of truncated normals
    # E_q[log N(g | 0, Q + I) - log q(g)] - tr(K - Q) / 2, both expectations by Monte Carlo
    terms = stats.multivariate_normal(np.zeros(5), A).logpdf(G) - tn.logpdf(G).sum(1)
    mc = terms.mean() - 0.5 * float((kdiag - Q.diagonal()).sum())
    se = terms.std() / np.sqrt(len(terms))
    assert abs(bound - mc) < 4 * se, (bound, mc, se)
    # exact log p(y) of the probit GP: the orthant probability of g ~ N(0, K + I)
    Knn = kernel_matrix(gp.kernel, X).detach().cpu().numpy()
    D = np.diag(sgn)
    logp = math.log(stats.multivariate_normal(np.zeros(5), D @ (Knn + np.eye(5)) @ D).cdf(np.zeros(5)))
    assert bound < logp


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [True, False])
def test_fit_writes_the_posterior_of_u_given_eg(whiten):
    gp, X, y = _problem(N=12, M=4, whiten=whiten)
    st = fit_mfsp(gp, X, y, num_iters=30)
    assert st.bounds[-1] > st.bounds[0]
    a = st.a.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(mfsp_bound(gp, X, y, a), a)
    assert ga.abs().max() < 1e-3  # stationary in the free means
    Kmm, Kmn, Q, _ = _dense(gp, X)
    Ainv = torch.linalg.inv(Q + torch.eye(12))
    s = 1 / Ainv.diagonal().sqrt()
    z = (2 * y - 1) * st.a / s
    lam = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi) / torch.special.ndtr(z)
    Eg = st.a + (2 * y - 1) * s * lam
    Sigma = Kmm - Kmn @ Ainv @ Kmn.mT
    mean = Sigma @ torch.linalg.solve(Kmm, Kmn @ Eg)
    m, Lq = gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    S = Lq @ Lq.mT
    if whiten:
        L = cholesky(kernel_matrix(gp.kernel, gp.Z).detach(), gp.jitter)
        m, S = L @ m, L @ S @ L.mT
    assert torch.allclose(m, mean, atol=1e-7) and torch.allclose(S, Sigma, atol=1e-7)
    probs = gp.predict(X, full=True)[2].probs
    assert ((probs > 0.5).to(y.dtype) == y).double().mean() > 0.8


def test_errors():
    gp, X, y = _problem()
    with pytest.raises(ValueError, match="probit"):
        fit_mfsp(ps.SVGP(RBF(2), X[:2], ps.Bernoulli("logit")), X, y)
