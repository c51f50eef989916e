"""ps.GPLVM's argument checks, defaults and new-row inference against hand computations: the start of infer_latent
(the best candidate among Z, the origin and training means spread over the whole set, dense scores by hand) and
reconstruct's moments (Gauss-Hermite quadrature of dense q(f | x) plus the noise). Tiny sizes, ~1 CPU-second."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.layers.gplvm import mlp_encoder


def _dense_qf(g, x):
    """q(f | x) marginals [D, n] by explicit inverses (whitened q(u): m = L m~, S = L S~ L^T), in float64."""
    k = g.kernel
    Z, dt = g.gp.Z.detach().double(), g.gp.Z.dtype
    with torch.no_grad():
        Kuu = k(g.gp.Z).detach().double()
        Kuf = k(g.gp.Z, x.to(dt)).detach().double()
        kff = k(x.to(dt), diag=True).detach().double()
    Kuu = Kuu + 1e-10 * Kuu.diagonal().mean() * torch.eye(len(Z), dtype=torch.float64)
    Luu = torch.linalg.cholesky(Kuu)
    m, L = g.gp.q_u.u_loc.detach().double(), g.gp.q_u.u_scale_tril.detach().double()
    out = [B.qf_dense(Kuu, Kuf, kff, Luu @ m[d], Luu @ L[d]) for d in range(g.Y_dim)]
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


@pytest.mark.parametrize("bad", [True, 2.0, 0])
def test_counts_must_be_positive_integers(bad):
    """Y_dim = True (a bool), 2.0 (a float) or 0 is refused with the argument's name."""
    with pytest.raises(ValueError, match="Y_dim must be a positive integer"):
        ps.GPLVM(bad, 2, num_inducing=3, num_data=4)


def test_defaults_and_input_checks():
    """The default q(x_n) sd is 0.1 (the signature's x_scale); the default encoder's scales start near 0.1 (its
    ``scale``); X of shape [N, 2] is refused (row indices); a row of y with nothing observed is refused; float row
    indices are rounded to the nearest row (0.99 is row 1), so the bound equals the integer rows' bound."""
    g = ps.GPLVM(3, 2, num_inducing=3, num_data=5, likelihood=ps.Gaussian(0.3))
    assert torch.allclose(g.x_scale.detach(), torch.full((5, 2), 0.1))
    e = ps.GPLVM(3, 2, num_inducing=3, encoder=mlp_encoder(3, 2, hidden=(8,)))
    with torch.no_grad():
        _, scale = e.q_x(None, torch.randn(20, 3))
    assert bool(((scale > 0.05) & (scale < 0.2)).all()), scale
    Y = torch.randn(5, 3)
    with pytest.raises(ValueError, match="rows' indices"):
        g.analytic_elbo(torch.zeros(5, 2, dtype=torch.long), Y)
    Yn = Y.clone()
    Yn[2] = float("nan")
    with pytest.raises(ValueError, match="no observed output"):
        g.analytic_elbo(g.rows(), Yn)
    with torch.no_grad():
        torch.manual_seed(1)
        ref = g.analytic_elbo(g.rows(), Y)
        torch.manual_seed(1)
        got = g.analytic_elbo(g.rows().to(Y.dtype) - 0.01, Y)
    assert torch.equal(ref, got)


