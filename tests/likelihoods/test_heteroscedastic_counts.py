"""HeteroscedasticNegativeBinomial: its distribution against scipy's negative binomial at the NB1 / NB2 moments,
its expected log-likelihood against an 80-node-per-latent product rule of scipy's mass function (the docstring's
measured errors), its predictive against Monte Carlo draws of f and y, bad input, and a fit that finds a dispersion
that grows with x where a constant-dispersion negative binomial cannot."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample
from scipy.stats import nbinom

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import Constant


def _scipy_nb(mu, alpha, variance):
    """scipy's (n, p) of the NB of mean mu: NB1 variance mu (1 + alpha), NB2 variance mu + alpha mu^2."""
    if variance == "NB1":
        return mu / alpha, 1 / (1 + alpha) + 0 * mu
    return 1 / alpha + 0 * mu, 1 / (1 + alpha * mu)


@pytest.mark.parametrize("variance", ["NB1", "NB2"])
def test_distribution_is_the_negative_binomial_of_its_moments(variance):
    g, h = torch.tensor([[-0.5, 0.3, 2.0, 2.5]]), torch.tensor([[-1.5, 0.0, 0.7, -0.3]])
    f = torch.stack([g[0], h[0]])  # [2, B]
    d = ps.HeteroscedasticNegativeBinomial(variance).distribution(f)
    mu, alpha = g[0].exp().double().numpy(), h[0].exp().double().numpy()
    n, p = _scipy_nb(mu, alpha, variance)
    y = torch.arange(0, 30).unsqueeze(-1).unsqueeze(-1).to(f.dtype)  # [30, 1, 1] against the site's [1, B]
    ours = d.log_prob(y)[:, 0, :].double().numpy()  # [30, B]
    theirs = nbinom.logpmf(np.arange(30)[:, None], n, p)
    np.testing.assert_allclose(ours, theirs, atol=1e-4 if f.dtype == torch.float32 else 1e-10)
    var = mu * (1 + alpha) if variance == "NB1" else mu + alpha * mu**2
    np.testing.assert_allclose(nbinom.var(n, p), var, rtol=1e-10)  # the docstring's variance is the one built


