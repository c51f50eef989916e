"""Properties of the rules and mixtures of likelihoods of several latent functions
(``pyro_sparsegp.likelihoods.multilatent``, ``.generic``, ``.multiclass``): the product Gauss-Hermite rule has the
documented number of nodes per latent and integrates polynomial moments of ``N(0, I)`` exactly, ``"auto"`` turns to
the 4096-point ``"qmc"`` rule beyond six latents, ``"mc"`` draws 256 points by default; the rule's points of
``q(f)`` have its mean and variance (and collapse onto the mean at zero variance); the quadrature mixture's mean,
variance (law of total variance) and log-density against direct sums; the robust-max probabilities and
predictive sum to one with ``epsilon / (K - 1)`` on the wrong classes; bad arguments are named."""

import math

import pyro.distributions as dist
import pytest
import torch
from torch.distributions import constraints

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods.generic import from_distribution
from pyro_sparsegp.likelihoods.multilatent import QuadratureMixture, gaussian_rule


def _normal_q(f):
    return dist.Normal(f[..., 0, :], f[..., 1, :].exp())


@pytest.mark.parametrize("Q, per_latent", [(1, 20), (2, 20), (3, 10), (4, 7), (5, 5), (6, 4)])
def test_gh_rule_sizes_and_exact_moments(Q, per_latent):
    x, w = gaussian_rule(Q)
    assert x.shape == (per_latent ** Q, Q) and w.shape == (per_latent ** Q,)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0, dtype=w.dtype))
    torch.testing.assert_close((w[:, None] * x ** 2).sum(0), torch.ones(Q, dtype=w.dtype))
    torch.testing.assert_close((w * x[:, 0] ** 4).sum(), torch.tensor(3.0, dtype=w.dtype))
    if Q > 1:
        torch.testing.assert_close((w * x[:, 0] ** 2 * x[:, 1] ** 2).sum(), torch.tensor(1.0, dtype=w.dtype))
    lik = from_distribution(_normal_q, latent_dim=2) if Q == 2 else None
    if lik is not None:
        assert lik.num_gh == 20


