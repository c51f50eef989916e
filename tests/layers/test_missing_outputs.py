"""Missing outputs: ``NaN`` entries of ``y`` ``[N, L]`` drop out of the bound (closed form and ``Trace_ELBO``) for
independent and LMC outputs, Gaussian, probit and Pólya-Gamma likelihoods, in a deep GP too; no ``NaN`` reaches a
gradient; a row with nothing observed, and a ``NaN`` where nothing can be masked, are refused."""

import pyro
import pytest
import torch
from dense_outputs import dense_bound, randomise_q
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps

N, M, D, L = 15, 4, 2, 3


def _tol():
    return dict(rtol=1e-4, atol=1e-4) if torch.get_default_dtype() == torch.float32 else dict(rtol=1e-8, atol=1e-8)


def _data(binary=False):
    X = torch.rand(N, D) * 4 - 2
    y = torch.stack([torch.sin(X[:, 0]), torch.cos(X[:, 1]), X[:, 0] * X[:, 1] / 2], -1) + 0.2 * torch.randn(N, L)
    if binary:
        y = (y > 0).to(X.dtype)
    missing = torch.zeros(N, L, dtype=torch.bool)
    missing[0, 0] = missing[3, 1] = missing[3, 2] = missing[7:11, 2] = True
    return X, y, y.masked_fill(missing, float("nan"))


def _layer(lik, lmc):
    likelihood = {"gaussian": lambda: ps.Gaussian(0.3), "probit": lambda: ps.Bernoulli("probit"),
                  "polya-gamma": ps.PolyaGammaLogit}[lik]()
    gp = ps.SVGP(RBF(D, lengthscale=torch.tensor(0.8)), torch.rand(M, D) * 4 - 2, likelihood, num_outputs=L,
                 num_latents=2 if lmc else None)
    randomise_q(gp)
    return gp


@pytest.mark.parametrize("lmc", [False, True], ids=["independent", "lmc"])
@pytest.mark.parametrize("lik", ["gaussian", "probit"])
def test_the_bound_sums_the_observed_entries_only(lik, lmc):
    X, y, y_nan = _data(binary=lik == "probit")
    gp = _layer(lik, lmc)
    with torch.no_grad():
        masked = gp.analytic_elbo(X, y_nan)
        torch.testing.assert_close(masked, dense_bound(gp, X, y_nan), **_tol())
        assert masked != gp.analytic_elbo(X, y)  # the missing entries did count before
        # the same with the minibatch scaling: a minibatch of rows stands for num_data rows
        torch.testing.assert_close(gp.analytic_elbo(X[:8], y_nan[:8], num_data=16),
                                   2 * (dense_bound(gp, X[:8], y_nan[:8]) + gp.kl_divergence().sum())
                                   - gp.kl_divergence().sum(), **_tol())


def test_independent_outputs_with_missing_entries_are_single_output_layers_on_their_rows():
    X, _, y_nan = _data()
    gp = _layer("gaussian", lmc=False)
    total = 0.0
    with torch.no_grad():
        for l in range(L):
            one = ps.SVGP(gp.kernel, gp.Z, ps.Gaussian(0.3))
            one.q_u.set(gp.q_u.u_loc[l], gp.q_u.u_scale_tril[l])
            obs = ~torch.isnan(y_nan[:, l])
            total = total + one.analytic_elbo(X[obs], y_nan[obs, l])
        torch.testing.assert_close(gp.analytic_elbo(X, y_nan), total, **_tol())


@pytest.mark.parametrize("lik, lmc", [("gaussian", False), ("gaussian", True), ("polya-gamma", True)],
                         ids=["gaussian-independent", "gaussian-lmc", "polya-gamma-lmc"])
def test_trace_elbo_estimates_the_masked_bound(lik, lmc):
    """The model masks ``y`` (and Pólya-Gamma's ``omega``) where it is missing, and the guide masks ``omega`` alike:
    an unmasked ``q(omega)`` of a missing entry would leave its ``-log q`` in the estimate."""
    X, _, y_nan = _data(binary=lik == "polya-gamma")
    assert_trace_elbo_matches_closed_form(_layer(lik, lmc), X, y_nan)


@pytest.mark.parametrize("integrate_f", [False, True], ids=["sampled-f", "integrated"])
def test_no_nan_reaches_a_gradient(integrate_f):
    X, _, y_nan = _data()
    gp = _layer("gaussian", lmc=True)
    gp.integrate_f = integrate_f
    params = [p for p in gp.parameters() if p.requires_grad]
    for loss in (-gp.analytic_elbo(X, y_nan),
                 Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2).differentiable_loss(
                     gp.model, gp.guide, X, y_nan, subsample_size=10)):
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        assert torch.isfinite(loss)


def test_the_mask_is_on_the_observed_site_only_where_needed():
    X, y, y_nan = _data()
    gp = _layer("gaussian", lmc=False)
    tr = pyro.poutine.trace(gp.model).get_trace(X, y_nan)
    assert torch.equal(tr.nodes["y"]["mask"], ~torch.isnan(y_nan).T)
    assert not torch.isnan(tr.nodes["y"]["value"]).any()
    assert pyro.poutine.trace(gp.model).get_trace(X, y).nodes["y"]["mask"] is None  # nothing missing: no mask


def test_deep_gp_masks_its_last_layer():
    X, _, y_nan = _data()
    out = _layer("gaussian", lmc=True)
    dgp = ps.DeepGP([out], num_samples=3)
    with torch.no_grad():
        torch.testing.assert_close(dgp.analytic_elbo(X, y_nan), out.analytic_elbo(X, y_nan), **_tol())
        lp = dgp.predictive_log_prob(X, y_nan, num_samples=2)
        mean, var = out.predict(X)
        ref = torch.distributions.Normal(mean, (var + 0.3).sqrt()).log_prob(y_nan.nan_to_num(0.0))
        torch.testing.assert_close(lp, torch.where(torch.isnan(y_nan), 0.0, ref).sum(-1), **_tol())
        elbo = TraceMeanField_ELBO(num_particles=5, vectorize_particles=True, max_plate_nesting=2)
        loss = elbo.loss(dgp.model, dgp.guide, X, y_nan)
    assert loss == pytest.approx(-out.analytic_elbo(X, y_nan).item(), rel=1e-4)  # q(f) integrated, KL analytic


def test_rows_with_nothing_observed_and_nan_that_cannot_be_masked_are_refused():
    X, y, y_nan = _data()
    gp = _layer("gaussian", lmc=True)
    y_nan[4] = float("nan")
    for call in (lambda: gp.analytic_elbo(X, y_nan), lambda: Trace_ELBO().loss(gp.model, gp.guide, X, y_nan),
                 lambda: ps.DeepGP([gp]).analytic_elbo(X, y_nan)):
        with pytest.raises(ValueError, match="y row 4 has no observed output"):
            call()
    one = ps.SVGP(RBF(D), torch.randn(M, D), ps.Gaussian())
    y1 = y[:, 0].clone()
    y1[2] = float("nan")
    with pytest.raises(ValueError, match="with one output .* nothing can be masked"):
        one.analytic_elbo(X, y1)
    mc = ps.SVGP(RBF(D), torch.randn(M, D), ps.RobustMax(3))
    with pytest.raises(ValueError, match="nothing can be masked"):
        mc.analytic_elbo(X, torch.tensor([0.0, 1.0, float("nan")] * 5))
    X[1, 0] = float("nan")
    with pytest.raises(ValueError, match="X contains NaN"):
        gp.analytic_elbo(X, y)