def _reference(y, m, v, variance, n=80):
    """E_q log p(y | g, h) by an n-node-per-latent product Gauss-Hermite rule over scipy's logpmf; ``[B]``."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    out = []
    for yi, (mg, mh), (vg, vh) in zip(y, m.T, v.T, strict=True):
        mu = np.exp(mg + np.sqrt(vg) * x)[:, None]
        alpha = np.exp(mh + np.sqrt(vh) * x)[None, :]
        out.append((w[:, None] * w[None, :] * nbinom.logpmf(yi, *_scipy_nb(mu, alpha, variance))).sum())
    return np.array(out)


@pytest.mark.float64
@pytest.mark.parametrize("variance", ["NB1", "NB2"])
@pytest.mark.parametrize("sd, tol", [(0.5, 1e-9), (1.0, 1e-5)])
def test_expected_log_prob_within_the_documented_error(variance, sd, tol):
    rng = np.random.default_rng(1)
    B = 100
    m = np.stack([rng.uniform(-1, 3, B), rng.uniform(-2, 1, B)])
    y = rng.integers(0, 41, B)
    lik = ps.HeteroscedasticNegativeBinomial(variance)
    ours = lik.expected_log_prob(torch.tensor(y, dtype=torch.float64), torch.tensor(m), torch.full((2, B), sd**2))
    assert ours.shape == (1, B)
    assert np.abs(ours[0].numpy() - _reference(y, m, np.full((2, B), sd**2), variance)).max() < tol


def test_predictive_matches_monte_carlo():
    torch.manual_seed(0)
    m = torch.tensor([[0.5, 1.5, 2.0], [-1.0, 0.0, 0.5]])
    v = torch.tensor([[0.2, 0.1, 0.3], [0.3, 0.2, 0.1]])
    pred = ps.HeteroscedasticNegativeBinomial("NB1").predictive(m, v)
    assert pred.batch_shape == (3,)
    S = 100_000  # f ~ q, then y | f by the Gamma-Poisson mixture (not the likelihood's own distribution)
    f = m + v.sqrt() * torch.randn(S, 2, 3)
    y = torch.poisson(torch.distributions.Gamma((f[:, 0] - f[:, 1]).exp(), (-f[:, 1]).exp()).sample())  # [S, 3]
    for k in (0, 1, 3, 8):
        freq = (y == k).to(m.dtype).mean(0)
        se = (freq * (1 - freq) / S).sqrt().clamp_min(1e-4)
        assert ((pred.log_prob(torch.full((3,), float(k))).exp() - freq).abs() < 5 * se).all()
    assert torch.allclose(pred.mean, y.mean(0), rtol=0.03)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="variance must be 'NB2'"):
        ps.HeteroscedasticNegativeBinomial("NB3")
    X = torch.linspace(0, 1, 20).unsqueeze(-1)
    gp = ps.SVGP(RBF(1), X[::4].clone(), ps.HeteroscedasticNegativeBinomial())
    assert gp.num_outputs == 2
    with pytest.raises(ValueError, match="non-negative integers"):
        ps.infer.fit(gp, X, torch.full((20,), -1.0), num_steps=1, progress=False)
    with pytest.raises(ValueError, match="non-negative integers"):
        ps.infer.fit(gp, X, torch.full((20,), 0.5), num_steps=1, progress=False)


def test_fit_finds_a_dispersion_that_grows_with_x():
    """Counts of constant mean 8 whose NB1 dispersion rises from e^-2 to e^1.5 along x: the two-latent model learns
    a log-dispersion latent that rises, and predicts held-out counts better than one constant dispersion."""
    torch.manual_seed(0)
    X = torch.rand(600, 1) * 2 - 1
    h = 1.75 * X[:, 0] - 0.25
    f = torch.stack([torch.full((600,), 8.0).log(), h])
    y = torch.poisson(torch.distributions.Gamma((f[0] - f[1]).exp(), (-f[1]).exp()).sample())
    tr, te = slice(0, 400), slice(400, 600)
    het = ps.SVGP(RBF(1), X[:400:40].clone(), ps.HeteroscedasticNegativeBinomial("NB1"),
                  mean_function=Constant(2, torch.tensor([2.0, 0.0])))
    hom = ps.SVGP(RBF(1), X[:400:40].clone(), ps.NegativeBinomial(variance="NB1"),
                  mean_function=Constant(1, 2.0))
    nlpd = {}
    for name, gp in (("het", het), ("hom", hom)):
        ps.infer.fit(gp, X[tr], y[tr], num_steps=200, progress=False)
        with torch.no_grad():
            mean, var, pred = gp.predict(X[te], full=True)
            nlpd[name] = -pred.log_prob(y[te]).mean().item()
    with torch.no_grad():
        mean, _ = het.predict(torch.tensor([[-0.8], [0.8]]))
    assert mean[1, 1] - mean[0, 1] > 1.0  # truth: 2.8 (measured 1.6-2.2); a constant dispersion: 0
    assert nlpd["het"] < nlpd["hom"] - 0.02


def test_a_users_program_with_a_hyperprior_autoguide_and_particles_trains_everything():
    """The program a Pyro user writes around the layer: a ``PyroSample`` lengthscale fitted by an ``AutoNormal``
    beside the layer's guide, vectorised particles, minibatches, plain ``SVI``. ``check_model`` finds no site counted
    twice (the two latents' ``[P, 2, B]`` against the site's ``[P, 1, B]``), and every parameter trains, the two
    latents' prior means included."""
    torch.manual_seed(0)
    X = torch.linspace(-1, 1, 120).unsqueeze(-1)
    f = torch.stack([1.5 + 0.5 * torch.sin(3 * X[:, 0]), X[:, 0] - 0.5])
    y = torch.poisson(torch.distributions.Gamma((f[0] - f[1]).exp(), (-f[1]).exp()).sample())
    kernel = RBF(1)
    kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 0.5))
    gp = ps.SVGP(kernel, X[::12].clone(), ps.HeteroscedasticNegativeBinomial("NB1"),
                 mean_function=Constant(2, torch.tensor([1.0, 0.0])), name="hnb")
    guide = AutoGuideList(gp.model, create_plates=gp.create_plates)
    guide.append(AutoNormal(poutine.block(gp.model, expose=["hnb.kernel.lengthscale"])))
    guide.append(gp.guide)
    elbo = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    ps.check_model(gp.model, guide, X, y, elbo=elbo, subsample_size=40)
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.03}), elbo)
    svi.step(X, y, subsample_size=40)
    params = {**dict(guide.named_parameters()), **{k: v for k, v in gp.named_parameters()
                                                     if not k.endswith("_map_unconstrained")}}
    before = {k: v.detach().clone() for k, v in params.items()}
    assert any("lengthscale" in k for k in before) and any("mean_function" in k for k in before), sorted(before)
    losses = [svi.step(X, y, subsample_size=40) for _ in range(100)]
    for k, v in params.items():
        assert not torch.equal(v.detach(), before[k]), f"{k} never trained"
    assert sum(losses[-20:]) < sum(losses[:20])