def test_auto_qmc_and_mc_rules():
    x, w = gaussian_rule(7)
    assert x.shape == (4096, 7)
    torch.testing.assert_close(w, torch.full((4096,), 1 / 4096, dtype=w.dtype))
    x, w = gaussian_rule(2, "mc")
    assert x.shape == (256, 2) and float(w.sum()) == pytest.approx(1.0)
    x, w = gaussian_rule(3, "qmc", num_samples=101)  # an odd request: antithetic pairs, 102 points
    assert x.shape == (102, 3) and float(w.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("rule", ["gh", "qmc", "mc"])
def test_points_have_the_mean_and_variance_of_q(rule):
    lik = from_distribution(_normal_q, latent_dim=2, rule=rule, num_samples=4000 if rule == "mc" else None)
    f_loc, f_var = torch.tensor([[0.5, -1.0], [1.0, 0.2]]), torch.tensor([[0.3, 2.0], [0.1, 0.7]])  # [Q=2, B=2]
    torch.manual_seed(0)
    f, w = lik._points(f_loc, f_var)
    assert f.shape[1:] == (2, 2)
    mean = torch.tensordot(w, f, dims=1)
    var = torch.tensordot(w, (f - f_loc) ** 2, dims=1)
    tol = 0.1 if rule == "mc" else 1e-4
    torch.testing.assert_close(mean, f_loc, rtol=0, atol=tol)
    torch.testing.assert_close(var, f_var, rtol=tol, atol=tol)
    f0, _ = lik._points(f_loc, torch.zeros(2, 2))
    torch.testing.assert_close(f0, f_loc.expand_as(f0), rtol=0, atol=1e-6)
    if rule == "mc":
        assert from_distribution(_normal_q, latent_dim=2, rule="mc")._points(f_loc, f_var)[0].shape[0] == 256


def test_quadrature_mixture_moments_and_density():
    torch.manual_seed(1)
    w = torch.tensor([0.2, 0.5, 0.3])
    loc, scale = torch.randn(3, 4), torch.rand(3, 4) + 0.5  # [n, B]
    mix = QuadratureMixture(dist.Normal(loc, scale), w)
    assert mix.batch_shape == (4,)
    torch.testing.assert_close(mix.mean, (w[:, None] * loc).sum(0))
    second = (w[:, None] * (scale ** 2 + loc ** 2)).sum(0)
    torch.testing.assert_close(mix.variance, second - mix.mean ** 2)
    y = torch.randn(4)
    direct = torch.log((w[:, None] * dist.Normal(loc, scale).log_prob(y).exp()).sum(0))
    torch.testing.assert_close(mix.log_prob(y), direct)
    one = QuadratureMixture(dist.Normal(loc[:, :1], scale[:, :1]), w)  # batch [1], expanded to [4]
    big = one.expand((4,))
    assert big.batch_shape == (4,)
    ref = torch.log((w[:, None] * dist.Normal(loc[:, :1], scale[:, :1]).log_prob(y).exp()).sum(0))
    torch.testing.assert_close(big.log_prob(y), ref)


def test_robust_max_probabilities():
    K, eps = 4, 0.02
    lik = ps.RobustMax(K, epsilon=eps)
    f = torch.randn(K, 5)
    p = lik.probs(f)  # [B, K]
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    top = f.argmax(0)
    for b in range(5):
        for k in range(K):
            assert float(p[b, k]) == pytest.approx(1 - eps if k == top[b] else eps / (K - 1))
    pred = lik.predictive(torch.randn(K, 3), torch.rand(K, 3) + 0.1).probs
    torch.testing.assert_close(pred.sum(-1), torch.ones(3))
    assert bool((pred >= eps / (K - 1) - 1e-7).all())
    assert lik.support.check(torch.tensor(K - 1)) and not lik.support.check(torch.tensor(K))


def test_rule_sizes_beyond_six_latents_and_shape_checks():
    x, _ = gaussian_rule(7, "gh")
    assert x.shape == (3 ** 7, 7)  # 3 nodes per latent beyond Q = 6
    lik = from_distribution(_normal_q, latent_dim=2)
    with pytest.raises(ValueError, match="K=2"):
        lik.distribution(torch.zeros(3, 4))
    soft = ps.Softmax(3)
    with pytest.raises(ValueError, match="K=3"):
        soft.distribution(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="K=3"):
        soft.predictive(torch.zeros(2, 4), torch.ones(2, 4))
    rm = ps.RobustMax(3)
    P = rm.prob_max(torch.randn(3, 5), torch.rand(3, 5) * 0.2 + 0.3)
    assert P.shape == (3, 5)
    torch.testing.assert_close(P.sum(0), torch.ones(5), rtol=0, atol=5e-3)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="latent_dim"):
        from_distribution(_normal_q, latent_dim=0)
    with pytest.raises(ValueError, match="rule"):
        from_distribution(_normal_q, latent_dim=2, rule="simpson")
    with pytest.raises(ValueError, match="rule must be 'auto' or 'gh'"):
        from_distribution(lambda f: dist.Normal(f, 1.0), rule="qmc")
    with pytest.raises(ValueError, match="num_samples"):
        from_distribution(_normal_q, latent_dim=2, rule="mc", num_samples=1)
    with pytest.raises(ValueError, match="num_samples"):
        from_distribution(_normal_q, latent_dim=2, rule="mc", num_samples=2.5)
    with pytest.raises(ValueError, match="latent_dim"):
        from_distribution(_normal_q, latent_dim=2.5)
    from pyro_sparsegp.likelihoods.multilatent import _MultiLatent
    for bad in (2.5, 1, True):
        with pytest.raises(ValueError, match="latent_dim"):
            _MultiLatent(bad)
    assert from_distribution(_normal_q, latent_dim=2, rule="mc", num_samples=2).num_samples == 2
    with pytest.raises(TypeError, match="fn must be a callable"):
        from_distribution(3)
    with pytest.raises(TypeError, match="support"):
        from_distribution(lambda f: dist.Normal(f, 1.0), support="positive")
    one = from_distribution(lambda f: dist.Normal(f, 1.0))
    assert one.num_gh == 20 and one.support is constraints.real
    assert from_distribution(lambda f: dist.Normal(f, 1.0), num_gh=7).num_gh == 7
    assert math.isclose(float(one.expected_log_prob(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0]))),
                        -0.5 * math.log(2 * math.pi) - 0.5, rel_tol=1e-6)
