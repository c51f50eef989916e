"""ODVGP with column subsampling (Shi, Titsias, Mnih 2020, section 6.3; Salimbeni et al. 2018): with all columns the
bound is eq. 8 at S_v = C_vv, m_v = C_vv a (a dense computation and SOLVEGP(odvgp=True) agree); with J < M2 columns
the bound and its gradient are unbiased; no M2 x M2 tensor is formed; prediction equals the dense ODVGP's."""

import math

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from torch.utils._python_dispatch import TorchDispatchMode

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit

N, M, M2, D = 30, 4, 12, 2


def _gp(whiten=False, num_subsample=None, m2=M2, jitter=0.0, spread=1.0):
    X = torch.rand(N, D) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.3 * torch.randn(N)
    k = RBF(D, variance=torch.tensor(1.5), lengthscale=torch.tensor(0.7))
    gp = ps.ODVGP(k, torch.rand(M, D) * 4 - 2, (torch.rand(m2, D) * 4 - 2) * spread, ps.Gaussian(0.2),
                  num_subsample=num_subsample, whiten=whiten, jitter=jitter)
    with torch.no_grad():
        m = 0.7 * torch.randn(M)
        gp.q_u.set(m, torch.tril(0.2 * torch.randn(M, M), -1) + torch.diag(0.4 + 0.3 * torch.rand(M)))
        gp.a = 0.5 * torch.randn(m2)
    return X, y, gp


def _dense_bound(gp, X, y, num_data):
    """Eq. 8 from dense matrices and torch.distributions: q(f_n) from eqs. 32-34, KLs of eqs. 35-36, at
    S_v = C_vv and m_v = C_vv a (un-whitened m_u, S_u)."""
    k, Z, O = gp.kernel, gp.Z.detach(), gp.O.detach()
    Kuu, Kuv, Kvv, Kuf, Kvf = k(Z), k(Z, O), k(O), k(Z, X), k(O, X)
    a, m_u, L_u = gp.a.detach(), gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    if gp.whiten:
        Lu0 = torch.linalg.cholesky(Kuu)
        m_u, L_u = Lu0 @ m_u, Lu0 @ L_u
    S_u = L_u @ L_u.mT
    Cvv = Kvv - Kuv.mT @ torch.linalg.solve(Kuu, Kuv)
    Cvf = Kvf - Kuv.mT @ torch.linalg.solve(Kuu, Kuf)
    m_v, S_v = Cvv @ a, Cvv
    E, G = torch.linalg.solve(Kuu, Kuf), torch.linalg.solve(Cvv, Cvf)
    mu = E.mT @ m_u + G.mT @ m_v
    var = (k(X, diag=True) - (Kuf * E).sum(0) + (E * (S_u @ E)).sum(0) + (G * ((S_v - Cvv) @ G)).sum(0))
    s = gp.likelihood.noise.detach()
    ell = -0.5 * torch.log(2 * math.pi * s) - 0.5 * ((y - mu) ** 2 + var) / s
    MVN, kl = torch.distributions.MultivariateNormal, torch.distributions.kl_divergence
    kl_u = kl(MVN(m_u, S_u), MVN(torch.zeros(M), Kuu))
    kl_v = kl(MVN(m_v, S_v), MVN(torch.zeros(len(a)), Cvv))
    return num_data / len(y) * ell.sum() - kl_u - kl_v


def _solvegp(gp):
    """SOLVEGP(odvgp=True) at gp's parameters: q_v.u_loc = C_vv a (whitened: chol(C_vv)^T a)."""
    k = gp.kernel
    sg = ps.SOLVEGP(k, gp.Z.detach().clone(), gp.O.detach().clone(), gp.likelihood, whiten=gp.whiten, odvgp=True,
                    jitter=0.0, name="dense")
    with torch.no_grad():
        Z, O = gp.Z, gp.O
        Kuv = k(Z, O)
        Cvv = k(O) - Kuv.mT @ torch.linalg.solve(k(Z), Kuv)
        m_v = torch.linalg.cholesky(Cvv).mT @ gp.a if gp.whiten else Cvv @ gp.a
        sg.q_u.set(gp.q_u.u_loc, gp.q_u.u_scale_tril)
        sg.q_v.set(m_v)
    return sg


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True])
def test_all_columns_equal_dense_odvgp_bound(whiten):
    X, y, gp = _gp(whiten)
    val = gp.analytic_elbo(X, y, num_data=100)
    assert val.item() == pytest.approx(gp.analytic_elbo(X, y, num_data=100, columns=torch.randperm(M2)).item(),
                                       abs=1e-10)  # the exact path, columns in any order
    assert abs(val.item() - _dense_bound(gp, X, y, 100).item()) < 1e-8
    assert abs(val.item() - _solvegp(gp).analytic_elbo(X, y, num_data=100).item()) < 1e-8
    sg = _solvegp(gp)
    assert abs(gp.kl_divergence(columns=torch.arange(M2)).item() - sg.kl_divergence().item()) < 1e-8
    with torch.no_grad():  # a = 0: q(v⊥) = p(v⊥), the SVGP bound
        gp.a = torch.zeros(M2)
    svgp = ps.SVGP(gp.kernel, gp.Z.detach().clone(), gp.likelihood, whiten=whiten, jitter=0.0, name="svgp")
    svgp.q_u.set(gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach())
    assert abs(gp.analytic_elbo(X, y).item() - svgp.analytic_elbo(X, y).item()) < 1e-8


