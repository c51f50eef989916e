"""ODVGP with column subsampling (Shi, Titsias, Mnih 2020, section 6.3; Salimbeni et al. 2018): with all columns the
bound is eq. 8 at S_v = C_vv, m_v = C_vv a (a dense computation and SOLVEGP(odvgp=True) agree); with J < M2 columns
the bound and its gradient are unbiased; no M2 x M2 tensor is formed; prediction equals the dense ODVGP's."""

import itertools
import math

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from torch.utils._python_dispatch import TorchDispatchMode

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit

N, M, M2, D = 30, 4, 12, 2
# a fresh module name per layer built here: under the default name ("odvgp"), held by the previous test's layer until
# the garbage collector frees it, every construction runs a full gc.collect() (context.naming.unique_name), about
# 0.1 s each in a test process's heap; test_numpy_inputs_and_a_unique_default_name keeps the default name
_NAMES = (f"odvgp_t{i}" for i in itertools.count())


def _gp(whiten=False, num_subsample=None, m2=M2, jitter=0.0, spread=1.0):
    X = torch.rand(N, D) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.3 * torch.randn(N)
    k = RBF(D, variance=torch.tensor(1.5), lengthscale=torch.tensor(0.7))
    gp = ps.ODVGP(k, torch.rand(M, D) * 4 - 2, (torch.rand(m2, D) * 4 - 2) * spread, ps.Gaussian(0.2),
                  num_subsample=num_subsample, whiten=whiten, jitter=jitter, name=next(_NAMES))
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


def test_column_sampler_draws_every_column_and_pair_uniformly():
    """``gp.columns()`` draws ``J`` distinct columns of ``M2``, each with probability ``J / M2`` and each pair with
    ``J (J - 1) / (M2 (M2 - 1))`` (uniform without replacement, what the estimator's unbiasedness and the variance
    of the module docstring assume): over ``n`` draws every column's count and every pair's count is binomial, and
    lies within 5 of its standard deviations (Bonferroni over 12 + 66 counts: a false alarm below 1e-4)."""
    J, n = 4, 4000
    _, _, gp = _gp(num_subsample=J)
    draws = torch.stack([gp.columns() for _ in range(n)]).cpu()  # [n, J]
    assert draws.shape == (n, J) and draws.dtype == torch.int64
    assert draws.min() >= 0 and draws.max() < M2
    assert (draws.sort(-1).values.diff(dim=-1) > 0).all()  # distinct within a draw
    counts = torch.bincount(draws.reshape(-1), minlength=M2).double()
    p = J / M2
    assert ((counts - n * p).abs() < 5 * math.sqrt(n * p * (1 - p))).all(), counts
    member = torch.zeros(n, M2, dtype=torch.float64).scatter_(1, draws, 1.0)
    pairs = (member.T @ member)[torch.triu_indices(M2, M2, 1).unbind()]  # [66]: draws holding both columns
    q = J * (J - 1) / (M2 * (M2 - 1))
    assert ((pairs - n * q).abs() < 5 * math.sqrt(n * q * (1 - q))).all(), pairs
    gp.num_subsample = None  # None (or J >= M2): every column, once
    assert torch.equal(gp.columns().sort().values.cpu(), torch.arange(M2))


def test_subsampled_bound_is_unbiased():
    """Through the layer's own column draws (``columns=None``, what ``fit`` evaluates): the bound is the exact one
    with ``a^T K_vv a`` replaced by the estimate from the columns :meth:`~pyro_sparsegp.ODVGP.columns` draws (the same
    draw, replayed from the seed), and that estimate averages to the exact value within 4 standard errors."""
    X, y, gp = _gp(num_subsample=4)
    with torch.no_grad():
        full = gp.analytic_elbo(X, y, columns=torch.arange(M2)).item()
        quad = gp.quad_kvv(torch.arange(M2)).item()
        for seed in range(3):
            torch.manual_seed(seed)
            own = gp.analytic_elbo(X, y).item()
            torch.manual_seed(seed)
            drawn = gp.columns()
            assert own == pytest.approx(full - 0.5 * (gp.quad_kvv(drawn).item() - quad), rel=1e-6, abs=1e-6)
        # 2000 draws: 4 SE is 6.5 % of a^T K_vv a (4.6 % at 4000; per-draw sd 0.73 |quad|), so the 10 % bias the next
        # line demands to see is 6.1 SE away, beyond the 4-SE bound with a margin of 2 SE
        vals = torch.tensor([gp.quad_kvv().item() for _ in range(2000)], dtype=torch.float64)
    mean, se = vals.mean().item(), vals.std().item() / math.sqrt(len(vals))
    assert se > 0 and 4 * se < 0.1 * abs(quad)  # noisy, yet able to see a 10 % bias of a^T K_vv a
    assert abs(mean - quad) < 4 * se, (mean, quad, se)


