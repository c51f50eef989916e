"""The layer contract: the programs a Pyro user writes around our layers with standard idioms (PyroSample
hyperpriors, autoguides beside the layer's guide, user-owned plates, latent inputs, stacked layers under vectorised
particles, hierarchies) run, train every parameter, and estimate the right bound."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from gradient_checks import assert_gradients, parameter_gradients
from pyro import poutine
from pyro.contrib.gp.kernels import RBF, Matern32
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B


def _tol():
    """Tolerance of identities checked against dense algebra: float64 resolves 1e-6, float32 about 1e-3."""
    return 1e-6 if torch.get_default_dtype() == torch.float64 else 2e-3


def _powerplant(n=256, seed=0):
    data = ps.datasets.load_powerplant()
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    idx = torch.randperm(len(data.X_train), generator=g)[:n]
    X, Xt, _, _ = ps.datasets.standardize(data.X_train[idx], data.X_test[:64])
    y, yt, _, _ = ps.datasets.standardize(data.y_train[idx], data.y_test[:64])
    return X, y, Xt, yt


def _hyperprior_svgp(X, M=16):
    D = X.shape[-1]
    k = RBF(D)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(D), 1.0).to_event(1))
    k.variance = PyroSample(dist.LogNormal(torch.tensor(0.0), 1.0))
    lik = ps.Gaussian()
    lik.noise = PyroSample(dist.LogNormal(torch.tensor(-2.0), 1.0))
    return ps.SVGP(k, X[:M].clone(), lik)


def _expose(msg):
    return msg["name"].startswith(("gp.kernel.", "gp.likelihood."))


def _data_plates(X, y=None, subsample_size=None):
    # AutoGuideList would draw the data plate from its first call (the training set and minibatch); drawn from each
    # call's own inputs, the same guide also serves Predictive on test points
    return pyro.plate("gp.data", X.shape[-2], subsample_size=subsample_size, dim=-1)


def _autoguide_list(gp, auto_cls=AutoNormal):
    guide = AutoGuideList(gp.model, create_plates=_data_plates)
    guide.append(auto_cls(poutine.block(gp.model, expose_fn=_expose)))
    guide.append(gp.guide)
    return guide


# -- 1, 2: hyperpriors, autoguides beside the layer's guide --------------------------------------------------------
@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
def test_hyperpriors_with_autoguide_list_train_every_parameter(elbo):
    """Acceptance program: a UCI regression with PyroSample hyperpriors on lengthscale, variance and noise, guide =
    AutoGuideList(AutoNormal over them) + the layer's guide, minibatched; predictions averaged over q(theta)."""
    X, y, Xt, yt = _powerplant()
    gp = _hyperprior_svgp(X)
    guide = _autoguide_list(gp)
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.02}), elbo())
    svi.step(X, y, subsample_size=64)  # builds the autoguide's parameters
    params = dict(guide.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    assert any("lengthscale" in k for k in before) and any("noise" in k for k in before)
    gp_before = {k: v.detach().clone() for k, v in gp.named_parameters()}
    losses = [svi.step(X, y, subsample_size=64) for _ in range(100)]
    for k, v in guide.named_parameters():
        if k in before:
            assert not torch.equal(v.detach(), before[k]), k
    for k, v in gp.named_parameters():
        if k.endswith("_map_unconstrained"):
            continue  # pyro.contrib.gp kernels keep a MAP parameter per PyroSample for their own autoguide mode
        assert not torch.equal(v.detach(), gp_before[k]), k
    assert sum(losses[-20:]) < sum(losses[:20])
    # predictions averaged over q(theta) q(u): Predictive runs the whole guide, the model replays it
    pred = Predictive(gp.model, guide=guide, num_samples=64, return_sites=["gp.f"])(Xt)
    f = pred["gp.f"]
    assert f.shape == (64, len(Xt))
    rmse = (f.mean(0) - yt).pow(2).mean().sqrt()
    assert rmse < 0.6, rmse  # standardised targets: 1.0 is the constant predictor
    # the layer's own predict under the guide's draws of theta (poutine.replay), averaged by hand, agrees
    means = []
    for _ in range(64):
        tr = poutine.trace(guide).get_trace(Xt, None)
        with poutine.replay(trace=tr):
            means.append(gp.predict(Xt)[0])
    means = torch.stack(means)
    # two independent 64-draw Monte Carlo means of E[f*]: 4 computed standard errors of their difference
    se = (means.var(0) / len(means) + f.var(0) / len(f)).sqrt()
    assert ((means.mean(0) - f.mean(0)).abs() < 4 * se).all(), ((means.mean(0) - f.mean(0)) / se).abs().max()


def test_predict_with_hyperpriors_needs_values():
    X, y, Xt, _ = _powerplant(64)
    gp = _hyperprior_svgp(X)
    with pytest.raises(ValueError, match="PyroSample"):
        gp.predict(Xt)
    with poutine.condition(data={"gp.kernel.lengthscale": torch.ones(4), "gp.kernel.variance": torch.tensor(1.0),
                                 "gp.likelihood.noise": torch.tensor(0.1)}):
        mean, var = gp.predict(Xt)
    assert mean.shape == var.shape == (len(Xt),)


def test_layer_guide_without_a_guide_for_the_hyperparameters_is_refused():
    X, y, _, _ = _powerplant(64)
    gp = _hyperprior_svgp(X)
    with pytest.raises(ValueError, match="AutoGuideList"):
        Trace_ELBO().loss(gp.model, gp.guide, X, y)


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
def test_hyperprior_elbo_with_fixed_hyperparameters_is_the_dense_bound(elbo):
    """With q(theta) a point mass (AutoDelta), the ELBO is the dense L3 bound at theta plus log p(theta)."""
    torch.manual_seed(3)
    X, y, _, _ = _powerplant(48)
    gp = _hyperprior_svgp(X, M=6)
    guide = _autoguide_list(gp, AutoDelta)
    poutine.trace(guide).get_trace(X, y)  # builds the point masses
    with torch.no_grad():
        gp.q_u.set(0.5 * torch.randn(6), torch.tril(0.1 * torch.randn(6, 6), -1) + 0.4 * torch.eye(6))
    tr = poutine.trace(guide).get_trace(X, y)
    theta = {k: tr.nodes[k]["value"].detach() for k in ("gp.kernel.lengthscale", "gp.kernel.variance",
                                                         "gp.likelihood.noise")}
    P = 3000
    est = -elbo(num_particles=P, vectorize_particles=True, max_plate_nesting=1).loss(gp.model, guide, X, y)
    # dense: the bound at theta (whitened q(u)), plus the prior densities of theta
    k = RBF(X.shape[-1], variance=theta["gp.kernel.variance"], lengthscale=theta["gp.kernel.lengthscale"])
    Z = gp.Z.detach()
    Kuu = k(Z) + 1e-10 * k(Z).diagonal().mean() * torch.eye(6)
    Luu = torch.linalg.cholesky(Kuu)
    m, L = gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach()
    m_u, L_u = Luu @ m, Luu @ L  # the whitened q(v) as q(u)
    bound = B.l3_bound(y, theta["gp.likelihood.noise"], Kuu, k(Z, X), k(X, diag=True), m_u, L_u)
    log_prior = (dist.LogNormal(torch.zeros(4), 1.0).log_prob(theta["gp.kernel.lengthscale"]).sum()
                 + dist.LogNormal(0.0, 1.0).log_prob(theta["gp.kernel.variance"])
                 + dist.LogNormal(-2.0, 1.0).log_prob(theta["gp.likelihood.noise"]))
    # Monte Carlo error of the estimate: per-particle spread of the sampled-f data term
    singles = torch.tensor([-Trace_ELBO().loss(gp.model, guide, X, y) for _ in range(200)])
    se = singles.std() / math.sqrt(P)
    assert abs(est - (bound + log_prior)) < 4 * se + 1e-6, (est, bound + log_prior, se)


def test_cache_never_serves_factors_of_other_hyperparameter_values():
    """The guide leaves factors computed with one lengthscale; a model run with another value (conditioned)
    must compute its own: its conditional p(f | u) equals the dense one at the model's value."""
    X = torch.randn(20, 2)
    k = RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
    gp = ps.SVGP(k, X[:5].clone(), whiten=False)
    a, b = torch.tensor([0.5, 0.7]), torch.tensor([2.0, 1.5])

    def guide():
        pyro.sample("gp.kernel.lengthscale", dist.Delta(a).to_event(1))
        u = gp.sample_u(guide=True)
        with pyro.plate("data", 20):
            gp.sample_f(X, u, guide=True)

    def model():
        u = gp.sample_u()
        with pyro.plate("data", 20):
            gp.sample_f(X, u)

    gtr = poutine.trace(guide).get_trace()
    assert len(gp.strategy.cache)  # the guide left its factors
    mtr = poutine.trace(poutine.replay(poutine.condition(model, {"gp.kernel.lengthscale": b}), gtr)).get_trace()
    u = mtr.nodes["gp.u"]["value"]
    kb = RBF(2, lengthscale=b)
    Kuu = kb(gp.Z.detach()) + 1e-10 * torch.eye(5)
    expect = kb(X, gp.Z.detach()) @ torch.linalg.solve(Kuu, u)
    torch.testing.assert_close(mtr.nodes["gp.f"]["fn"].loc, expect, atol=_tol(), rtol=_tol())
    # and with the guide's own value the model reuses the guide's conditional (one evaluation)
    gtr = poutine.trace(guide).get_trace()
    assert any(key[0] == "cond" for key in gp.strategy.cache.entries)
    poutine.trace(poutine.replay(model, gtr)).get_trace()
    assert not any(key[0] == "cond" for key in gp.strategy.cache.entries)  # the model took the guide's conditional


def test_user_owned_data_plate_beside_autoguide_list():
    """The documented pattern with a data plate the user owns: ps.context.plate joins AutoGuideList's plate."""
    X, y, _, _ = _powerplant(128)
    gp = _hyperprior_svgp(X, M=8)
    lik = gp.likelihood

    def model(X, y):
        u = gp.sample_u()
        with pyro.plate("data", len(X), subsample_size=32) as i:
            f = gp.sample_f(X[i], u)
            lik(f, y[i])

    def guide(X, y):
        u = gp.sample_u(guide=True)
        with ps.context.plate("data", len(X), subsample_size=32) as i:
            gp.sample_f(X[i], u, guide=True)

    g = AutoGuideList(model)
    g.append(AutoNormal(poutine.block(model, expose_fn=_expose)))
    g.append(guide)
    svi = SVI(model, g, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    losses = [svi.step(X, y) for _ in range(60)]
    assert all(math.isfinite(v) for v in losses)
    # the guide's minibatch is the one the model scored: one plate site, drawn once
    tr = poutine.trace(g).get_trace(X, y)
    assert tr.nodes["data"]["value"].shape == (32,)


# -- 3: stacking under vectorised particles ------------------------------------------------------------------------
def _spread(M, D):
    """``M`` well-separated inducing inputs ``[M, D]`` (random ones can nearly coincide, which float32 reports)."""
    return torch.linspace(-2, 2, M).unsqueeze(-1).expand(M, D).clone()


def _stack(num_layers):
    X = torch.linspace(-2, 2, 30).unsqueeze(-1)
    y = torch.sign(X[:, 0]) + 0.1 * torch.randn(30)
    layers, D = [], 1
    for i in range(num_layers - 1):
        layers.append(ps.SVGP(Matern32(D), _spread(5, D), num_outputs=2, name=f"h{i}"))
        D = 2
    layers.append(ps.SVGP(RBF(D), _spread(5, D), ps.Gaussian(0.1), name="out"))
    for layer in layers:  # q(u) away from the prior so every layer's sample matters
        with torch.no_grad():
            layer.q_u.set(0.5 * torch.randn_like(layer.q_u.u_loc), 0.5 * layer.q_u.u_scale_tril)

    def program(guide):
        def run(X, y):
            us = [layer.sample_u(guide=guide) for layer in layers]
            with pyro.plate("data", len(X), dim=-1):
                h = X
                for layer, u in zip(layers[:-1], us[:-1], strict=True):
                    h = layer.sample_hidden(h, u, guide=guide)
                f = layers[-1].sample_f(h, us[-1], guide=guide)
                if not guide:
                    layers[-1].likelihood(f, y)

        return run

    return program(False), program(True), X, y


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_vectorised_and_sequential_particles_agree(num_layers):
    model, guide, X, y = _stack(num_layers)
    P = 200
    vec = Trace_ELBO(num_particles=P, vectorize_particles=True, max_plate_nesting=2).loss(model, guide, X, y)
    singles = torch.tensor([Trace_ELBO(max_plate_nesting=2).loss(model, guide, X, y) for _ in range(P)])
    se = singles.std() / math.sqrt(P)
    assert abs(vec - singles.mean()) < 4 * math.sqrt(2) * se, (vec, singles.mean().item(), se.item())
    # hidden layers' samples are [P, 1, B, D] under vectorised particles: each particle its own path
    tr = poutine.trace(pyro.plate("particles", 7, dim=-3)(guide)).get_trace(X, y)
    f = tr.nodes["out.f"]["value"]
    assert f.shape == (7, 1, 30)


def test_transposed_hidden_output_is_refused_loudly():
    layer1 = ps.SVGP(Matern32(1), torch.randn(5, 1), num_outputs=2, name="h")
    layer2 = ps.SVGP(RBF(2), torch.randn(5, 2), name="g")
    X = torch.randn(10, 1)

    def guide():
        u1, u2 = layer1.sample_u(guide=True), layer2.sample_u(guide=True)
        with pyro.plate("data", 10, dim=-1):
            h = layer1.sample_f(X, u1, guide=True)  # [P, 2, B]
            layer2.sample_f(h.transpose(-1, -2), u2, guide=True)  # the old, wrong layout

    with pytest.raises(ValueError, match="belongs to no plate"):
        poutine.trace(pyro.plate("particles", 4, dim=-3)(guide)).get_trace()


def test_two_and_three_layers_train_with_vectorised_particles():
    for num_layers in (2, 3):
        model, guide, X, y = _stack(num_layers)
        elbo = TraceMeanField_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=2)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), elbo)
        losses = [svi.step(X, y) for _ in range(80)]
        assert sum(losses[-10:]) < sum(losses[:10])


