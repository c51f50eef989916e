"""float32 works: the same model in float32 and float64 gives the same bound and predictions to float32 accuracy,
and trains with finite losses (the whole suite also runs with PYRO_SPARSEGP_DTYPE=float32)."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit


def _build(dtype):
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    X = (torch.rand(200, 2, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(200, generator=g, dtype=torch.float64).to(dtype)
    Z = X[:20].clone()
    gp = ps.SVGP(
        RBF(2, lengthscale=torch.ones(2, dtype=dtype), variance=torch.tensor(1.0, dtype=dtype)),
        Z,
        ps.Gaussian(torch.tensor(0.1, dtype=dtype)),
        integrate_f=True,
    )
    gp.to(dtype)
    return X, y, gp


def test_float32_matches_float64():
    out = {}
    for dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
        X, y, gp = _build(dtype)
        with torch.no_grad():
            gp.q_u.set(torch.linspace(-1, 1, 20, dtype=dtype), 0.5 * torch.eye(20, dtype=dtype))
            # eq. 21 through the module's own fast path: q(f) marginals and the registered analytic KL
            loc, fvar = gp.qf(X)
            kl = torch.distributions.kl_divergence(gp.posterior(), gp.prior())
            loss = (kl - gp.likelihood.expected_log_prob(y, loc, fvar).sum()).item()
            mean, var = gp.predict(X[:10])
        assert mean.dtype == dtype
        out[dtype] = (loss, mean.double(), var.double())
    l32, m32, v32 = out[torch.float32]
    l64, m64, v64 = out[torch.float64]
    assert abs(l32 - l64) < 1e-4 * abs(l64)
    torch.testing.assert_close(m32, m64, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(v32, v64, rtol=1e-3, atol=1e-3)


def test_float32_training_stays_finite():
    torch.set_default_dtype(torch.float32)
    X, y, gp = _build(torch.float32)
    state = fit(gp, X, y, num_steps=150, batch_size=64, lr=0.03, natgrad=0.3, progress=False)
    assert all(torch.isfinite(torch.tensor(state.losses)))
    mean, _ = gp.predict(X)
    assert mean.dtype == torch.float32
    assert (mean - torch.sin(2 * X[:, 0])).pow(2).mean().sqrt() < 0.15


def test_float32_solvegp_with_orthogonal_inputs_equal_to_the_inducing_inputs():
    """SOLVE-GP with ``O = Z`` in float32 (issue 52): ``Cvv = Kvv - Kvu Kuu^-1 Kuv`` is round-off, whose asymmetry is a
    large fraction of its diagonal; the package symmetrises the matrices it builds, so the model runs and, with
    ``v⊥`` carrying no variance, its bound is the SVGP's over ``Z`` (q(v⊥) at its prior start: a zero KL)."""
    torch.set_default_dtype(torch.float32)
    X, y, _ = _build(torch.float32)
    Z = X[:10].clone()
    make = lambda: RBF(2, lengthscale=torch.ones(2), variance=torch.tensor(1.0))  # noqa: E731
    solve = ps.SOLVEGP(make(), Z.clone(), Z.clone(), ps.Gaussian(torch.tensor(0.1)))
    svgp = ps.SVGP(make(), Z.clone(), ps.Gaussian(torch.tensor(0.1)))
    with torch.no_grad():
        for gp in (solve, svgp):
            gp.q_u.set(torch.linspace(-1, 1, 10), 0.5 * torch.eye(10))
        bound_solve, bound_svgp = solve.analytic_elbo(X, y).item(), svgp.analytic_elbo(X, y).item()
    assert abs(bound_solve - bound_svgp) < 1e-3 * abs(bound_svgp)
    state = fit(solve, X, y, num_steps=30, batch_size=64, progress=False)
    assert all(torch.isfinite(torch.tensor(state.losses)))
    mean, var = solve.predict(X[:20])
    assert mean.dtype == torch.float32 and bool(torch.isfinite(mean).all() and (var > 0).all())


def test_a_users_matrix_is_still_checked_for_symmetry_in_float32():
    """The symmetry check stays for matrices a user passes to ``ps.linalg.cholesky``."""
    A = torch.eye(4, dtype=torch.float32)
    A[0, 3] = 0.5
    with pytest.raises(ValueError, match="not symmetric"):
        ps.linalg.cholesky(A)
    L = ps.linalg.cholesky(A, symmetrize=True)  # what the package does with the matrices it builds
    torch.testing.assert_close(L @ L.mT, 0.5 * (A + A.mT), atol=1e-5, rtol=0)
