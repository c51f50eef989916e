"""The Pólya-Gamma distribution: moments, sampler against the `polyagamma` package and against our density (KS),
density against numerical integration and that package's pdf, the closed-form KL against Monte Carlo, and Pyro's
distribution contract."""
import math

import numpy as np
import polyagamma
import pytest
import torch
from scipy import integrate, stats

from pyro_sparsegp.distributions import PolyaGamma

GRID = [(b, c) for b in (1, 2, 5) for c in (0.0, 0.5, 2.0, 10.0, -3.0)]


def _d(b, c):
    return PolyaGamma(torch.tensor(float(b)), torch.tensor(float(c)))


def _grid_pdf(d):
    """Density on a fine grid covering all but a negligible mass (vectorised; for integrals by Simpson's rule)."""
    hi = d.mean.item() + 40 * d.variance.sqrt().item()
    x = np.unique(np.concatenate([np.geomspace(1e-4, 0.05, 4001), np.linspace(0.05, hi, 40001)]))
    return x, d.log_prob(torch.tensor(x)).exp().numpy()


@pytest.mark.parametrize("b,c", GRID, ids=str)
def test_sample_moments_match_closed_forms(b, c):
    d = _d(b, c)
    x = d.sample((100_000,))
    n = x.shape[0]
    se_mean = (x.var() / n).sqrt()
    m4 = (x - x.mean()).pow(4).mean()
    se_var = ((m4 - x.var().pow(2)) / n).sqrt()
    assert abs(x.mean() - d.mean) < 5 * se_mean
    assert abs(x.var() - d.variance) < 5 * se_var


@pytest.mark.parametrize("b,c", [(1, 0.0), (2, 0.5), (5, 10.0), (1, 2.0)], ids=str)
def test_closed_form_moments_match_integrals_of_the_density(b, c):
    d = _d(b, c)
    x, p = _grid_pdf(d)
    mean = integrate.simpson(x * p, x=x)
    second = integrate.simpson(x * x * p, x=x)
    assert abs(mean - d.mean.item()) < 1e-6 * d.mean.item()
    assert abs(second - mean**2 - d.variance.item()) < 1e-5 * d.variance.item()


@pytest.mark.parametrize("b,c", [(1, 0.0), (1, 3.0), (2, -1.0), (5, 0.5)], ids=str)
def test_samples_agree_with_the_polyagamma_package_and_our_density(b, c):
    x = _d(b, c).sample((20_000,)).numpy()
    ref = polyagamma.random_polyagamma(h=b, z=c, size=20_000, random_state=np.random.default_rng(0))
    assert stats.ks_2samp(x, ref).pvalue > 1e-3
    grid, p = _grid_pdf(_d(b, c))
    cdf = integrate.cumulative_trapezoid(p, grid, initial=0.0)
    assert stats.kstest(x, lambda v: np.interp(v, grid, cdf)).pvalue > 1e-3


@pytest.mark.parametrize("b,c", GRID, ids=str)
def test_density_integrates_to_one_and_matches_the_package_pdf(b, c):
    d = _d(b, c)
    x, p = _grid_pdf(d)
    assert abs(integrate.simpson(p, x=x) - 1) < 1e-6
    xs = np.linspace(0.02, 3.0, 40)
    ours = d.log_prob(torch.tensor(xs)).exp().numpy()
    ref = polyagamma.polyagamma_pdf(xs, h=b, z=c)
    big = ref > 1e-8
    np.testing.assert_allclose(ours[big], ref[big], rtol=1e-6)


@pytest.mark.parametrize("cq,cp", [(0.5, 0.0), (3.0, 0.0), (2.0, 1.0), (-4.0, 0.3)], ids=str)
def test_kl_matches_monte_carlo(cq, cp):
    q, p = _d(1, cq), _d(1, cp)
    kl = torch.distributions.kl_divergence(q, p)
    x = q.sample((200_000,))
    vals = q.log_prob(x) - p.log_prob(x)
    assert abs(vals.mean() - kl) < 4 * vals.std() / math.sqrt(len(x)) + 1e-12
    # batch shape: exactly the broadcast shape
    kq = torch.distributions.kl_divergence(PolyaGamma(torch.ones(4, 1), torch.randn(4, 1)),
                                           PolyaGamma(torch.ones(3), torch.zeros(3)))
    assert kq.shape == (4, 3)


@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
def test_distribution_contract(batch_shape):
    d = PolyaGamma(torch.ones(batch_shape), torch.randn(batch_shape), validate_args=True)
    assert d.batch_shape == batch_shape and d.event_shape == ()
    x = d.sample((5,))
    assert x.shape == (5,) + batch_shape and (x > 0).all()
    assert d.log_prob(x).shape == (5,) + batch_shape
    e = d.expand((7,) + batch_shape)
    assert e.batch_shape == (7,) + batch_shape and e.sample().shape == (7,) + batch_shape
    with pytest.raises(ValueError):
        PolyaGamma(-torch.ones(batch_shape), torch.zeros(batch_shape), validate_args=True)
    with pytest.raises(ValueError):
        d.log_prob(-torch.ones(batch_shape))
    with pytest.raises(ValueError, match="integer b"):
        PolyaGamma(torch.full(batch_shape, 1.5), torch.zeros(batch_shape)).sample()


def test_float32_sampling_and_density():
    d = PolyaGamma(torch.ones(1000, dtype=torch.float32), torch.full((1000,), 2.0, dtype=torch.float32))
    x = d.sample()
    assert x.dtype == torch.float32 and torch.isfinite(d.log_prob(x)).all()
    assert abs(x.mean().item() - d.mean[0].item()) < 5 * math.sqrt(d.variance[0].item() / 1000)
