"""Properties of the linear mixing of the LMC (``pyro_sparsegp.variational.lmc``; Álvarez, Rosasco, Lawrence 2012,
section 4.2), checked on the mixing alone: for independent latents ``g_q ~ N(m_q, v_q)`` the outputs ``f = W g`` have
mean ``W m``, variance ``W^2 v`` and, at one point, covariance ``W diag(v) W^T`` (Monte Carlo, a few standard
errors), batched over leading dimensions; the independent strategy's covariance is diagonal; the inputs' layout
(a 2-D ``X`` gets the latents' singleton, a 3-D ``X`` must have 1 at dim -3)."""

import types

import pytest
import torch

from pyro_sparsegp.variational.lmc import LinearMixing
from pyro_sparsegp.variational.strategy import Strategy


class _Base:
    def __init__(self, layer):
        self.layer = layer

    def align(self, X):
        return X.unsqueeze(-3) if X.dim() == 2 else X


class _Mixed(LinearMixing, _Base):
    pass


def _mixing(L=3, Q=2):
    torch.manual_seed(0)
    return _Mixed(types.SimpleNamespace(W=torch.randn(L, Q)))


def test_mixed_marginals_and_covariance_by_monte_carlo():
    s = _mixing()
    m, v = torch.randn(2, 2, 4), torch.rand(2, 2, 4) + 0.2  # [batch, Q, B]
    loc, var = s.mix(m, v)
    cov = s.mix_cov(v)
    assert loc.shape == (2, 3, 4) and var.shape == (2, 3, 4) and cov.shape == (2, 4, 3, 3)
    n = 100_000
    g = m + v.sqrt() * torch.randn((n,) + m.shape)  # [n, batch, Q, B]
    f = s.mix_sample(g)  # [n, batch, L, B]
    assert f.shape == (n, 2, 3, 4)
    se_mean = (var / n).sqrt()
    assert bool(((f.mean(0) - loc).abs() < 5 * se_mean + 1e-6).all())
    emp_var = f.var(0)
    assert bool(((emp_var - var).abs() < 5 * var * (2.0 / n) ** 0.5 + 1e-6).all())
    fc = f - f.mean(0)
    emp_cov = torch.einsum("nbli,nbki->bilk", fc, fc) / (n - 1)  # [batch, B, L, L]
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    se_cov = (sd.unsqueeze(-1) * sd.unsqueeze(-2)) * (2.0 / n) ** 0.5
    assert bool(((emp_cov - cov).abs() < 5 * se_cov + 1e-6).all())
    torch.testing.assert_close(cov.diagonal(dim1=-2, dim2=-1), var.movedim(-2, -1))
    torch.testing.assert_close(cov, cov.mT)


def test_independent_outputs_have_a_diagonal_covariance():
    s = Strategy.__new__(Strategy)
    v = torch.rand(2, 3, 5)  # [batch, L, B]
    cov = s.mix_cov(v)
    assert cov.shape == (2, 5, 3, 3)
    for b in range(5):
        torch.testing.assert_close(cov[:, b], torch.diag_embed(v[:, :, b]))
    loc = torch.randn(3, 5)
    assert s.mix(loc, v[0])[0] is loc and s.mix_sample(loc) is loc


def test_lmc_inputs_layout():
    s = _mixing()
    X = torch.randn(5, 2)
    assert s.align(X).shape == (1, 5, 2)
    assert s.align(torch.randn(4, 1, 5, 2)).shape == (4, 1, 5, 2)
    assert s.align(torch.randn(1, 5, 2)).shape == (1, 5, 2)
    with pytest.raises(ValueError, match="share their inputs"):
        s.align(torch.randn(2, 5, 2))