# -- 4: every parameter trains on every documented path ------------------------------------------------------------
@pytest.mark.parametrize("integrate_f", [False, True], ids=["sampled_f", "integrated_f"])
@pytest.mark.parametrize("cls", ["SVGP", "SOLVEGP"])
def test_every_parameter_moves_after_one_plain_svi_step(integrate_f, cls):
    X, y = torch.randn(30, 2), torch.randn(30)
    k = RBF(2, lengthscale=torch.ones(2))
    if cls == "SVGP":
        gp = ps.SVGP(k, X[:5].clone(), ps.Gaussian(0.5), integrate_f=integrate_f)
    else:
        gp = ps.SOLVEGP(k, X[:4].clone(), X[4:8].clone(), ps.Gaussian(0.5), integrate_f=integrate_f)
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    assert any("likelihood.noise" in n for n in before)
    SVI(gp.model, gp.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO()).step(X, y)
    for n, p in gp.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


# -- 5: robust-max trains by default -------------------------------------------------------------------------------
def test_robust_max_default_integrates_f_and_trains():
    X = torch.randn(40, 2)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    gp = ps.SVGP(RBF(2), X[:6].clone(), ps.RobustMax(3), num_outputs=3)
    assert gp.integrate_f
    loss = Trace_ELBO().differentiable_loss(gp.model, gp.guide, X, y.to(X.dtype))
    loss.backward()
    # whitened: q(f)'s mean scales with sqrt(variance) and its variance with the variance, and robust-max's
    # P(argmax f = y) is invariant to a positive scale of f, so the bound does not depend on the kernel's variance;
    # the quadrature's backward pass leaves up to 5e-9 of the largest gradient (20 seeds, float64), hence the floor
    zero = {"kernel.variance_unconstrained": "whitened robust-max: invariant to the scale of f"}
    assert_gradients(parameter_gradients(gp), zero, rel=10 * torch.finfo(X.dtype).eps ** 0.5)
    with pytest.warns(ps.layers.UntrainableWarning, match="integrate_f=True"):
        ps.SVGP(RBF(2), X[:6].clone(), ps.RobustMax(3), num_outputs=3, integrate_f=False)