def test_infer_latent_starts_at_the_best_candidate_over_the_whole_training_set():
    """steps=0 returns the start: per row, the candidate (Z, the origin, training means spread over all N = 512 rows)
    with the highest sum over observed outputs of E log N(y | f, noise) minus |x|^2 / 2 (dense, by hand). The first
    256 training means sit far away, so the good ones are only in the later rows."""
    torch.manual_seed(0)
    N, D, Q, M = 512, 3, 2, 4
    X_init = torch.randn(N, Q) * 1.5
    X_init[:256] = 6.0
    g = ps.GPLVM(D, Q, num_inducing=M, num_data=N, likelihood=ps.Gaussian(0.3), X_init=X_init,
                 Z=torch.randn(M, Q))
    g.gp.q_u.u_loc = 2.0 * torch.randn(D, M)
    x_true = torch.randn(30, Q) * 1.5
    Y = (_dense_qf(g, x_true)[0].mT + 0.3 * torch.randn(30, D)).to(X_init.dtype)
    Y[0, 1] = float("nan")
    loc, var = g.infer_latent(Y, steps=0)
    C = torch.cat([g.gp.Z.detach(), torch.zeros(1, Q), X_init[256::2]]).double()  # candidates a start may pick
    C_all = torch.cat([C, loc.double()])  # ... and the returned starts
    mu, fv = _dense_qf(g, C_all)  # [D, C]
    y = Y.double().mT.unsqueeze(-1)  # [D, B, 1]
    ell = -0.5 * np.log(2 * np.pi * 0.3) - 0.5 * ((y - mu.unsqueeze(-2)) ** 2 + fv.unsqueeze(-2)) / 0.3
    ell = torch.where(torch.isnan(y), torch.zeros(()), ell)
    score = ell.sum(0) - 0.5 * C_all.pow(2).sum(-1)  # [B, C + B]
    best = score[:, : len(C)].max(-1).values
    chosen = score[:, len(C):].diagonal()
    assert torch.allclose(chosen, best, atol=1e-2), (chosen - best)
    assert torch.allclose(var, torch.full_like(var, 0.01))


def test_reconstruct_moments_match_quadrature():
    """reconstruct with a given q(x*) = N(m, v) (Q = 1): E[y*] = E_x[mu_f(x)] and Var[y*] = E_x[var_f + mu_f^2] -
    E[y*]^2 + noise, by 60-point Gauss-Hermite quadrature of the dense q(f | x); Monte Carlo SE tolerance."""
    torch.manual_seed(0)
    D, M, S = 2, 3, 20000
    g = ps.GPLVM(D, 1, num_inducing=M, num_data=4, likelihood=ps.Gaussian(0.5), Z=torch.tensor([[-1.0], [0.0], [1.5]]))
    g.gp.q_u.u_loc = torch.tensor([[1.5, -1.0, 2.0], [0.5, 2.0, -1.5]])
    m = torch.tensor([[-0.5], [0.3], [1.0]])
    v = torch.tensor([[0.4], [0.8], [0.2]])
    mean, var = g.reconstruct(torch.zeros(3, D), latent=(m, v), num_samples=S)
    assert mean.shape == var.shape == (3, D)
    t, w = np.polynomial.hermite_e.hermegauss(60)
    t, w = torch.tensor(t), torch.tensor(w / w.sum())
    x = (m.double() + v.double().sqrt() * t).reshape(-1, 1)  # [3 * 60, 1]
    mu, fv = _dense_qf(g, x)
    mu, fv = mu.reshape(D, 3, 60), fv.reshape(D, 3, 60)
    Emu = (mu * w).sum(-1).mT  # [3, D]
    Evar = ((fv + mu**2) * w).sum(-1).mT - Emu**2
    se = (Evar / S).sqrt()
    assert bool(((mean.double() - Emu).abs() < 5 * se + 1e-4).all()), (mean, Emu)
    assert torch.allclose(var.double(), Evar + 0.5, rtol=0.05), (var, Evar + 0.5)


def test_infer_latent_refuses_a_hyperprior_before_any_call():
    """A PyroSample lengthscale on a GPLVM never run in a Pyro program: infer_latent raises the ValueError that names
    the hyperprior (not an internal error about site names)."""
    k = pyro.contrib.gp.kernels.RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
    g = ps.GPLVM(3, 2, num_inducing=3, num_data=5, kernel=k)
    with pytest.raises(ValueError, match="hyperprior"):
        g.infer_latent(torch.randn(2, 3), steps=1)


# Surviving mutants judged equivalent (no program can tell them from the original):
# - gplvm.py:177 rows(): unsqueeze(-1) -> unsqueeze(1) on the 1-D arange gives the same [N, 1] tensor.
# - gplvm_inference.py:70 pca_init: svd(full_matrices=True) has the same S and the same first min(N, D) columns of U
#   (checked: equal to 1e-16, same signs); only U's unused extra columns (memory) differ.
# - gplvm_inference.py:103 _chunk: max(1, ...) -> max(2, ...) only matters when a single row exceeds 2^23 elements;
#   rows are independent and Adam is element-wise, so only memory and which random draws go to which row change
#   (same distribution).
# - gplvm_inference.py:123 _start: score.argmax(-1) -> argmax(1) on the 2-D [B, C] score is the same axis.
