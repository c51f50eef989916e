"""The Pólya-Gamma distribution PG(b, c): closed-form moments (against samples, against integrals of the
`polyagamma` package's density and of ours), the exact sampler (KS against the `polyagamma` package and against our
own CDF), the series density (normalisation, the package's pdf, 100-digit mpmath, the two series against each other,
extreme arguments), the closed-form KL (Monte Carlo, quadrature, shapes) and Pyro's distribution contract."""

import math

import numpy as np
import polyagamma
import pytest
import torch
from scipy import integrate, stats
from torch.distributions import kl_divergence

from pyro_sparsegp.distributions import PolyaGamma
from pyro_sparsegp.distributions.polya_gamma_series import _log_pg0_left, _log_pg0_right

F64 = torch.float64
GRID = [(b, c) for b in (1, 2, 5) for c in (0.0, 0.5, 2.0, 10.0, -3.0)]
N_GRID = 100_000


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tensors here are small (<= 4M elements), where intra-op threads gain little and, on a shared 2-core
    machine, can cost several times the single-thread time; restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _pg(b, c, dtype=F64, **kwargs):
    return PolyaGamma(torch.tensor(float(b), dtype=dtype), torch.tensor(float(c), dtype=dtype), **kwargs)


def _quad(f, d, tail=True, width=20):
    """``int_0^inf f`` (``tail=False``: ``int_0^{mean + width sd} f``) with break points at the bulk of ``d``, to
    1e-11 relative."""
    m, s = d.mean.item(), d.variance.sqrt().item()
    hi = m + width * s
    lo = integrate.quad(f, 0, hi, points=[m / 4, m, m + 3 * s], epsabs=0, epsrel=1e-11, limit=400)[0]
    if not tail:
        return lo
    return lo + integrate.quad(f, hi, np.inf, epsabs=1e-300, limit=200)[0]


def _density(d):
    return lambda x: d.log_prob(torch.tensor(x, dtype=F64)).exp().item()


def _our_cdf(d):
    """CDF of ``d`` by cumulative Simpson integration of our density on a fine grid (vectorised)."""
    m, s = d.mean.item(), d.variance.sqrt().item()
    grid = np.unique(np.concatenate([[0.0], np.geomspace(1e-5, m, 20_001), np.linspace(m, m + 30 * s, 40_001)]))
    p = np.concatenate([[0.0], d.log_prob(torch.tensor(grid[1:], dtype=F64)).exp().cpu().numpy()])
    cdf = integrate.cumulative_simpson(p, x=grid, initial=0.0)
    assert abs(cdf[-1] - 1) < 1e-8
    return lambda v: np.interp(v, grid, cdf, right=1.0)


# ------------------------------------------------------------------------------------------------ moments, sampler


@pytest.fixture(scope="module")
def grid_samples():
    """``N_GRID`` draws of every ``(b, c)`` of ``GRID`` at once (the mixed-``b`` path of the sampler)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(20240611)
    b = torch.tensor([b for b, _ in GRID], dtype=F64)
    c = torch.tensor([c for _, c in GRID], dtype=F64)
    x = PolyaGamma(b, c).sample((N_GRID,))
    torch.random.set_rng_state(gen_state)
    return x


@pytest.mark.parametrize("i", range(len(GRID)), ids=[str(bc) for bc in GRID])
def test_sample_moments_match_closed_forms(grid_samples, i):
    b, c = GRID[i]
    d = _pg(b, c)
    x = grid_samples[:, i]
    assert x.dtype == F64 and bool((x > 0).all())
    n = x.numel()
    mean, var = x.mean(), x.var()
    m4 = (x - mean).pow(4).mean()
    se_mean = (var / n).sqrt()
    se_var = ((m4 - var.pow(2)) / n).sqrt()
    assert abs(mean - d.mean) < 5 * se_mean, (mean.item(), d.mean.item(), se_mean.item())
    assert abs(var - d.variance) < 5 * se_var, (var.item(), d.variance.item(), se_var.item())


@pytest.mark.parametrize("b,c", GRID, ids=str)
def test_closed_form_moments_match_integrals_of_the_reference_density(b, c):
    """Independent of our density: quadrature of the `polyagamma` package's pdf (itself accurate to ~1e-9)."""
    d = _pg(b, c)
    ref = lambda x: polyagamma.polyagamma_pdf(x, h=b, z=c)  # noqa: E731
    m, v = d.mean.item(), d.variance.item()
    assert _quad(lambda x: x * ref(x), d, tail=False) == pytest.approx(m, rel=1e-7)
    assert _quad(lambda x: (x - m) ** 2 * ref(x), d, tail=False) == pytest.approx(v, rel=1e-6)