# -- 6: Pyro's global parameter store: tests/core/test_naming.py -------------------------------------------------


# -- 7: prediction --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("cls", ["SVGP", "SOLVEGP"])
def test_joint_posterior_draws_have_the_full_covariance(whiten, cls):
    X = torch.randn(12, 2)
    Xs = torch.linspace(-2, 2, 9).unsqueeze(-1).expand(9, 2).contiguous()
    if cls == "SVGP":
        gp = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(), whiten=whiten)
    else:
        gp = ps.SOLVEGP(RBF(2), X[:4].clone(), X[4:8].clone(), ps.Gaussian(), whiten=whiten)
    with torch.no_grad():
        for q in [gp.q_u] + ([gp.q_v] if cls == "SOLVEGP" else []):
            q.set(0.5 * torch.randn_like(q.u_loc), torch.tril(0.2 * torch.randn_like(q.u_scale_tril)) +
                  0.5 * torch.eye(q.u_loc.shape[-1]))
    mean, cov = gp.qf_full(Xs)
    m_diag, v_diag = gp.predict(Xs)
    torch.testing.assert_close(mean, m_diag)
    torch.testing.assert_close(cov.diagonal(dim1=-2, dim2=-1), v_diag, atol=_tol(), rtol=10 * _tol())
    # an independent dense computation of q(f*) (SVGP: over Z; SOLVE-GP: q(u) q(v⊥) through the orthogonal
    # process's covariance C)
    if cls == "SVGP":
        k = gp.kernel
        Kuu = k(gp.Z) + 1e-10 * torch.eye(5) * k(gp.Z).diagonal().mean()
        Luu = torch.linalg.cholesky(Kuu)
        m, L = gp.q_u.u_loc, gp.q_u.u_scale_tril
        if whiten:
            m, L = Luu @ m, Luu @ L
        A = torch.linalg.solve(Kuu, k(gp.Z, Xs))
        dense_cov = k(Xs) - A.T @ (Kuu - L @ L.T) @ A
        dense_mean = A.T @ m
    else:  # u ~ q(u), v⊥ ~ q(v⊥) independent; f = Kfu Kuu⁻¹ u + Cfv Cvv⁻¹ v⊥ + N(0, Cff - Cfv Cvv⁻¹ Cvf), with
        # C(a, b) = k(a, b) - k(a, Z) Kuu⁻¹ k(Z, b) (Shi, Titsias, Mnih 2020, section 3), written with dense solves
        k, Z, O = gp.kernel, gp.Z, gp.O
        Kuu = k(Z) + 1e-10 * torch.eye(4) * k(Z).diagonal().mean()

        def C(a, b):
            return k(a, b) - k(a, Z) @ torch.linalg.solve(Kuu, k(Z, b))

        Cvv = C(O, O) + 1e-10 * torch.eye(4) * k(O).diagonal().mean()
        (mu, Lu), (mv, Lv) = [(q.u_loc, q.u_scale_tril) for q in (gp.q_u, gp.q_v)]
        if whiten:
            Luu, Lc = torch.linalg.cholesky(Kuu), torch.linalg.cholesky(Cvv)
            mu, Lu, mv, Lv = Luu @ mu, Luu @ Lu, Lc @ mv, Lc @ Lv
        Au = torch.linalg.solve(Kuu, k(Z, Xs))  # Kuu⁻¹ Ku*
        Av = torch.linalg.solve(Cvv, C(O, Xs))  # Cvv⁻¹ Cv*
        dense_mean = Au.T @ mu + Av.T @ mv
        dense_cov = Au.T @ Lu @ Lu.T @ Au + Av.T @ Lv @ Lv.T @ Av + C(Xs, Xs) - C(Xs, O) @ Av
    torch.testing.assert_close(cov.detach(), dense_cov.detach(), atol=_tol(), rtol=10 * _tol())
    torch.testing.assert_close(mean.detach(), dense_mean.detach(), atol=_tol(), rtol=10 * _tol())
    draws = gp.sample_posterior(Xs, 20000)
    assert draws.shape == (20000, 9)
    emp = torch.cov(draws.T)
    torch.testing.assert_close(emp, cov.detach(), atol=0.05 * cov.diagonal().max().item(), rtol=0)
    # smooth draws: neighbouring points correlate (independent marginals would not)
    assert torch.corrcoef(draws[:, :2].T)[0, 1] > 0.5