def _draws(gp, X, y, J, n, grad=False):
    out = []
    for _ in range(n):
        gp.zero_grad()
        val = gp.analytic_elbo(X, y, columns=torch.randperm(M2)[:J])
        if grad:
            val.backward()
            out.append(gp.kernel.lengthscale_unconstrained.grad.item())
        else:
            out.append(val.item())
    return torch.tensor(out, dtype=torch.float64)


def test_subsampled_bound_is_unbiased():
    X, y, gp = _gp(num_subsample=4)
    with torch.no_grad():
        full = gp.analytic_elbo(X, y, columns=torch.arange(M2)).item()
        quad = gp.quad_kvv(torch.arange(M2)).item()
        vals = _draws(gp, X, y, 4, 1500)
    mean, se = vals.mean().item(), vals.std().item() / math.sqrt(len(vals))
    assert se > 0 and 4 * se < 0.1 * abs(0.5 * quad)  # noisy, yet able to see a 10 % bias of KL_v = a^T Cvv a / 2
    assert abs(mean - full) < 4 * se
    with torch.no_grad():  # the default draw (num_subsample columns) is the same estimator
        assert len({round(gp.analytic_elbo(X, y).item(), 6) for _ in range(5)}) > 1


def test_subsampled_gradient_is_unbiased():
    X, y, gp = _gp()
    gp.zero_grad()
    gp.analytic_elbo(X, y, columns=torch.arange(M2)).backward()
    full = gp.kernel.lengthscale_unconstrained.grad.item()
    gp.zero_grad()
    (0.5 * gp.quad_kvv(torch.arange(M2))).backward()
    g_quad = gp.kernel.lengthscale_unconstrained.grad.item()  # the part of the gradient that is subsampled
    g = _draws(gp, X, y, 4, 600, grad=True)
    mean, se = g.mean().item(), g.std().item() / math.sqrt(len(g))
    assert se > 0 and 4 * se < 0.2 * abs(g_quad)  # able to see a 20 % bias of the subsampled term
    assert abs(mean - full) < 4 * se


class _Shapes(TorchDispatchMode):
    """Largest tensor produced by any operator (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_m2_square_tensor():
    m2 = 1500
    X, y, gp = _gp(num_subsample=16, m2=m2, jitter=None, spread=30.0)  # spread: a well-conditioned dense Cvv
    with _Shapes() as shapes:
        gp.analytic_elbo(X, y, num_data=1000).backward()
    assert shapes.largest <= 2 * (N + 16) * m2  # linear: K_fv [B, M2] and K_{S,:} [J, M2] are the largest
    sg = ps.SOLVEGP(gp.kernel, gp.Z.detach(), gp.O.detach(), gp.likelihood, odvgp=True, name="dense")
    with _Shapes() as shapes:  # the hook sees the dense ODVGP's M2 x M2 matrices
        sg.analytic_elbo(X, y).backward()
    assert shapes.largest >= m2 * m2


def test_fit_then_predict_equals_dense_odvgp():
    X, y, gp = _gp(num_subsample=5, jitter=None)
    with torch.no_grad():
        gp.a = torch.zeros(M2)
    before = gp.analytic_elbo(X, y, columns=torch.arange(M2)).item()
    state = fit(gp, X, y, num_steps=150, batch_size=N, lr=0.02, progress=False)
    assert len(state.losses) == 150
    after = gp.analytic_elbo(X, y, columns=torch.arange(M2)).item()
    assert after > before
    assert gp.a.detach().abs().max() > 1e-3  # the mean weights were trained
    Xt = torch.rand(17, D) * 4 - 2
    mean, var, pred = gp.predict(Xt, full=True)
    sg = _solvegp(gp)
    sg.jitter = gp.jitter
    m2, v2 = sg.predict(Xt)
    tol = 1e-6 if mean.dtype == torch.float64 else 2e-3
    assert torch.allclose(mean, m2, atol=tol, rtol=tol) and torch.allclose(var, v2, atol=tol, rtol=tol)
    assert mean.shape == var.shape == (17,)
    f = gp.sample_posterior(Xt, num_samples=3)
    assert f.shape == (3, 17) and torch.isfinite(f).all()


def test_errors():
    X, y, gp = _gp()
    with pytest.raises(NotImplementedError, match="analytic_elbo"):
        gp.model(X, y)
    with pytest.raises(NotImplementedError, match="analytic_elbo"):
        gp.guide(X, y)
    k = RBF(D)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="num_subsample"):
            ps.ODVGP(k, torch.rand(M, D), torch.rand(M2, D), ps.Gaussian(0.1), num_subsample=bad)
    with pytest.raises(ValueError, match="O must be"):
        ps.ODVGP(k, torch.rand(M, D), torch.rand(M2, D + 1), ps.Gaussian(0.1))


def test_numpy_inputs_and_a_unique_default_name():
    """ODVGP takes inputs the way every module does (pyro_sparsegp.inputs): numpy Z, a list O, numpy X and y give
    the bound the tensors give; two ODVGPs built side by side get distinct names."""
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    X, y = torch.randn(30, 2, generator=g), torch.randn(30, generator=g)
    Z, O = X[:4].clone(), X[4:12].clone()
    a = ps.ODVGP(RBF(2), Z, O, ps.Gaussian(0.1))
    b = ps.ODVGP(RBF(2), Z.cpu().numpy(), O.tolist(), ps.Gaussian(0.1))
    assert a.name != b.name
    torch.testing.assert_close(b.analytic_elbo(X.cpu().numpy(), y.cpu().numpy()), a.analytic_elbo(X, y))