def test_subsampled_gradient_is_unbiased():
    """The gradient of the layer's own draw of the bound is the exact gradient with the gradient of ``a^T K_vv a``
    replaced by its estimate's, which averages to the exact one within 4 standard errors (lengthscale and ``a``)."""
    X, y, gp = _gp(num_subsample=4)

    def grads(fn):
        gp.zero_grad()
        fn().backward()
        return torch.cat([gp.kernel.lengthscale_unconstrained.grad.reshape(-1), gp.a_unconstrained.grad.reshape(-1)])

    full = grads(lambda: gp.analytic_elbo(X, y, columns=torch.arange(M2)))
    g_quad = grads(lambda: gp.quad_kvv(torch.arange(M2)))  # the part of the gradient that is subsampled
    torch.manual_seed(1)
    own = grads(lambda: gp.analytic_elbo(X, y))
    torch.manual_seed(1)
    drawn = gp.columns()
    torch.testing.assert_close(own, full - 0.5 * (grads(lambda: gp.quad_kvv(drawn)) - g_quad))
    # 400 draws: 4 SE of the lengthscale's entry is 9.8 % of it (5.1 % at 1500), so the 20 % bias the next line
    # demands to see is 8.1 SE away, beyond the 4.5-SE bound with a margin of 3.6 SE
    g = torch.stack([grads(gp.quad_kvv) for _ in range(400)]).double()  # [draws, 1 + M2]
    mean, se = g.mean(0), g.std(0) / math.sqrt(len(g))
    assert (se > 0).all() and 4 * se[0] < 0.2 * abs(g_quad[0])  # able to see a 20 % bias of the lengthscale's
    assert ((mean - g_quad).abs() < 4.5 * se).all(), (mean, g_quad, se)  # 13 entries: 4.5 SE, a false alarm < 1e-4


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
    # M2 = 400 (was 1500): an M2 x M2 tensor (160,000 entries) still exceeds the linear bound 2 (N + J) M2 = 36,800
    # 4.3-fold (any M2 > 2 (N + J) = 92 separates them), and the dense ODVGP's O(M2^3) check below costs 50x less
    m2 = 400
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
            ps.ODVGP(k, torch.rand(M, D), torch.rand(M2, D), ps.Gaussian(0.1), num_subsample=bad, name=next(_NAMES))
    with pytest.raises(ValueError, match="O must be"):
        ps.ODVGP(k, torch.rand(M, D), torch.rand(M2, D + 1), ps.Gaussian(0.1), name=next(_NAMES))


def test_numpy_inputs_and_a_unique_default_name():
    """ODVGP takes inputs the way every module does (pyro_sparsegp.checks.inputs): numpy Z, a list O, numpy X and y give
    the bound the tensors give; two ODVGPs built side by side get distinct names."""
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    X, y = torch.randn(30, 2, generator=g), torch.randn(30, generator=g)
    Z, O = X[:4].clone(), X[4:12].clone()
    a = ps.ODVGP(RBF(2), Z, O, ps.Gaussian(0.1))
    b = ps.ODVGP(RBF(2), Z.cpu().numpy(), O.tolist(), ps.Gaussian(0.1))
    assert a.name != b.name
    torch.testing.assert_close(b.analytic_elbo(X.cpu().numpy(), y.cpu().numpy()), a.analytic_elbo(X, y))