def test_predict_layout_follows_the_training_targets():
    X = torch.randn(20, 2)
    gp = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(), num_outputs=3)
    mean, var = gp.predict(X)
    assert mean.shape == var.shape == (20, 3)  # y is [N, L]
    mean, var = gp.predict(X.expand(4, 20, 2))
    assert mean.shape == (4, 20, 3)
    with pytest.raises(ValueError, match="likelihood"):
        ps.SVGP(RBF(2), X[:5].clone(), num_outputs=3).predict(X, full=True)


# -- 8: the package's datasets ---------------------------------------------------------------------------------------
def test_datasets_importable_from_the_package():
    import pyro_sparsegp

    assert pyro_sparsegp.datasets.load_powerplant().X_train.shape[-1] == 4


# -- latent inputs: Bayesian GPLVM -----------------------------------------------------------------------------------
def _gplvm(N=24, Q=2, D_out=3, M=6):
    torch.manual_seed(0)
    Y = torch.randn(N, D_out)
    gp = ps.SVGP(RBF(Q), torch.randn(M, Q), ps.Gaussian(0.3), num_outputs=D_out)
    lik = gp.likelihood

    def model(Y, B=8):
        u = gp.sample_u()
        with pyro.plate("data", len(Y), subsample_size=B, dim=-1) as i:
            x = pyro.sample("x", dist.Normal(torch.zeros(Q), 1.0).to_event(1))  # [..., (1,) B, Q]
            f = gp.sample_f(x, u)  # [..., D_out, B]
            with gp.outputs_plate():
                lik(f, Y[i].mT)

    def guide(Y, B=8):
        u = gp.sample_u(guide=True)
        x_loc = pyro.param("x_loc", lambda: 0.3 * torch.randn(len(Y), Q))
        x_scale = pyro.param("x_scale", lambda: 0.5 * torch.ones(len(Y), Q), constraint=dist.constraints.positive)
        with pyro.plate("data", len(Y), subsample_size=B, dim=-1) as i:
            x = pyro.sample("x", dist.Normal(x_loc[i], x_scale[i]).to_event(1))
            gp.sample_f(x, u, guide=True)

    return gp, model, guide, Y


