"""Properties of a deep GP's prediction (``pyro_sparsegp.layers.deep_prediction``; the predictive mixture of Salimbeni
& Deisenroth 2017, section 3.3): the mixture has ``S = 100`` components by default, chunking the inputs joins the
chunks along the points (also with several outputs), the delta-method standard error of ``predictive_log_prob``
matches an independent log-space computation and stays finite for a point that every component misses by far, and
a Bernoulli head of one output gives ``p(y = 1)`` ``[N]``."""

import math

import torch

import pyro_sparsegp as ps
from pyro_sparsegp.deep import build_deep_gp


def _data(N=9):
    torch.manual_seed(0)
    X = torch.linspace(-2, 2, N).unsqueeze(-1)
    return X, torch.sin(2 * X[:, 0])


def test_the_default_mixture_has_100_components_and_chunks_join_along_the_points():
    X, _ = _data()
    dgp = build_deep_gp(X, [2], ps.Gaussian(0.2), num_outputs=2, num_inducing=4, hidden_scale=0.5)
    loc, var = dgp.predict(X)
    assert loc.shape == var.shape == (100, 9, 2)
    torch.manual_seed(5)
    loc_c, var_c = dgp.predict(X, 7, batch_size=4)  # chunks of 4, 4 and 1 points
    assert loc_c.shape == var_c.shape == (7, 9, 2)
    torch.manual_seed(5)
    loc_0, var_0 = dgp.predict(X[:4], 7)  # the first chunk draws the same numbers
    torch.testing.assert_close(loc_c[:, :4], loc_0)
    torch.testing.assert_close(var_c[:, :4], var_0)
    single = build_deep_gp(X, [2], ps.Gaussian(0.2), num_inducing=4, hidden_scale=0.5)
    assert single.predict(X, 6, batch_size=4)[0].shape == (6, 9)
    assert single.predict(X, 6, batch_size=1)[0].shape == (6, 9)  # one point per chunk


def test_the_standard_error_matches_a_log_space_computation_and_survives_an_outlier():
    X, y = _data()
    dgp = build_deep_gp(X, [2], ps.Gaussian(0.01), num_inducing=4, hidden_scale=0.5)
    with torch.no_grad():  # a last layer away from its prior, so that the components differ
        dgp.last.q_u.set(2 * torch.randn(4), 0.1 * torch.eye(4))
    y = y.clone()
    y[2] = 1e3  # every component misses it by ~1e3 standard deviations: log-densities ~ -5e7, far apart
    S = 50
    torch.manual_seed(3)
    lp, se = dgp.predictive_log_prob(X, y, S, return_se=True)
    torch.manual_seed(3)
    loc, var = dgp.predict(X, S)  # the same components
    comp = torch.distributions.Normal(loc, (var + 0.01).sqrt()).log_prob(y)  # [S, N]
    log_mean = torch.logsumexp(comp, 0) - math.log(S)
    r = (comp - log_mean).exp()  # w_s / mean_s(w), computed in log space
    torch.testing.assert_close(lp, log_mean)
    assert bool(torch.isfinite(se).all()) and bool((se >= 0).all())
    # float32 resolves log-densities of ~ -1e7 to a few nats only: the outlier's weights then agree to a few per cent
    rtol = 1e-3 if X.dtype == torch.float64 else 0.1
    torch.testing.assert_close(se, r.std(0) / math.sqrt(S), rtol=rtol, atol=1e-6)


def test_a_bernoulli_head_of_one_output_gives_one_probability_per_point():
    X, y = _data()
    dgp = build_deep_gp(X, [2], ps.Bernoulli(), num_outputs=1, num_inducing=4, hidden_scale=0.3)
    p = dgp.predict_proba(X, 5)
    assert p.shape == (9,)
    assert bool(((p > 0) & (p < 1)).all())
    torch.manual_seed(1)
    p = dgp.predict_proba(X, 40)
    torch.manual_seed(1)
    loc, var = dgp.predict(X, 40)  # [S, N, 1]: p(y=1) = E Phi(f / sqrt(1 + var)) per component, then the average
    ref = torch.distributions.Normal(0.0, 1.0).cdf(loc / (1 + var).sqrt()).mean(0).squeeze(-1)
    torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-6)


def test_class_probabilities_keep_their_layout_at_one_point():
    """``[N, K]`` class probabilities (rows summing to one) also for ``N = 1``; ``[N]`` for a one-output Bernoulli."""
    X, _ = _data()
    dgp = build_deep_gp(X, [2], ps.Softmax(3), num_outputs=3, num_inducing=4, hidden_scale=0.3)
    for Xq in (X, X[:1]):
        p = dgp.predict_proba(Xq, 5)
        assert p.shape == (len(Xq), 3)
        torch.testing.assert_close(p.sum(-1), torch.ones(len(Xq)))
    single = build_deep_gp(X, [2], ps.Bernoulli(), num_inducing=4, hidden_scale=0.3)
    assert single.predict_proba(X, 5).shape == (9,)
    assert single.predict_proba(X[:1], 5).shape == (1,)


def test_prediction_keeps_no_factors():
    """No ``[S, K, B]``-sized factors stay cached in any layer after ``predict``, ``predict_proba`` or
    ``predictive_log_prob``."""
    X, y = _data()
    dgp = build_deep_gp(X, [2], ps.Gaussian(0.2), num_inducing=4, hidden_scale=0.5)
    for call in (lambda: dgp.predict(X, 3, batch_size=4), lambda: dgp.predictive_log_prob(X, y, 3)):
        call()
        assert all(len(layer.strategy.cache) == 0 for layer in dgp._stack)
