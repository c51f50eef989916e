"""The linear model of coregionalisation (``num_latents=Q``) and per-latent / per-output kernels: the closed-form
bound and the outputs' covariance against dense matrices, ``Trace_ELBO`` against the closed form, the limits
``Q = L, W = I`` (independent outputs) and ``Separate`` kernels (separate single-output layers), SOLVE-GP and deep GP
layers mixed by ``W``, and the argument errors."""

import math

import pyro
import pytest
import torch
from dense_outputs import dense_bound, latent_q, output_marginals, randomise_q
from pyro.contrib.gp.kernels import RBF, Matern32
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import Constant

N, M, D, L, Q = 12, 4, 2, 3, 2
F32 = torch.get_default_dtype() == torch.float32


def _tol():
    return dict(rtol=1e-4, atol=1e-4) if torch.get_default_dtype() == torch.float32 else dict(rtol=1e-8, atol=1e-8)


def _data(missing=False):
    X = torch.rand(N, D) * 4 - 2
    y = torch.stack([torch.sin(X[:, 0]), torch.cos(X[:, 1]), X[:, 0] * X[:, 1] / 2], -1) + 0.2 * torch.randn(N, L)
    if missing:
        y[1, 0] = y[2, 2] = y[5, 1] = y[5, 2] = float("nan")
    return X, y


def _kernels(per_latent):
    if not per_latent:
        return RBF(D, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.9))
    return [RBF(D, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.9)),
            Matern32(D, variance=torch.tensor(0.7), lengthscale=torch.tensor(1.4))]


def _lmc(lik="gaussian", whiten=True, per_latent=False, per_latent_Z=False, **kw):
    likelihood = ps.Gaussian(0.3) if lik == "gaussian" else ps.Bernoulli("probit")
    Z = torch.rand((Q, M, D) if per_latent_Z else (M, D)) * 4 - 2
    gp = ps.SVGP(_kernels(per_latent), Z, likelihood, num_outputs=L, num_latents=Q, whiten=whiten, **kw)
    randomise_q(gp)
    return gp


@pytest.mark.parametrize("whiten", [True, False], ids=["whitened", "plain"])
@pytest.mark.parametrize("per_latent", [False, True], ids=["shared-kernel", "per-latent-kernels"])
@pytest.mark.parametrize("lik", ["gaussian", "probit"])
def test_closed_form_bound_equals_the_dense_bound(lik, per_latent, whiten):
    X, y = _data()
    if lik == "probit":
        y = (y > 0).to(X.dtype)
    gp = _lmc(lik, whiten, per_latent, per_latent_Z=per_latent)
    with torch.no_grad():
        torch.testing.assert_close(gp.analytic_elbo(X, y), dense_bound(gp, X, y), **_tol())


def test_outputs_are_w_g_with_the_mean_function_added():
    X, _ = _data()
    gp = _lmc(mean_function=Constant(L, torch.tensor([0.5, -1.0, 2.0])))
    mu, var, point_cov = output_marginals(gp, X)
    with torch.no_grad():
        mean, v = gp.predict(X)
        m2, C = gp.predict(X, full_output_cov=True)
        mf, Cf = gp.qf_full(X)
    shift = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(mean, mu.T + shift, **_tol())
    torch.testing.assert_close(v, var.T, **_tol())
    torch.testing.assert_close(m2, mu.T + shift, **_tol())
    torch.testing.assert_close(C, point_cov, **_tol())  # W diag(v(x)) W^T at each point
    assert torch.linalg.eigvalsh(C).min() > -1e-6  # positive semi-definite, rank <= Q
    # the full covariance of each output over the points: sum_q W_lq^2 C_q
    _, cov_g, _ = latent_q(gp, X)
    torch.testing.assert_close(Cf, torch.einsum("lq,qnm->lnm", gp.W.detach() ** 2, cov_g), **_tol())
    torch.testing.assert_close(mf, mu + shift[:, None], **_tol())


def test_joint_draws_are_correlated_across_outputs_as_w_diag_v_w():
    X, _ = _data()
    gp = _lmc()
    S = 20000
    with torch.no_grad():
        f = gp.sample_posterior(X[:2], S)  # [S, 2, L]
        _, C = gp.predict(X[:2], full_output_cov=True)
    emp = torch.einsum("snl,snk->nlk", f - f.mean(0), f - f.mean(0)) / (S - 1)
    # the standard error of a covariance estimate is at most sqrt((C_ll C_kk + C_lk^2) / S)
    d = torch.diagonal(C, dim1=-2, dim2=-1)
    se = ((d.unsqueeze(-1) * d.unsqueeze(-2) + C**2) / S).sqrt()
    assert ((emp - C).abs() < 5 * se + 1e-5).all(), (emp, C)


@pytest.mark.parametrize("integrate_f", [False, True], ids=["sampled-g", "integrated"])
def test_trace_elbo_estimates_the_closed_form_bound(integrate_f):
    X, y = _data(missing=True)
    gp = _lmc("probit", integrate_f=integrate_f)
    assert_trace_elbo_matches_closed_form(gp, X, (y > 0).to(X.dtype).masked_fill(torch.isnan(y), float("nan")))