def test_gplvm_elbo_matches_a_dense_computation():
    """Minibatched local latents inside the data plate: the Trace_ELBO estimate equals an independent computation
    of the Bayesian GPLVM bound (Titsias and Lawrence 2010; Hensman 2013 section 3.3, with q(u) explicit):
    sum_n E_q(x_n)[E_q(f_n|x_n) log p(y_n|f_n)] - KL[q(u)||p(u)] - sum_n KL[q(x_n)||p(x_n)]."""
    gp, model, guide, Y = _gplvm()
    with torch.no_grad():
        gp.q_u.set(0.4 * torch.randn(3, 6), torch.tril(0.1 * torch.randn(3, 6, 6), -1) + 0.5 * torch.eye(6))
    guide(Y)  # creates x_loc, x_scale
    # each evaluation draws one minibatch for all its particles: average many evaluations, and take the error
    # from their spread (the minibatch's variance included)
    elbo = Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=2)
    ests = torch.tensor([-elbo.loss(model, guide, Y) for _ in range(150)])
    est = ests.mean()
    # dense: closed-form expectations given x, Monte Carlo over q(x) only, closed-form KLs
    x_loc, x_scale = pyro.param("x_loc").detach(), pyro.param("x_scale").detach()
    k, Z, noise = gp.kernel, gp.Z.detach(), 0.3
    Kuu = k(Z) + 1e-10 * torch.eye(6) * k(Z).diagonal().mean()
    Luu = torch.linalg.cholesky(Kuu)
    terms = []
    for _ in range(400):
        x = x_loc + x_scale * torch.randn_like(x_loc)
        ell = 0.0
        for d in range(3):
            m, L = Luu @ gp.q_u.u_loc[d].detach(), Luu @ gp.q_u.u_scale_tril[d].detach()
            mu, var = B.qf_dense(Kuu, k(Z, x).detach(), k(x, diag=True).detach(), m, L)
            ell = ell + (dist.Normal(mu, noise**0.5).log_prob(Y[:, d]) - 0.5 * var / noise).sum()
        terms.append(ell)
    terms = torch.stack(terms)
    kl_u = sum(B.gauss_kl(gp.q_u.u_loc[d].detach(), gp.q_u.u_scale_tril[d].detach()) for d in range(3))
    kl_x = torch.distributions.kl_divergence(dist.Normal(x_loc, x_scale), dist.Normal(0.0, 1.0)).sum()
    dense = terms.mean() - kl_u - kl_x
    se = (ests.std() ** 2 / len(ests) + terms.std() ** 2 / len(terms)).sqrt()
    assert abs(est - dense) < 4 * se, (est.item(), dense.item(), se.item())


