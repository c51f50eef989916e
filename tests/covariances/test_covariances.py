"""Covariances dispatched on the (inducing type, kernel type) pair: the registry's MRO walk, a user rule used by an SVGP
layer end to end, the error for a pair without a rule, and Kuu / Kuf / Kdiag of every registered pair against their
dense definitions (inducing points: ``k(Z, X)``; patches: the explicit sum over patches; sums: block-diagonal and
stacked). Also EP, SEP and MFSp on a layer with inducing patches."""

import math

import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32, Matern52
from pyro.nn import PyroParam
from torch.distributions import constraints

import pyro_sparsegp as ps
from pyro_sparsegp import covariances as cov
from pyro_sparsegp.inducing import InducingVariables
from pyro_sparsegp.kernels import matern32

H, W = 5, 4
D = H * W


class MyRBF(RBF):
    """A user's subclass of Pyro's RBF (no rule of its own)."""


class MyPoints(ps.InducingPoints):
    """A user's subclass of InducingPoints (no rule of its own)."""


class ScaledPoints(InducingVariables):
    """``u_m = s_m f(z_m)``: inducing points with a learned scale each (a kind of inducing variable with no built-in
    rule): ``Kuu = (s s^T) o k(Z, Z)``, ``Kuf = s o k(Z, X)``."""

    def __init__(self, Z, scales):
        super().__init__(Z)
        self.scales = PyroParam(scales.detach().clone(), constraints.positive)


class ScaledPointsRule(cov.Rule):
    @staticmethod
    def Kuu(inducing, kernel, other=None):
        other = inducing if other is None else other
        return inducing.scales[:, None] * kernel(inducing.Z, other.Z) * other.scales

    @staticmethod
    def Kuf(inducing, kernel, X):
        return inducing.scales[:, None] * ps.kernels.kernel_matrix(kernel, inducing.Z, X)


def _rbf(d=2, ls=0.9):
    return RBF(d, variance=torch.tensor(1.4), lengthscale=torch.tensor(ls))


def test_the_mro_walk_finds_the_rule_of_the_parents():
    assert cov.lookup(MyPoints, MyRBF) is cov.lookup(ps.InducingPoints, RBF)
    Z, X = torch.randn(4, 2), torch.randn(6, 2)
    k = MyRBF(2, lengthscale=torch.tensor(0.7))
    torch.testing.assert_close(cov.Kuu(MyPoints(Z), k), RBF(2, lengthscale=torch.tensor(0.7))(Z))
    torch.testing.assert_close(cov.Kuf(MyPoints(Z), k, X), k(Z, X))
    torch.testing.assert_close(cov.Kdiag(k, X), k(X, diag=True))
    gp = ps.SVGP(k, MyPoints(Z), ps.Gaussian())
    assert torch.isfinite(gp.analytic_elbo(X, torch.randn(6)))
    # TICK's subclass finds the indexed-patches rule before the ConvKernel refusal
    sub_tick = type("MyTICK", (ps.TICK,), {})
    assert cov.lookup(ps.IndexedInducingPatches, sub_tick) is cov.lookup(ps.IndexedInducingPatches, ps.TICK)


def test_the_most_specific_pair_wins(registry):
    @cov.register(MyPoints, RBF)
    class Doubled(cov.Rule):
        @staticmethod
        def Kuu(inducing, kernel, other=None):
            return 2 * kernel(inducing.Z)

    assert cov.lookup(MyPoints, MyRBF) is Doubled  # (MyPoints, RBF) before (InducingPoints, Kernel)
    assert cov.lookup(ps.InducingPoints, MyRBF) is not Doubled
    Z = torch.randn(3, 2)
    torch.testing.assert_close(cov.Kuu(MyPoints(Z), _rbf()), 2 * _rbf()(Z))