def test_sites_and_plates():
    X, y = _data()
    gp = _lmc(name="lmc")
    tr = pyro.poutine.trace(gp.guide).get_trace(X, y)
    tm = pyro.poutine.trace(pyro.poutine.replay(gp.model, tr)).get_trace(X, y)
    assert tm.nodes["lmc.u"]["value"].shape == (Q, 1, M)
    assert tm.nodes["lmc.f"]["value"].shape == (Q, N)  # the latents g
    assert tm.nodes["y"]["fn"].batch_shape == (L, N)
    frames = {f.name for f in tm.nodes["lmc.f"]["cond_indep_stack"]}
    assert frames == {"lmc.latents", "lmc.data"}
    assert {f.name for f in tm.nodes["y"]["cond_indep_stack"]} == {"lmc.outputs", "lmc.data"}
    # y is observed from W g: its mean is W g (Gaussian likelihood)
    torch.testing.assert_close(tm.nodes["y"]["fn"].loc, gp.W.detach() @ tm.nodes["lmc.f"]["value"], **_tol())


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceMeanField_ELBO], ids=["Trace", "MeanField"])
def test_w_gets_the_gradient_of_the_bound(elbo_cls):
    X, y = _data()
    gp = _lmc()
    exact = torch.autograd.grad(gp.analytic_elbo(X, y), gp.W_unconstrained)[0]
    assert exact.abs().min() > 1e-3
    elbo = elbo_cls(num_particles=1000, vectorize_particles=True, max_plate_nesting=2)
    grads = []
    for _ in range(12):
        loss = elbo.differentiable_loss(gp.model, gp.guide, X, y)
        grads.append(-torch.autograd.grad(loss, gp.W_unconstrained)[0])
    g = torch.stack(grads)
    se = g.std(0) / math.sqrt(len(grads))
    assert ((g.mean(0) - exact).abs() < 5 * se + 1e-6).all(), (g.mean(0), exact, se)


def test_q_equal_l_with_identity_w_is_independent_outputs_exactly():
    X, y = _data(missing=True)
    Z = torch.rand(M, D) * 4 - 2
    lmc = ps.SVGP(_kernels(False), Z, ps.Gaussian(0.3), num_outputs=L, num_latents=L, W=torch.eye(L))
    ind = ps.SVGP(_kernels(False), Z, ps.Gaussian(0.3), num_outputs=L)
    randomise_q(ind)
    lmc.q_u.set(ind.q_u.u_loc, ind.q_u.u_scale_tril)
    with torch.no_grad():
        assert torch.equal(lmc.analytic_elbo(X, y), ind.analytic_elbo(X, y))
        for a, b in zip(lmc.predict(X), ind.predict(X), strict=True):
            assert torch.equal(a, b)
        pyro.set_rng_seed(3)
        a = Trace_ELBO(num_particles=7, vectorize_particles=True, max_plate_nesting=2).loss(lmc.model, lmc.guide, X, y)
        pyro.set_rng_seed(3)
        b = Trace_ELBO(num_particles=7, vectorize_particles=True, max_plate_nesting=2).loss(ind.model, ind.guide, X, y)
    assert a == pytest.approx(b, rel=1e-6 if F32 else 1e-12)


def test_per_output_kernels_are_separate_single_output_layers():
    X, y = _data(missing=True)
    kernels = [RBF(D, lengthscale=torch.tensor(0.6)), Matern32(D, variance=torch.tensor(2.0)), RBF(D)]
    Z = torch.rand(L, M, D) * 4 - 2
    gp = ps.SVGP(kernels, Z, ps.Gaussian(0.3), num_outputs=L)
    assert isinstance(gp.kernel, ps.kernels.Separate) and gp.strategy.kuu_chol(False)[0].shape == (L, M, M)
    randomise_q(gp)
    total = -gp.kl_divergence().sum() * 0  # the sum of the single-output bounds on each output's observed rows
    with torch.no_grad():
        mean, var = gp.predict(X)
        for l, k in enumerate(kernels):
            one = ps.SVGP(k, Z[l], ps.Gaussian(0.3))
            one.q_u.set(gp.q_u.u_loc[l], gp.q_u.u_scale_tril[l])
            obs = ~torch.isnan(y[:, l])
            total = total + one.analytic_elbo(X[obs], y[obs, l])
            m1, v1 = one.predict(X)
            torch.testing.assert_close(mean[:, l], m1, **_tol())
            torch.testing.assert_close(var[:, l], v1, **_tol())
        torch.testing.assert_close(gp.analytic_elbo(X, y), total, **_tol())