@pyro.settings.context(module_local_params=False)  # Pyro's default store: the guide's own pyro.params beside
def test_gplvm_trains_latents_and_layer():
    gp, model, guide, Y = _gplvm()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO(max_plate_nesting=2))
    svi.step(Y)
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    x_before = pyro.param("x_loc").detach().clone()
    for _ in range(5):
        svi.step(Y)
    for n, p in gp.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n
    moved = (pyro.param("x_loc").detach() != x_before).any(-1)
    assert moved.float().mean() > 0.5  # minibatches of 8 of 24 rows: most rows were visited


# -- a hierarchical model ------------------------------------------------------------------------------------------
def test_hierarchical_gp_trend_with_group_effects():
    """GP trend plus per-group random intercepts (a user's plate over groups), Bernoulli likelihood, minibatched,
    AutoNormal on the group effects and their scale beside the layer's guide."""
    torch.manual_seed(1)
    N, G = 400, 6
    t = torch.rand(N, 1) * 4 - 2
    g = torch.randint(0, G, (N,))
    effects = torch.linspace(-2.0, 2.0, G)
    y = torch.bernoulli(torch.sigmoid(torch.sin(2 * t[:, 0]) + effects[g]))
    gp = ps.SVGP(RBF(1), torch.linspace(-2, 2, 8).unsqueeze(-1), name="trend")

    def model(t, g, y):
        sigma = pyro.sample("sigma", dist.HalfNormal(2.0))
        with pyro.plate("groups", G):
            b = pyro.sample("b", dist.Normal(0.0, sigma))
        u = gp.sample_u()  # TraceMeanField_ELBO wants the guide's order: the autoguide's sites first
        with pyro.plate("data", len(t), subsample_size=100) as i:
            f = gp.sample_f(t[i], u)
            pyro.sample("y", dist.Bernoulli(logits=f + b[g[i]]), obs=y[i])

    def gp_guide(t, g, y):
        u = gp.sample_u(guide=True)
        with ps.context.plate("data", len(t), subsample_size=100) as i:
            gp.sample_f(t[i], u, guide=True)

    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=["sigma", "b"])))
    guide.append(gp_guide)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), TraceMeanField_ELBO())
    losses = [svi.step(t, g, y) for _ in range(400)]
    assert sum(losses[-50:]) < sum(losses[:50])
    b_loc = guide[0].median(t, g, y)["b"]
    assert torch.corrcoef(torch.stack([b_loc, effects]))[0, 1] > 0.8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = poutine.trace(guide).get_trace(t, g, y)
    assert tr.nodes["b"]["value"].shape == (G,)