def _dense_elbo(Kuu, Kuf, kff, m, Ls, y, noise, whiten):
    """The SVGP bound from its definition (Hensman, Matthews, Ghahramani 2015, eq. 19 for q(f); the Gaussian
    expectation in closed form): dense solves, no factor shared with the layer."""
    S = Ls @ Ls.T
    if whiten:
        Luu = torch.linalg.cholesky(Kuu)
        A = torch.linalg.solve_triangular(Luu, Kuf, upper=False)  # [M, B]: Luu^{-1} Kuf
        mu, var = A.T @ m, kff - A.pow(2).sum(0) + (A * (S @ A)).sum(0)
        kl = 0.5 * (torch.trace(S) + m @ m - len(m) - torch.logdet(S))
    else:
        A = torch.linalg.solve(Kuu, Kuf)  # [M, B]: Kuu^{-1} Kuf
        mu, var = A.T @ m, kff - (Kuf * A).sum(0) + (A * (S @ A)).sum(0)
        Ki = torch.linalg.inv(Kuu)
        kl = 0.5 * (torch.trace(Ki @ S) + m @ Ki @ m - len(m) + torch.logdet(Kuu) - torch.logdet(S))
    ell = -0.5 * math.log(2 * math.pi * noise) - ((y - mu).pow(2) + var) / (2 * noise)
    return ell.sum() - kl


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_a_user_rule_is_used_by_an_svgp_layer_end_to_end(registry, whiten):
    cov.register(ScaledPoints, RBF)(ScaledPointsRule)
    torch.manual_seed(0)
    Z, s, X, y = torch.randn(5, 2), torch.rand(5) + 0.5, torch.randn(9, 2), torch.randn(9)
    k = _rbf()
    gp = ps.SVGP(k, ScaledPoints(Z, s), ps.Gaussian(0.3), whiten=whiten)
    with torch.no_grad():
        gp.q_u.u_loc = torch.randn(5)
        gp.q_u.u_scale_tril = torch.tril(0.3 * torch.randn(5, 5), -1) + torch.diag(torch.rand(5) + 0.5)
    Kuu = s[:, None] * k(Z) * s
    Kuf = s[:, None] * k(Z, X)
    torch.testing.assert_close(cov.Kuu(gp.inducing, k), Kuu)
    dense = _dense_elbo(Kuu, Kuf, k(X, diag=True), gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach(), y, 0.3,
                        whiten)
    torch.testing.assert_close(gp.analytic_elbo(X, y).detach(), dense, rtol=1e-7, atol=1e-7)
    # the scales are trained: the bound's gradient reaches them through the user's rule, and it is the dense bound's
    # gradient in s (chain rule through the positive constraint's exp: ds/du = s)
    (g,) = torch.autograd.grad(gp.analytic_elbo(X, y), gp.inducing.scales_unconstrained)
    s_ = s.clone().requires_grad_(True)
    k_ = _rbf()
    dense_s = _dense_elbo(s_[:, None] * k_(Z) * s_, s_[:, None] * k_(Z, X), k_(X, diag=True), gp.q_u.u_loc.detach(),
                          gp.q_u.u_scale_tril.detach(), y, 0.3, whiten)
    (g_s,) = torch.autograd.grad(dense_s, s_)
    torch.testing.assert_close(g, g_s * s, rtol=1e-6, atol=1e-8)


def test_a_pair_without_a_rule_is_refused_at_layer_construction():
    conv = ps.ConvKernel(RBF(4), (H, W), 2)
    with pytest.raises(cov.NoRuleError) as info:
        ps.SVGP(RBF(4), ps.InducingPatches(torch.randn(3, 4)), ps.Gaussian())
    msg = str(info.value)
    assert isinstance(info.value, TypeError)
    assert "(InducingPatches, RBF)" in msg and "(InducingPatches, ConvKernel)" in msg
    assert "(InducingPoints, Kernel)" in msg and "convolutional kernel" in msg

    class Mystery(InducingVariables):
        pass

    with pytest.raises(TypeError, match=r"no covariance rule for the pair \(Mystery, RBF\).*Registered pairs"):
        ps.SVGP(RBF(2), Mystery(torch.randn(3, 2)), ps.Gaussian())
    with pytest.raises(TypeError, match=r"\(Mystery, ConvKernel\)"):
        cov.Kuf(Mystery(torch.randn(3, 4)), conv, torch.randn(2, D))
    with pytest.raises(TypeError, match="no diagonal k\\(x, x\\) registered for the kernel Mystery"):
        cov.Kdiag(Mystery(torch.randn(3, 2)), torch.randn(2, 2))
    with pytest.raises(ValueError, match="same kind"):
        cov.Kuu(ps.InducingPoints(torch.randn(3, 2)), RBF(2), MyPoints(torch.randn(2, 2)))