def test_solvegp_lmc_is_the_svgp_lmc_over_the_union():
    X, y = _data(missing=True)
    O = torch.rand(3, D) * 4 - 2
    sg = ps.SOLVEGP(_kernels(True), torch.rand(M, D) * 4 - 2, O, ps.Gaussian(0.3), num_outputs=L, num_latents=Q)
    randomise_q(sg)
    with torch.no_grad():
        svgp = sg.to_svgp()
        assert torch.equal(svgp.W, sg.W)
        torch.testing.assert_close(sg.analytic_elbo(X, y), svgp.analytic_elbo(X, y), **_tol())
        torch.testing.assert_close(sg.predict(X, full_output_cov=True)[1], svgp.predict(X, full_output_cov=True)[1],
                                   **_tol())
        torch.testing.assert_close(sg.analytic_elbo(X, y), dense_bound(svgp, X, y), **_tol())
    assert sg.q_v.u_loc.shape == (Q, 3)
    assert_trace_elbo_matches_closed_form(sg, X, y)


def test_deep_gp_with_an_lmc_hidden_layer():
    X, y = _data(missing=True)
    hidden = ps.SVGP(RBF(D), torch.rand(M, D) * 4 - 2, num_outputs=3, num_latents=2, name="h",
                     mean_function=Constant(3, torch.tensor([0.3, -0.2, 1.0])))
    out = ps.SVGP(RBF(3), torch.randn(M, 3), ps.Gaussian(0.3), num_outputs=L, num_latents=2, name="o")
    randomise_q(hidden)
    randomise_q(out)
    dgp = ps.DeepGP([hidden, out])
    # a hidden LMC layer propagates draws from the joint marginal N(W m + mean, W diag(v) W^T) of its outputs
    S = 20000
    with torch.no_grad():
        h = hidden.propagate_marginal(X[:2], S).squeeze(-3)  # [S, 2, 3]
        m, C = hidden.predict(X[:2], full_output_cov=True)
    emp = torch.einsum("snl,snk->nlk", h - h.mean(0), h - h.mean(0)) / (S - 1)
    d = torch.diagonal(C, dim1=-2, dim2=-1)
    assert ((emp - C).abs() < 5 * ((d.unsqueeze(-1) * d.unsqueeze(-2) + C**2) / S).sqrt() + 1e-5).all()
    assert ((h.mean(0) - m).abs() < 5 * (d / S).sqrt() + 1e-5).all()
    # Salimbeni's estimator (S propagated samples) and Trace_ELBO on model/guide (sampled u, g) agree in expectation
    with torch.no_grad():
        sal = torch.stack([dgp.analytic_elbo(X, y, num_samples=2000) for _ in range(10)])
        elbo = Trace_ELBO(num_particles=2000, vectorize_particles=True, max_plate_nesting=2)
        tr = -torch.tensor([elbo.loss(dgp.model, dgp.guide, X, y) for _ in range(10)])
    se = (sal.var() / len(sal) + tr.var() / len(tr)).sqrt()
    assert (sal.mean() - tr.mean()).abs() < 5 * se + 1e-6, (sal.mean(), tr.mean(), se)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_latents=2), "give num_outputs too"),
        (dict(num_outputs=3, num_latents=2, W=[[1.0] * 3] * 2), r"W must be \[L, Q\] = \[3, 2\]"),
        (dict(num_outputs=3, W=[[1.0] * 2] * 3), "give num_latents"),
        (dict(num_outputs=3, num_latents=0), "num_latents must be a positive integer"),
        (dict(num_outputs=3, num_latents=2, W=[[1.0, float("nan")]] * 3), "W contains NaN"),
        (dict(num_outputs=3, num_latents=2, kernel=3), "3 kernels .* but num_latents = 2"),
        (dict(num_outputs=3, kernel=2), "2 kernels .* but num_outputs = 3"),
        (dict(num_outputs=3, num_latents=2, Z=(3, 4, 2)), "need num_latents"),
        (dict(num_latents=2, likelihood="robustmax"), "element-wise likelihood"),
    ],
    ids=["no-outputs", "W-shape", "W-alone", "zero-latents", "W-nan", "kernels-vs-Q", "kernels-vs-L", "Z-vs-Q",
         "multiclass"],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, match):
    args = dict(kernel=RBF(2), Z=(4, 2), likelihood=ps.Gaussian())
    args.update(kwargs)
    args["Z"] = torch.randn(args["Z"])
    if isinstance(args["kernel"], int):  # a list of that many kernels, built here (inside the test's context)
        args["kernel"] = [RBF(2) for _ in range(args["kernel"])]
    if args["likelihood"] == "robustmax":
        args["likelihood"] = ps.RobustMax(3)
    with pytest.raises(ValueError, match=match):
        ps.SVGP(**args)


def test_bad_data_for_an_lmc_layer():
    gp = _lmc()
    X, y = _data()
    with pytest.raises(ValueError, match=r"y must be \[N, L\] = \[12, 3\]"):
        gp.analytic_elbo(X, y[:, :2])
    with pytest.raises(ValueError, match="share their inputs"):
        gp.qf(X.expand(3, N, D))
    with pytest.raises(ValueError, match="single output"):
        ps.SVGP(RBF(2), torch.randn(4, 2), ps.Gaussian()).predict(X, full_output_cov=True)