@pytest.mark.parametrize("cls,whiten,L", [("SVGP", False, 3), ("SOLVEGP", False, None), ("SOLVEGP", True, 3)])
def test_hyperpriors_under_vectorised_particles_agree_with_sequential(cls, whiten, L):
    """Hyperparameters drawn per particle ([P, 1, ..] batch) line up with the layer's matrices: the vectorised
    estimate equals the sequential one within Monte Carlo error."""
    X = torch.randn(20, 2)
    y = X.sum(-1) if L is None else X.sum(-1, keepdim=True).expand(20, L)
    k = RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 0.3).to_event(1))
    k.variance = PyroSample(dist.LogNormal(torch.tensor(0.0), 0.3))
    if cls == "SVGP":
        gp = ps.SVGP(k, X[:5].clone(), ps.Gaussian(0.5), whiten=whiten, num_outputs=L)
    else:
        gp = ps.SOLVEGP(k, X[:4].clone(), X[4:8].clone(), ps.Gaussian(0.5), whiten=whiten, num_outputs=L)
    guide = _autoguide_list(gp)
    nest = 1 if L is None else 2
    poutine.trace(guide).get_trace(X, y)
    P = 150
    vec = Trace_ELBO(num_particles=P, vectorize_particles=True, max_plate_nesting=nest).loss(gp.model, guide, X, y)
    singles = torch.tensor([Trace_ELBO(max_plate_nesting=nest).loss(gp.model, guide, X, y) for _ in range(P)])
    se = singles.std() / math.sqrt(P)
    assert abs(vec - singles.mean()) < 4 * math.sqrt(2) * se, (vec, singles.mean().item(), se.item())