@pytest.mark.float64
@pytest.mark.parametrize("kernel", [_rbf, lambda: Matern52(2, lengthscale=torch.tensor(1.3))], ids=["rbf", "m52"])
@pytest.mark.parametrize("L", [None, 3], ids=str)
def test_inducing_points_are_k_of_z_and_x(kernel, L):
    k = kernel()
    lead = () if L is None else (L,)
    Z, Z2, X = torch.randn(lead + (4, 2)), torch.randn(lead + (2, 2)), torch.randn(2, 1, 5, 2)  # X [S, 1, B, D]
    u, v = ps.InducingPoints(Z), ps.InducingPoints(Z2)
    Zs, Z2s = Z.reshape(-1, 4, 2), Z2.reshape(-1, 2, 2)
    torch.testing.assert_close(cov.Kuu(u, k), torch.stack([k(z) for z in Zs]).reshape(lead + (4, 4)))
    Kuv = torch.stack([k(a, b) for a, b in zip(Zs, Z2s, strict=True)]).reshape(lead + (4, 2))
    torch.testing.assert_close(cov.Kuu(u, k, v), Kuv)
    Kuf = cov.Kuf(u, k, X)
    assert Kuf.shape == (2, len(Zs), 4, 5)
    for s in range(2):
        for i, z in enumerate(Zs):
            torch.testing.assert_close(Kuf[s, i], k(z, X[s, 0]))
    torch.testing.assert_close(cov.Kdiag(k, X), k(X.reshape(-1, 2), diag=True).reshape(2, 1, 5))
    torch.testing.assert_close(cov.Kuu(u, k, jitter=0.5), cov.Kuu(u, k) + 0.5 * torch.eye(4))


def _weights(k):
    with torch.no_grad():
        k.weights = torch.rand(k.num_patches) + 0.5
    return k.effective_weights().detach()


def _image_patches(x, h=2):
    """The ``h x h`` patches of one image ``[H*W]`` (stride 1, one channel), row-major over locations, by slicing."""
    img = x.reshape(H, W)
    return [(img[r : r + h, c : c + h].reshape(-1), (r, c)) for r in range(H - h + 1) for c in range(W - h + 1)]


@pytest.mark.float64
@pytest.mark.parametrize("tick", [False, True], ids=["conv", "tick"])
def test_inducing_patches_are_the_explicit_sum_over_patches(tick):
    base = RBF(4, variance=torch.tensor(1.2), lengthscale=torch.tensor(0.8))
    k = ps.TICK(base, (H, W), 2, location_lengthscale=1.7) if tick else ps.ConvKernel(base, (H, W), 2)
    w = _weights(k)
    Z, T, X = torch.randn(2, 3, 4), 3 * torch.rand(2, 3, 2), torch.randn(2, 1, 4, D)  # Z [L, M, d], X [S, 1, B, D]
    u = ps.IndexedInducingPatches(Z, T) if tick else ps.InducingPatches(Z)
    cov.check(u, k)
    m32 = Matern32(2, variance=torch.tensor(1.0), lengthscale=k.location_lengthscale.detach()) if tick else None

    def kt(a, b):  # the location kernel, from Pyro's own Matern32
        return m32(a.reshape(1, 2), b.reshape(1, 2))[0, 0] if tick else 1.0

    Kuu, Kuf = cov.Kuu(u, k), cov.Kuf(u, k, X)
    assert Kuu.shape == (2, 3, 3) and Kuf.shape == (2, 2, 3, 4)
    for l_ in range(2):
        kzz = torch.stack([torch.stack([base(Z[l_, i, None], Z[l_, j, None])[0, 0] * kt(T[l_, i], T[l_, j])
                                        for j in range(3)]) for i in range(3)])
        torch.testing.assert_close(Kuu[l_], kzz)
        for s in range(2):
            for m in range(3):
                for n in range(4):
                    ref = sum(w[p] * base(Z[l_, m, None], xp[None])[0, 0] * kt(T[l_, m], torch.tensor(t, dtype=Z.dtype))
                              for p, (xp, t) in enumerate(_image_patches(X[s, 0, n])))
                    torch.testing.assert_close(Kuf[s, l_, m, n], ref)
    torch.testing.assert_close(cov.Kdiag(k, X[0, 0]), k.Kff(X[0, 0]).diagonal())


