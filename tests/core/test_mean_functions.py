"""Mean functions: values, PCA / zero-padding projections against independent computations, and their place in a
layer's p(f | u) and q(f) (added per output, on sample-batched inputs too), trained through the layer."""

import numpy as np
import pytest
import torch
from gradient_checks import assert_gradients, parameter_gradients
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import Constant, FixedProjection, Identity, Linear, Zero


def test_values_and_shapes():
    X = torch.randn(3, 7, 4)
    assert torch.equal(Zero(2)(X), torch.zeros(3, 7, 2))
    c = Constant(2, value=1.5)
    assert torch.equal(c(X), torch.full((3, 7, 2), 1.5))
    A, b = torch.randn(4, 2), torch.randn(2)
    torch.testing.assert_close(Linear(4, 2, A, b)(X), torch.einsum("snd,dk->snk", X, A) + b)
    assert torch.equal(Identity()(X), X)
    with pytest.raises(ValueError, match="needs A"):
        Linear(4, 2, torch.randn(2, 4))


def test_pca_projection_spans_the_leading_eigenvectors():
    X = torch.randn(200, 5) @ torch.randn(5, 5)
    P = FixedProjection.from_pca(X, 3)
    assert P.W.shape == (5, 3) and not list(P.parameters())  # a buffer, never trained
    torch.testing.assert_close(P.W.mT @ P.W, torch.eye(3))
    evals, evecs = np.linalg.eigh((X.mT @ X).cpu().numpy())  # independent: eigenvectors of X^T X (uncentred)
    top = torch.as_tensor(evecs[:, ::-1][:, :3].copy())
    torch.testing.assert_close((top.mT @ P.W).abs(), torch.eye(3), atol=1e-5, rtol=0)  # equal up to sign
    with pytest.raises(ValueError, match="zero_padding"):
        FixedProjection.from_pca(X, 6)


def test_zero_padding_and_between():
    X = torch.randn(10, 3)
    Pz = FixedProjection.zero_padding(3, 5)
    torch.testing.assert_close(Pz(X), torch.cat([X, torch.zeros(10, 2)], -1))
    assert isinstance(FixedProjection.between(X, 3), Identity)
    assert FixedProjection.between(X, 2).W.shape == (3, 2)
    assert torch.equal(FixedProjection.between(X, 4).W, torch.eye(3, 4))
    with pytest.raises(ValueError, match="from_pca"):
        FixedProjection.zero_padding(3, 2)


def _layer(cls, L, mean, whiten, D=3, M=4):
    Z = torch.randn(M, D)
    if cls is ps.SOLVEGP:
        return ps.SOLVEGP(RBF(D), Z, torch.randn(3, D), num_outputs=L, whiten=whiten, mean_function=mean)
    return ps.SVGP(RBF(D), Z, num_outputs=L, whiten=whiten, mean_function=mean)


@pytest.mark.parametrize("cls", [ps.SVGP, ps.SOLVEGP], ids=["svgp", "solvegp"])
@pytest.mark.parametrize("whiten", [True, False], ids=["whitened", "plain"])
def test_mean_is_added_per_output(cls, whiten):
    L, D = 2, 3
    mean = Linear(D, L, torch.randn(D, L), torch.randn(L))
    gp = _layer(cls, L, mean, whiten)
    with torch.no_grad():
        gp.q_u.u_loc = torch.randn(L, 4)
    X = torch.randn(6, D)
    loc, var = gp.qf(X)
    gp.mean_function = None
    loc0, var0 = gp.qf(X)
    gp.mean_function = mean
    m = X @ mean.A + mean.b  # [B, L]
    torch.testing.assert_close(loc, loc0 + m.mT)
    torch.testing.assert_close(var, var0)
    # sample-batched inputs [S, 1, B, D] (a hidden layer's samples) and per-output inputs [L, B, D]
    Xs = torch.randn(5, 1, 6, D)
    loc_s, _ = gp.qf(Xs)
    for s in range(5):
        torch.testing.assert_close(loc_s[s], gp.qf(Xs[s, 0])[0])
    Xl = torch.randn(L, 6, D)
    loc_l, _ = gp.qf(Xl)
    for l_ in range(L):
        torch.testing.assert_close(loc_l[l_], gp.qf(Xl[l_])[0][l_])
    # p(f | u): the same shift
    u = gp.sample_u(guide=True)
    fn = gp.conditional(X, u)
    gp.mean_function = None
    fn0 = gp.conditional(X, u)
    torch.testing.assert_close(fn.loc, fn0.loc + m.mT)


@pytest.mark.float64
def test_unwhitened_mean_against_dense_formula():
    """q(f) mean = m(X) + Kfu Kuu^{-1} m_u: the inducing outputs are deviations from the mean function."""
    D, M = 2, 5
    mean = Constant(1, value=0.7)
    gp = ps.SVGP(RBF(D), torch.randn(M, D), whiten=False, mean_function=mean)
    with torch.no_grad():
        gp.q_u.u_loc = torch.randn(M)
    X = torch.randn(4, D)
    k = gp.kernel
    dense = 0.7 + k(X, gp.Z) @ torch.linalg.solve(k(gp.Z) + 1e-10 * torch.eye(M), gp.q_u.u_loc)
    torch.testing.assert_close(gp.qf(X)[0], dense, rtol=1e-6, atol=1e-6)


def test_mean_parameters_train_and_width_is_checked():
    D = 2
    gp = ps.SVGP(RBF(D), torch.randn(4, D), ps.Gaussian(), mean_function=Linear(D, 1))
    X, y = torch.randn(10, D), torch.randn(10)
    gp.analytic_elbo(X, y).backward()
    # at the initial whitened q(u) = p(u), q(f) = p(f) does not depend on Z or the lengthscale: true gradient zero
    prior = "whitened q(u) = N(0, I) = p(u): q(f) = p(f) whatever Z and the lengthscale"
    zero = {"inducing.Z_unconstrained": prior, "kernel.lengthscale_unconstrained": prior}
    assert_gradients(parameter_gradients(gp), zero)
    assert "mean_function.A_unconstrained" in parameter_gradients(gp)
    with pytest.raises(ValueError, match="mean function has 2 outputs"):
        ps.SVGP(RBF(D), torch.randn(4, D), num_outputs=3, mean_function=Zero(2))


def test_closed_form_natgrad_refuses_a_mean_function():
    from pyro_sparsegp.infer.natgrad import gaussian_natgrad_step

    gp = ps.SVGP(RBF(2), torch.randn(4, 2), ps.Gaussian(), mean_function=Constant(1, 1.0))
    with pytest.raises(ValueError, match="zero mean function"):
        gaussian_natgrad_step(gp, torch.randn(5, 2), torch.randn(5))