def test_a_hyperprior_noise_read_outside_a_pyro_program_raises_instead_of_drawing_the_prior():
    """Pyro draws a PyroSample attribute read outside its module's context from the prior, ignoring
    poutine.condition, so ``var + gp.likelihood.noise`` after training would add a random draw: the likelihood
    refuses the read, naming the way that works, and ``predict(X, full=True)`` under ``poutine.condition`` gives the
    predictive distribution with the conditioned noise."""
    lik = ps.Gaussian()
    lik.noise = PyroSample(dist.LogNormal(-2.0, 1.0))
    gp = ps.SVGP(RBF(2), torch.randn(4, 2), lik, name="hpn")
    with pytest.raises(RuntimeError, match="predict\\(X, full=True\\) under poutine.condition"):
        gp.likelihood.noise  # noqa: B018
    with pytest.raises(RuntimeError, match="PyroSample"), poutine.condition(data={"hpn.likelihood.noise": 0.05}):
        gp.likelihood.noise  # noqa: B018  (a handler does not reach a bare read)
    X = torch.randn(10, 2)
    with poutine.condition(data={"hpn.likelihood.noise": torch.tensor(0.05)}):
        _, var, pred = gp.predict(X, full=True)
    torch.testing.assert_close(pred.variance, var + 0.05)