@pytest.mark.parametrize("b,c", [(1, 0.0), (1, 2.0), (2, -3.0), (5, 0.5), (5, 10.0), (2.5, 1.0)], ids=str)
def test_closed_form_moments_match_integrals_of_our_density(b, c):
    d = _pg(b, c)
    p = _density(d)
    m, v = d.mean.item(), d.variance.item()
    # non-integer b: the density loses digits in the far tail, so stop at mean + 40 sd (mass beyond < 1e-15)
    tail, width = (True, 20) if b == int(b) else (False, 40)
    assert _quad(lambda x: x * p(x), d, tail, width) == pytest.approx(m, rel=1e-9)
    assert _quad(lambda x: (x - m) ** 2 * p(x), d, tail, width) == pytest.approx(v, rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_moments_are_stable_near_zero_and_for_large_c(dtype):
    b = torch.tensor(3.0, dtype=dtype)
    c = torch.tensor([0.0, 1e-30, 1e-8, -1e-5, 1e-3], dtype=dtype)
    d = PolyaGamma(b.expand(5), c)
    tol = 10 * torch.finfo(dtype).eps
    c2 = c * c  # Taylor series, the omitted terms are below 1e-18 relative here
    assert torch.allclose(d.mean, b / 4 * (1 - c2 / 12 + c2 * c2 / 120), rtol=tol, atol=0)
    assert torch.allclose(d.variance, b / 24 * (1 - c2 / 5 + 17 * c2 * c2 / 560), rtol=tol, atol=0)
    # continuity across the switches between the series and the closed forms (|c/2| = 1e-4 and |c| = 1)
    for c0 in (2e-4, 1.0):
        cc = torch.tensor([c0 * (1 - 1e-6), c0, c0 * (1 + 1e-6)], dtype=F64)
        dd = PolyaGamma(torch.ones(3, dtype=F64), cc)
        assert torch.allclose(dd.mean, dd.mean[1], rtol=1e-6) and torch.allclose(dd.variance, dd.variance[1], rtol=1e-6)
    big = torch.tensor([50.0, 1e3, -1e5, 1e30], dtype=dtype)
    d = PolyaGamma(b.expand(4), big)
    a = big.abs()
    assert torch.allclose(d.mean, b / (2 * a), rtol=tol)  # tanh(c/2) = 1
    assert torch.allclose(d.variance, b * (1 - 2 * a * torch.exp(-a)) / (2 * a.pow(3)), rtol=tol)
    # gradients are finite everywhere, zero at c = 0 (both moments are even in c)
    cg = torch.tensor([0.0, 1e-6, 1.0, 700.0], dtype=dtype, requires_grad=True)
    dg = PolyaGamma(torch.ones(4, dtype=dtype), cg)
    (dg.mean + dg.variance).sum().backward()
    assert torch.isfinite(cg.grad).all() and (cg.grad[1:] < 0).all()
    assert cg.grad[0].abs() <= 1e3 * torch.finfo(dtype).eps * cg.grad.abs().max()  # zero in exact arithmetic


@pytest.mark.parametrize("b,c", [(1, 0.0), (1, 3.0), (2, -1.0), (5, 0.5)], ids=str)
def test_samples_agree_with_the_polyagamma_package(b, c):
    x = _pg(b, c).sample((20_000,)).cpu().numpy()
    ref = polyagamma.random_polyagamma(h=b, z=c, size=20_000, random_state=np.random.default_rng(12345))
    assert stats.ks_2samp(x, ref).pvalue > 1e-3


@pytest.mark.parametrize("b,c", [(1, 0.0), (1, 1.5625), (1, 5.0), (1, 40.0), (2, -1.0), (3, 2.0)], ids=str)
def test_samples_agree_with_our_cdf(b, c):
    """One-sample KS against the CDF of our density; c = 1.5625 is the switch 1/z = t of the proposal."""
    d = _pg(b, c)
    x = d.sample((50_000,)).cpu().numpy()
    assert stats.kstest(x, _our_cdf(d)).pvalue > 1e-3


def test_float32_samples_agree_with_our_cdf():
    d64 = _pg(1, 2.0)
    x = _pg(1, 2.0, dtype=torch.float32).sample((50_000,))
    assert x.dtype == torch.float32
    assert stats.kstest(x.double().cpu().numpy(), _our_cdf(d64)).pvalue > 1e-3


def test_sampler_with_mixed_b_in_one_batch():
    b = torch.tensor([[1.0, 4.0], [7.0, 2.0]], dtype=F64)
    c = torch.tensor([0.3, -2.0], dtype=F64)
    d = PolyaGamma(b, c)
    x = d.sample((40_000,))
    assert x.shape == (40_000, 2, 2)
    se = (d.variance / x.shape[0]).sqrt()
    assert ((x.mean(0) - d.mean).abs() < 5 * se).all()


# -------------------------------------------------------------------------------------------------------- density


@pytest.mark.parametrize("b,c", GRID + [(0.7, 1.0), (2.5, -4.0)], ids=str)
def test_density_integrates_to_one(b, c):
    d = _pg(b, c)
    tail, width = (True, 20) if b == int(b) else (False, 40)  # as in the test above
    assert _quad(_density(d), d, tail, width) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("b,c", GRID, ids=str)
def test_density_matches_the_polyagamma_package_pdf(b, c):
    d = _pg(b, c)
    xs = np.linspace(0.02, 3.0, 60)
    ours = d.log_prob(torch.tensor(xs, dtype=F64)).exp().cpu().numpy()
    ref = polyagamma.polyagamma_pdf(xs, h=b, z=c)
    shown = ref > 1e-8 * ref.max()
    assert shown.sum() >= 5
    np.testing.assert_allclose(ours[shown], ref[shown], rtol=1e-6)


@pytest.mark.parametrize("b", [1, 2, 5, 20, 0.5, 2.5], ids=str)
def test_density_matches_high_precision_series(b):
    """Against the left series summed with 100-digit mpmath (exact to rounding), over the bulk and into the far
    tails, where the `polyagamma` package's pdf and a float64 left series both lose all digits (integer b uses
    the right series there)."""
    import mpmath as mp  # a test dependency (pyproject "test" extra): its absence must fail, not skip
    mp.mp.dps = 100
    m, s = b / 4, math.sqrt(b / 24)
    far = 12 if b == int(b) else 4  # non-integer b: only the left series, accurate up to ~ mean + 6 sd
    xs = [0.003, 0.3 * m, m, m + 2 * s, m + 6 * s, m + far * s + 1]

    def ref_log(x):
        x, bb = mp.mpf(x), mp.mpf(b)
        n_max = int(math.sqrt(8 * float(x) * 1500) / 2) + int(b) + 20
        total = mp.fsum(
            (-1) ** n * mp.exp(mp.loggamma(n + bb) - mp.loggamma(n + 1) - (2 * n + bb) ** 2 / (8 * x)) * (2 * n + bb)
            for n in range(n_max)
        )
        return mp.log(2 ** (bb - 1) / mp.gamma(bb) / mp.sqrt(2 * mp.pi * x**3) * total)

    got = _pg(b, 0.0).log_prob(torch.tensor(xs, dtype=F64))
    for x, g in zip(xs, got.tolist(), strict=True):
        r = float(ref_log(x))
        assert abs(math.expm1(g - r)) < 1e-11 * max(1.0, abs(r)), (x, g, r)


@pytest.mark.parametrize("b", [1, 2, 5], ids=str)
def test_left_and_right_series_agree_where_both_are_accurate(b):
    x = torch.linspace(0.25, 2.0, 30, dtype=F64) * b
    left, err_left = _log_pg0_left(x, torch.full_like(x, b))
    right, err_right = _log_pg0_right(x, b)
    both = (err_left < math.log(1e-12)) & (err_right < math.log(1e-12))
    assert both.sum() >= 5
    torch.testing.assert_close(left[both], right[both], rtol=0, atol=1e-11)


@pytest.mark.float64
def test_log_prob_at_extreme_arguments():
    b, c = 2.0, 1.5
    d = _pg(b, c)
    tilt = lambda x: b * math.log(math.cosh(c / 2)) - c * c * x / 2  # noqa: E731
    # tiny x: the n = 0 term, 2^(b-1) b / sqrt(2 pi x^3) exp(-b^2 / 8x), is the density to (b+2) exp(-(b+1)/(2x))
    x = torch.tensor([1e-3, 1e-6, 1e-12], dtype=F64)
    lead = [(b - 1) * math.log(2) + math.log(b) - 0.5 * math.log(2 * math.pi * v**3) - b * b / (8 * v) + tilt(v)
            for v in x.tolist()]
    torch.testing.assert_close(d.log_prob(x), torch.tensor(lead, dtype=F64), rtol=1e-14, atol=0)
    # large x, b = 1: the right series' first term 2 pi exp(-pi^2 x / 2) (the next is 3 exp(-4 pi^2 x) times smaller)
    d1 = _pg(1, c)
    x = torch.tensor([8.0, 30.0, 300.0], dtype=F64)
    lead = [math.log(2 * math.pi) - math.pi**2 * v / 2 + math.log(math.cosh(c / 2)) - c * c * v / 2 for v in x.tolist()]
    torch.testing.assert_close(d1.log_prob(x), torch.tensor(lead, dtype=F64), rtol=1e-14, atol=0)
    # finite gradients with respect to x, b and c across both series (the series not chosen, e.g. the right one at
    # small x, whose sum cancels to 0, must not leak NaN into the backward pass)
    for bv in (1.0, 2.0, 3.0):
        xg = torch.tensor([1e-4, 1e-3, 0.1, 0.7, 3.0, 20.0], dtype=F64, requires_grad=True)
        bg = torch.tensor(bv, dtype=F64, requires_grad=True)
        cg = torch.tensor(0.8, dtype=F64, requires_grad=True)
        lp = PolyaGamma(bg, cg).log_prob(xg)
        lp.sum().backward()
        assert torch.isfinite(lp).all() and torch.isfinite(xg.grad).all()
        assert torch.isfinite(bg.grad) and torch.isfinite(cg.grad)
    # d/dx log p by finite differences
    with torch.no_grad():
        h = 1e-6 * xg
        fd = (PolyaGamma(3.0, 0.8).log_prob(xg + h) - PolyaGamma(3.0, 0.8).log_prob(xg - h)) / (2 * h)
    torch.testing.assert_close(xg.grad, fd, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("b,cq,cp", [(1, 0.5, 0.0), (1, 3.0, 0.0), (1, 2.0, 1.0), (1, -4.0, 0.3), (3, 1.5, -0.5)],
                         ids=str)
def test_kl_matches_monte_carlo(b, cq, cp):
    q, p = _pg(b, cq), _pg(b, cp)
    kl = kl_divergence(q, p)
    x = q.sample((100_000,))
    vals = q.log_prob(x) - p.log_prob(x)
    se = vals.std() / math.sqrt(x.numel())
    assert abs(vals.mean() - kl) < 4 * se + 1e-12, (vals.mean().item(), kl.item(), se.item())


@pytest.mark.parametrize("b,cq,cp", [(1, 2.0, 0.0), (2, -1.0, 3.0), (5, 4.0, 0.5)], ids=str)
def test_kl_matches_quadrature_of_the_reference_density(b, cq, cp):
    q = _pg(b, cq)
    ref = lambda x, c: polyagamma.polyagamma_pdf(x, h=b, z=c)  # noqa: E731
    kl = _quad(lambda x: ref(x, cq) * (math.log(ref(x, cq)) - math.log(ref(x, cp))) if ref(x, cq) > 0 else 0.0,
               q, tail=False)
    assert kl_divergence(q, _pg(b, cp)).item() == pytest.approx(kl, rel=1e-6)


def test_kl_shapes_and_special_cases():
    q = PolyaGamma(torch.ones(4, 1, dtype=F64), torch.randn(4, 1, dtype=F64))
    p = PolyaGamma(torch.ones(3, dtype=F64), torch.zeros(3, dtype=F64))
    assert kl_divergence(q, p).shape == (4, 3)
    assert kl_divergence(p, q).shape == (4, 3)
    # scalar parameters broadcast against a batch: exactly the broadcast shape
    assert kl_divergence(_pg(2, 1.0).expand((5,)), _pg(2, 0.0)).shape == (5,)
    # KL[q || q] = 0; KL > 0 otherwise; KL[PG(b, c) || PG(b, 0)] grows like b|c|/4 without overflow
    c = torch.tensor([0.0, 0.1, 3.0, -30.0, 1e4], dtype=F64)
    q = PolyaGamma(torch.full_like(c, 2.0), c)
    assert torch.allclose(kl_divergence(q, q), torch.zeros_like(c), atol=1e-12)
    kl0 = kl_divergence(q, PolyaGamma(torch.full_like(c, 2.0), torch.zeros_like(c)))
    assert kl0[0].abs() < 1e-12 and (kl0[1:] > 0).all() and torch.isfinite(kl0).all()
    assert kl0[-1].item() == pytest.approx(2 * 1e4 / 4 - 2 * math.log(2), rel=1e-12)
    with pytest.raises(NotImplementedError):
        kl_divergence(_pg(1, 1.0), _pg(2, 1.0))


# -------------------------------------------------------------------------------------------- distribution contract


@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
def test_distribution_contract(batch_shape):
    b = torch.randint(1, 4, batch_shape).to(F64)
    d = PolyaGamma(b, torch.randn(batch_shape, dtype=F64), validate_args=True)
    assert d.batch_shape == batch_shape and d.event_shape == ()
    assert d.mean.shape == batch_shape and d.variance.shape == batch_shape
    x = d.sample()
    assert x.shape == batch_shape
    x = d.sample((5, 2))
    assert x.shape == (5, 2) + batch_shape and bool((x > 0).all())
    assert d.log_prob(x).shape == (5, 2) + batch_shape and torch.isfinite(d.log_prob(x)).all()
    e = d.expand((7,) + batch_shape)
    assert isinstance(e, PolyaGamma) and e.batch_shape == (7,) + batch_shape and e.num_terms == d.num_terms
    assert e.sample((3,)).shape == (3, 7) + batch_shape and e.log_prob(e.sample()).shape == (7,) + batch_shape
    assert e._validate_args
    assert PolyaGamma(1.0, torch.zeros(batch_shape, dtype=F64)).batch_shape == batch_shape  # broadcasting
    with pytest.raises(ValueError):
        PolyaGamma(-torch.ones(batch_shape, dtype=F64), torch.zeros(batch_shape, dtype=F64), validate_args=True)
    with pytest.raises(ValueError):
        PolyaGamma(torch.zeros(batch_shape, dtype=F64), torch.zeros(batch_shape, dtype=F64), validate_args=True)
    with pytest.raises(ValueError):
        d.log_prob(-torch.ones(batch_shape, dtype=F64))
    with pytest.raises(ValueError):
        d.log_prob(torch.zeros(batch_shape, dtype=F64))
    with pytest.raises(ValueError, match="integer b"):
        PolyaGamma(torch.full(batch_shape, 1.5, dtype=F64), torch.zeros(batch_shape, dtype=F64)).sample()


def test_float32():
    d = PolyaGamma(torch.ones(2000, dtype=torch.float32), torch.full((2000,), 2.0, dtype=torch.float32))
    assert d.mean.dtype == d.variance.dtype == torch.float32
    x = d.sample()
    assert x.dtype == torch.float32 and bool((x > 0).all())
    lp = d.log_prob(x)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    torch.testing.assert_close(lp, _pg(1, 2.0).log_prob(x.double()).float())
    assert abs(x.double().mean().item() - d.mean[0].item()) < 5 * math.sqrt(d.variance[0].item() / 2000)
    p = PolyaGamma(torch.ones(2000, dtype=torch.float32), torch.zeros(2000, dtype=torch.float32))
    assert kl_divergence(d, p).dtype == torch.float32


def test_rsample_is_a_draw_with_the_gradient_of_the_mean():
    c = torch.tensor([0.5, 2.0], dtype=F64, requires_grad=True)
    d = PolyaGamma(torch.ones(2, dtype=F64), c)
    assert d.has_rsample
    x = d.rsample((1000,))
    assert x.shape == (1000, 2) and bool((x > 0).all())
    x.sum().backward()
    grad = c.grad.clone()
    c.grad = None
    (1000 * d.mean).sum().backward()
    torch.testing.assert_close(grad, c.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda():
    d = PolyaGamma(torch.tensor([1.0, 3.0], device="cuda"), torch.tensor([0.0, 2.0], device="cuda"))
    x = d.sample((20_000,))
    assert x.device.type == "cuda" and x.dtype == torch.get_default_dtype()
    lp = d.log_prob(x)
    assert lp.device.type == "cuda" and torch.isfinite(lp).all()
    se = (d.variance / x.shape[0]).sqrt()
    assert ((x.double().mean(0) - d.mean.double()).abs() < 5 * se).all()
    assert kl_divergence(d, PolyaGamma(d.b, torch.zeros_like(d.c))).device.type == "cuda"
