"""Convolutional and TICK kernels, inducing patches: against explicit loops over patches and patch pairs."""

import itertools
import math

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern52
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps
from pyro_sparsegp.covariances import Kdiag, Kuf, Kuu, check
from pyro_sparsegp.kernels import patches

H, W, C = 5, 4, 2


def _loop_patches(img, h, w, s, channels):
    """Patches by explicit slicing of one image ``[H, W, C]``: list of (vector, (row, col))."""
    out = []
    for r in range(0, img.shape[0] - h + 1, s):
        for c in range(0, img.shape[1] - w + 1, s):
            block = img[r : r + h, c : c + w, :]  # [h, w, C]
            if channels:
                out += [(block[:, :, ch].reshape(-1), (r // s, c // s)) for ch in range(img.shape[2])]
            else:
                out.append((block.reshape(-1), (r // s, c // s)))
    return out


def _kernel(kind, h, w, s, normalisation, colour, ls_t=2.0):
    d = h * w * (1 if colour == "channels" else C)
    base = RBF(d, variance=torch.tensor(1.3), lengthscale=torch.tensor(1.7))
    args = dict(normalisation=normalisation, colour=colour)
    if kind == "tick":
        k = ps.TICK(base, (H, W, C), (h, w), s, location_lengthscale=ls_t, **args)
    else:
        k = ps.ConvKernel(base, (H, W, C), (h, w), s, **args)
    with torch.no_grad():
        k.weights = torch.randn(k.num_patches).exp()  # plain tensors stand for trained weights
    return k


def _loop_weights(k):
    c = {"mean": 1 / k.num_patches, "sum": 1.0, "sqrt": 1 / math.sqrt(k.num_patches)}[k.normalisation]
    return c * k.weights


def _kt(k, t1, t2):
    if not isinstance(k, ps.TICK):
        return 1.0
    r = math.dist(t1, t2) / float(k.location_lengthscale)
    return (1 + math.sqrt(3) * r) * math.exp(-math.sqrt(3) * r)


CASES = list(itertools.product(["conv", "tick"], ["mean", "sum", "sqrt"], ["patch", "channels"]))


@pytest.mark.float64
def test_patch_extraction_matches_slicing():
    X = torch.randn(3, H * W * C)
    for (h, w), s, ch in itertools.product([(2, 3), (3, 3), (5, 4)], [1, 2], [False, True]):
        P = patches(X, (H, W, C), (h, w), s, ch)
        for n in range(3):
            ref = torch.stack([v for v, _ in _loop_patches(X[n].reshape(H, W, C), h, w, s, ch)])
            torch.testing.assert_close(P[n], ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="neither"):
        patches(torch.randn(3, 7), (H, W, C), 2)


@pytest.mark.float64
@pytest.mark.parametrize("kind,normalisation,colour", CASES)
@torch.no_grad()
def test_kf_kuf_kdiag_equal_loops_over_patch_pairs(kind, normalisation, colour):
    h, w, s = 3, 2, 1 if colour == "patch" else 2
    k = _kernel(kind, h, w, s, normalisation, colour)
    X = torch.randn(3, H * W * C)
    X2 = torch.randn(2, H * W * C)
    Z = torch.randn(4, k.patch_dim)
    T = 3 * torch.rand(4, 2)
    wts = _loop_weights(k)
    kg = k.base_kernel
    pats = [_loop_patches(x.reshape(H, W, C), h, w, s, colour == "channels") for x in X]
    pats2 = [_loop_patches(x.reshape(H, W, C), h, w, s, colour == "channels") for x in X2]
    assert len(pats[0]) == k.num_patches
    Kff = torch.zeros(3, 2)
    for n, m in itertools.product(range(3), range(2)):
        for (p, (a, ta)), (q, (b, tb)) in itertools.product(enumerate(pats[n]), enumerate(pats2[m])):
            Kff[n, m] += wts[p] * wts[q] * kg(a[None], b[None])[0, 0] * _kt(k, ta, tb)
    torch.testing.assert_close(k(X, X2), Kff)
    dg = torch.stack([sum(wts[p] * wts[q] * kg(a[None], b[None])[0, 0] * _kt(k, ta, tb)
                           for (p, (a, ta)), (q, (b, tb)) in itertools.product(enumerate(pn), enumerate(pn)))
                       for pn in pats])
    torch.testing.assert_close(k(X, diag=True), dg)
    torch.testing.assert_close(Kdiag(k, X), dg)
    ind = ps.IndexedInducingPatches(Z, T) if kind == "tick" else ps.InducingPatches(Z)
    check(ind, k)
    Kzf = torch.zeros(4, 3)
    for m, n in itertools.product(range(4), range(3)):
        for p, (a, ta) in enumerate(pats[n]):
            Kzf[m, n] += wts[p] * kg(Z[m][None], a[None])[0, 0] * _kt(k, T[m].tolist(), ta)
    torch.testing.assert_close(Kuf(ind, k, X), Kzf)
    Kzz = kg(Z) * torch.tensor([[_kt(k, a.tolist(), b.tolist()) for b in T] for a in T])
    torch.testing.assert_close(Kuu(ind, k), Kzz)


@pytest.mark.float64
def test_normalisations_differ_by_constant_factors():
    X, Z = torch.randn(3, H * W * C), torch.randn(4, 3 * 3 * C)
    ks = {n: _kernel("conv", 3, 3, 1, n, "patch") for n in ("mean", "sum", "sqrt")}
    for k in ks.values():
        k.weights = ks["mean"].weights
    P = ks["sum"].num_patches
    ind = ps.InducingPatches(Z)
    torch.testing.assert_close(ks["sum"](X), P**2 * ks["mean"](X))
    torch.testing.assert_close(ks["sqrt"](X), P * ks["mean"](X))
    torch.testing.assert_close(Kuf(ind, ks["sum"], X), P * Kuf(ind, ks["mean"], X))


@pytest.mark.float64
def test_tick_with_long_location_lengthscale_equals_invariant_kernel():
    X, Z, T = torch.randn(3, H * W * C), torch.randn(4, 3 * 2 * C), 4 * torch.rand(4, 2)
    conv = _kernel("conv", 3, 2, 1, "mean", "patch")
    tick = _kernel("tick", 3, 2, 1, "mean", "patch", ls_t=1e9)
    tick.weights = conv.weights
    torch.testing.assert_close(tick(X), conv(X), rtol=0, atol=1e-8)
    torch.testing.assert_close(tick(X, diag=True), conv(X, diag=True), rtol=0, atol=1e-8)
    torch.testing.assert_close(Kuf(ps.IndexedInducingPatches(Z, T), tick, X), Kuf(ps.InducingPatches(Z), conv, X),
                               rtol=0, atol=1e-8)
    torch.testing.assert_close(Kuu(ps.IndexedInducingPatches(Z, T), tick), Kuu(ps.InducingPatches(Z), conv),
                               rtol=0, atol=1e-8)
    # a short lengthscale changes it: the test can fail
    tick.location_lengthscale = torch.tensor(0.5)
    assert (tick(X) - conv(X)).abs().max() > 1e-3


@pytest.mark.float64
@pytest.mark.parametrize("kind", ["conv", "tick"])
def test_joint_prior_covariance_is_psd(kind):
    k = _kernel(kind, 2, 2, 1, "mean", "patch")
    X = torch.randn(6, H * W * C)
    Z, T = torch.randn(5, k.patch_dim), 4 * torch.rand(5, 2)
    ind = ps.IndexedInducingPatches(Z, T) if kind == "tick" else ps.InducingPatches(Z)
    Kzf = Kuf(ind, k, X)
    J = torch.cat([torch.cat([Kuu(ind, k), Kzf], 1), torch.cat([Kzf.T, k(X)], 1)], 0)
    torch.testing.assert_close(J, J.T)
    ev = torch.linalg.eigvalsh(J)
    assert ev.min() > -1e-10 * ev.max()
    # a wrong Kuf (scaled by 3) breaks positive semi-definiteness: the check can fail
    J[:5, 5:] *= 3
    J[5:, :5] *= 3
    assert torch.linalg.eigvalsh(J).min() < -1e-6


@pytest.mark.float64
def test_patch_the_size_of_the_image_is_the_base_kernel():
    base = Matern52(H * W * C, lengthscale=torch.tensor(2.0))
    k = ps.ConvKernel(base, (H, W, C), (H, W), weighted=False)
    assert k.num_patches == 1
    X, Z = torch.randn(4, H * W * C), torch.randn(3, H * W * C)
    torch.testing.assert_close(k(X), base(X))
    torch.testing.assert_close(k(X, diag=True), base(X, diag=True))
    torch.testing.assert_close(Kuf(ps.InducingPatches(Z), k, X), base(Z, X))


@pytest.mark.float64
@pytest.mark.parametrize("kind", ["conv", "tick"])
def test_chunked_sums_equal_unchunked_with_gradients(kind):
    X, Z, T = torch.randn(2, 3, H * W * C), torch.randn(4, 2 * 2 * C), 4 * torch.rand(4, 2)
    outs = []
    for chunk in (2**24, 7):
        k = _kernel(kind, 2, 2, 1, "mean", "patch")
        k.chunk_elements = chunk
        k.weights = torch.linspace(0.5, 1.5, k.num_patches).requires_grad_(True)
        ind = ps.IndexedInducingPatches(Z, T) if kind == "tick" else ps.InducingPatches(Z)
        a, b = Kuf(ind, k, X), Kdiag(k, X)
        assert a.shape == (2, 4, 3) and b.shape == (2, 3)
        (g,) = torch.autograd.grad((a.sin().sum() + b.cos().sum()), k.weights)
        outs.append((a, b, g))
    for x, y in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(x, y)


@pytest.mark.float64
@pytest.mark.parametrize("kind, ard", [("conv", False), ("weighted", True), ("tick", False), ("tick", True)])
def test_rbf_diagonal_fused_gradients_equal_explicit_differences(kind, ard):
    """The fused RBF diagonal (one batched product forward and backward) against the explicit patch differences
    through autograd: values and the gradients to the images, weights, variance, lengthscales and TICK's location
    lengthscale."""
    torch.manual_seed(0)
    ls = torch.tensor([0.5, 0.8, 1.0, 1.2]) if ard else torch.tensor(0.7)
    base = RBF(4, variance=torch.tensor(1.3), lengthscale=ls)
    if kind == "tick":
        k = ps.TICK(base, (5, 5), 2, 1, location_lengthscale=2.0)
    else:
        k = ps.ConvKernel(base, (5, 5), 2, 1, weighted=kind == "weighted")
    if k.weighted:
        with torch.no_grad():
            k.weights = torch.rand(k.num_patches) + 0.5
    X = torch.rand(3, 25, requires_grad=True)
    params = [X, *k.parameters()]
    g = torch.randn(3)
    Xp, w = k.extract(X), k.effective_weights()
    t = k.locations(X.dtype)
    diff = (Xp.unsqueeze(-2) - Xp.unsqueeze(-3)) / base.lengthscale
    E = base.variance * torch.exp(-0.5 * diff.pow(2).sum(-1))
    kt = k.location_factor(t, t)
    ref = (((E if kt is None else E * kt) @ w) * w).sum(-1)
    out = k.Kdiag(X)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((out * g).sum(), params, allow_unused=True),
                    torch.autograd.grad((ref * g).sum(), params, allow_unused=True), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_inducing_dispatch_errors():
    conv = _kernel("conv", 2, 2, 1, "mean", "patch")
    tick = _kernel("tick", 2, 2, 1, "mean", "patch")
    Z = torch.randn(3, conv.patch_dim)
    with pytest.raises(ValueError, match="convolutional kernel"):
        ps.SVGP(RBF(conv.patch_dim), ps.InducingPatches(Z))
    with pytest.raises(ValueError, match="IndexedInducingPatches"):
        ps.SVGP(tick, ps.InducingPatches(Z))
    with pytest.raises(ValueError, match="TICK"):
        ps.SVGP(conv, ps.IndexedInducingPatches(Z, torch.rand(3, 2)))
    with pytest.raises(ValueError, match="features"):
        ps.SVGP(conv, ps.InducingPatches(torch.randn(3, 5)))
    with pytest.raises(ValueError, match="same kind"):
        ps.SOLVEGP(conv, ps.InducingPatches(Z), torch.randn(3, conv.patch_dim))
    gp = ps.SVGP(conv, ps.InducingPatches(Z))
    torch.testing.assert_close(gp.Z, Z)  # gp.Z reads the patches
    with pytest.raises(ValueError, match="X must be"):
        gp.predict(torch.randn(2, conv.patch_dim))


def _conv_svgp(cls, lik, M=6, M2=5, num_outputs=None, whiten=True, seed=1):
    torch.manual_seed(seed)  # the same kernel weights and patches for the same seed
    k = _kernel("conv", 3, 3, 1, "mean", "patch")
    Z = ps.InducingPatches(torch.randn(M, k.patch_dim))
    kw = dict(likelihood=lik, num_outputs=num_outputs, whiten=whiten, integrate_f=True)
    if cls is ps.SOLVEGP:
        return ps.SOLVEGP(k, Z, ps.InducingPatches(torch.randn(M2, k.patch_dim)), **kw)
    return ps.SVGP(k, Z, **kw)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_conv_solvegp_with_prior_qv_equals_conv_svgp(whiten):
    """SOLVE-GP eq. 8 with q(v⊥) = p⊥(v⊥) is the SVGP bound (section 3.3), with inducing patches for both sets."""
    X, y = torch.randn(7, H * W * C), torch.randint(0, 3, (7,)).double()
    sol = _conv_svgp(ps.SOLVEGP, ps.RobustMax(3), num_outputs=3, whiten=whiten)
    with torch.no_grad():
        g = torch.Generator(torch.get_default_device()).manual_seed(3)
        sol.q_u.u_loc.copy_(torch.randn(sol.q_u.u_loc.shape, generator=g))
    svgp = _conv_svgp(ps.SVGP, ps.RobustMax(3), num_outputs=3, whiten=whiten)
    torch.testing.assert_close(svgp.Z, sol.Z)
    with torch.no_grad():
        svgp.q_u.u_loc.copy_(sol.q_u.u_loc)
        svgp.q_u.u_scale_tril.copy_(sol.q_u.u_scale_tril)
    # q(v⊥) starts at the prior: N(0, I) whitened, N(0, Cvv) plain
    a, b = sol.analytic_elbo(X, y, num_data=20), svgp.analytic_elbo(X, y, num_data=20)
    torch.testing.assert_close(a, b)
    with torch.no_grad():
        sol.q_v.u_loc.add_(0.3)
    assert (sol.analytic_elbo(X, y, num_data=20) - b).abs() > 1e-4


@pytest.mark.float64
@pytest.mark.parametrize("cls", [ps.SVGP, ps.SOLVEGP])
def test_trace_elbo_with_many_particles_matches_closed_form(cls):
    X, y = torch.randn(6, H * W * C), torch.randint(0, 3, (6,)).double()
    gp = _conv_svgp(cls, ps.RobustMax(3), num_outputs=3, whiten=False)
    gp.integrate_f = True
    assert_trace_elbo_matches_closed_form(gp, X, y)
    pyro.clear_param_store()