@pytest.mark.float64
def test_sums_are_block_diagonal_and_stacked():
    conv = ps.ConvKernel(RBF(4, lengthscale=torch.tensor(0.9)), (H, W), 2)
    _weights(conv)
    rbf = _rbf(D, 3.0)
    k = ps.SumKernel(conv, rbf)
    Zc, Zr, X = torch.randn(3, 4), torch.randn(2, D), torch.randn(5, D)
    u = ps.InducingSum(ps.InducingPatches(Zc), Zr)
    v = ps.InducingSum(ps.InducingPatches(torch.randn(2, 4)), torch.randn(4, D))
    pc, pr = u.parts
    torch.testing.assert_close(cov.Kuu(u, k), torch.block_diag(cov.Kuu(pc, conv), rbf(Zr)))
    torch.testing.assert_close(cov.Kuu(u, k, v), torch.block_diag(cov.Kuu(pc, conv, v.parts[0]), rbf(Zr, v.parts[1].Z)))
    torch.testing.assert_close(cov.Kuf(u, k, X), torch.cat([cov.Kuf(pc, conv, X), rbf(Zr, X)]))
    torch.testing.assert_close(cov.Kdiag(k, X), conv.Kff(X).diagonal() + rbf(X, diag=True))
    # inducing points (images) under the convolutional kernel and under the sum: the full k_f
    torch.testing.assert_close(cov.Kuf(ps.InducingPoints(Zr), conv, X), conv.Kff(Zr, X))
    torch.testing.assert_close(cov.Kuu(ps.InducingPoints(Zr), k), conv.Kff(Zr) + rbf(Zr))


@pytest.mark.float64
def test_the_one_matern32_is_pyros():
    T1, T2, ls = 4 * torch.rand(5, 2), 4 * torch.rand(3, 2), torch.tensor(1.6)
    ref = Matern32(2, variance=torch.tensor(1.0), lengthscale=ls)(T1, T2)
    torch.testing.assert_close(matern32((T1[:, None] - T2).pow(2).sum(-1) / ls**2), ref)
    tick = ps.TICK(RBF(4), (H, W), 2, location_lengthscale=1.6)
    torch.testing.assert_close(tick.location_factor(T1, T2), ref)
    X, Z = torch.randn(4, 3), torch.randn(2, 3)
    k = Matern32(3, variance=torch.tensor(0.7), lengthscale=torch.tensor(0.9))
    torch.testing.assert_close(ps.kernels.kernel_matrix(k, X, Z), k(X, Z))


def _patch_classifier(lik, num_outputs=None):
    torch.manual_seed(0)
    base = RBF(4, variance=torch.tensor(1.3), lengthscale=torch.tensor(2.0))
    return ps.SVGP(ps.ConvKernel(base, (H, W), 2), ps.InducingPatches(torch.randn(4, 4)), lik,
                   num_outputs=num_outputs)


def test_sep_fits_a_layer_with_inducing_patches():
    X, y = torch.randn(12, D), torch.arange(12) % 3
    gp = _patch_classifier(ps.RobustMax(3), 3)
    state = ps.infer.fit_ep(gp, X, y, method="sep", num_iters=2)
    assert state.method == "sep"
    assert torch.isfinite(gp.predict(X)[0]).all()


def test_mfsp_fits_a_layer_with_inducing_patches():
    X, y = torch.randn(12, D), (torch.arange(12) % 2).to(torch.get_default_dtype())
    gp = _patch_classifier(ps.Bernoulli("probit"))
    ps.infer.fit_mfsp(gp, X, y, num_iters=2, frozen_iters=1)
    assert torch.isfinite(gp.predict(X)[0]).all()
    assert torch.isfinite(ps.infer.ep.mfsp_bound(gp, X, y, torch.zeros(12)))
