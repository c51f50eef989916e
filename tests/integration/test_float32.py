"""float32 works: the same model in float32 and float64 gives the same bound and predictions to float32 accuracy,
and trains with finite losses (the whole suite also runs with PYRO_SPARSEGP_DTYPE=float32)."""

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
