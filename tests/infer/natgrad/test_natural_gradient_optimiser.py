"""ps.infer.NaturalGradient: a Pyro optimiser taking natural-gradient steps on the Gaussian families (Hensman, Fusi,
Lawrence 2013, section 3.2) and the wrapped optimiser's steps on everything else (Salimbeni et al. 2018)."""

import copy
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp import DeepGP
from pyro_sparsegp.deep import build_deep_gp
from pyro_sparsegp.infer import NaturalGradient, fit
from pyro_sparsegp.infer.natgrad import gaussian_natgrad_step, natgrad_from_grads_

N, M, D = 40, 6, 2
STORES = pytest.mark.parametrize("local", [True, False], ids=["module_local", "global_store"])


@pytest.fixture
def store(local):
    with pyro.settings.context(module_local_params=local):
        yield


def _data(seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.rand(N, D, generator=g) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.2 * torch.randn(N, generator=g)
    return X.to(torch.get_default_dtype()), y.to(torch.get_default_dtype())


def _gp(whiten=True, seed=0, integrate_f=None, noise=0.05):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed + 1)
    Z = (torch.rand(M, D, generator=g) * 4 - 2).to(torch.get_default_dtype())
    return ps.SVGP(RBF(D, lengthscale=torch.tensor(0.8)), Z, ps.Gaussian(noise), whiten=whiten,
                   integrate_f=integrate_f)


def _dense_optimum(gp, X, y):
    """Titsias / Hensman 2013 (section 2) optimal q(u) by dense algebra: S = Kuu (Kuu + Kuf Kfu / s2)^{-1} Kuu,
    m = S Kuu^{-1} Kuf y / s2; whitened: v = Luu^{-1} u."""
    with torch.no_grad():
        k, s2 = gp.kernel, gp.likelihood.noise
        Kuu = k(gp.Z) + 1e-10 * torch.eye(M)
        Kuf = k(gp.Z, X)
        Sigma = torch.linalg.inv(Kuu + Kuf @ Kuf.mT / s2)
        S = Kuu @ Sigma @ Kuu
        m = Kuu @ Sigma @ Kuf @ y / s2
        if gp.whiten:
            Luu = torch.linalg.cholesky(Kuu)
            Li = torch.linalg.inv(Luu)
            m, S = Li @ m, Li @ S @ Li.mT
    return m, S


def _qu(gp):
    q = getattr(gp, "q_u", gp)  # a layer or a family
    return q.u_loc.detach().clone(), (q.u_scale_tril @ q.u_scale_tril.mT).detach().clone()


@pytest.mark.float64
@STORES
@pytest.mark.parametrize("whiten", [True, False], ids=["whitened", "plain"])
def test_one_full_batch_step_of_length_one_lands_on_the_optimal_qu(store, whiten):
    """A deterministic Pyro ELBO of the Gaussian likelihood: TraceMeanField_ELBO (KL[q(u) || p(u)] analytic) and u
    integrated out of the likelihood (a one-layer DeepGP observes y under q(f)), so the ELBO's gradient is exact and
    one step of length 1 lands on the optimum (the layer's own model samples u for the likelihood term: its gradient is
    a one-sample estimate and the step is only right in expectation; see the next test)."""
    X, y = _data()
    gp = _gp(whiten)
    reference = _gp(whiten)
    dgp = DeepGP([gp], marginalize_last=True)
    svi = SVI(dgp.model, dgp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}),
                                                    natgrad=ps.infer.NaturalPolicy(lr=1.0, retraction=False)),
              TraceMeanField_ELBO())  # the plain step: exact with a deterministic ELBO
    before = _qu(gp)
    svi.step(X, y)
    m, S = _dense_optimum(gp, X, y)
    mq, Sq = _qu(gp)
    assert not torch.allclose(before[0], m, atol=1e-3)  # the step had work to do
    torch.testing.assert_close(mq, m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(Sq, S, rtol=1e-6, atol=1e-6)
    gaussian_natgrad_step(reference, X, y, lr=1.0)  # the package's closed-form step agrees
    torch.testing.assert_close(mq, _qu(reference)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gp.kernel.lengthscale, reference.kernel.lengthscale)  # Adam(lr=0) moved nothing


@pytest.mark.float64
def _natural(q) -> torch.Tensor:
    """``(Lambda m, lower triangle of Lambda)`` of ``q = N(m, LL^T)``, ``Lambda = (LL^T)^{-1}``, one vector
    ``[M + M(M+1)/2]`` (the parameters in which the step is affine)."""
    m, L = q.u_loc.detach(), q.u_scale_tril.detach()
    prec = torch.cholesky_inverse(L)
    return torch.cat([prec @ m, prec[tuple(torch.tril_indices(len(m), len(m)))]])


def test_with_the_layers_own_model_a_step_is_right_on_average_over_particles():
    """gp.model/gp.guide (f integrated given u, u sampled) and Trace_ELBO: the plain step (``retraction=False``; the
    positive-definite one is not affine in the gradient) is affine in the gradient in the natural parameters, so a
    length-1 step from the same start is an unbiased estimate of the optimal q(u)'s natural parameters (Hensman,
    Fusi, Lawrence 2013, section 3.2): over 12 steps of 2,000 vectorised particles each, every natural parameter's
    mean lies within 4.5 standard errors (measured from the 12 steps) of the dense optimum's (27 entries: a false
    alarm below 2e-4), and the standard errors are small enough to see a 5 % error."""
    X, y = _data()
    gp = _gp(True, integrate_f=True)
    raws = [gp.q_u.u_loc_unconstrained, gp.q_u.u_scale_tril_unconstrained]
    start = [r.detach().clone() for r in raws]
    draws = []
    for _ in range(12):
        with torch.no_grad():
            for r, s0 in zip(raws, start, strict=True):
                r.copy_(s0)
        elbo = Trace_ELBO(num_particles=2000, vectorize_particles=True, max_plate_nesting=1)
        SVI(gp.model, gp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}), natgrad=ps.infer.NaturalPolicy(lr=1.0,
                                                                                                             retraction=False)),
            elbo).step(X, y)
        draws.append(_natural(gp.q_u).double())
    draws = torch.stack(draws)  # [12, 27]
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    m, S = _dense_optimum(gp, X, y)
    prec = torch.linalg.inv(S).double()
    target = torch.cat([prec @ m.double(), prec[tuple(torch.tril_indices(M, M))]])
    assert (se > 0).all() and (4.5 * se < 0.05 * target.abs().max()).all(), (se, target)
    assert ((mean - target).abs() < 4.5 * se).all(), ((mean - target) / se, target)


def _sine_data(n=1000):
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    X = torch.rand(n, 3, generator=g) * 4 - 2
    y = torch.sin(3 * X[:, 0]) + 0.5 * torch.cos(2 * X[:, 1]) * X[:, 2] + 0.2 * torch.randn(n, generator=g)
    return X.to(torch.get_default_dtype()), y.to(torch.get_default_dtype())


def _svi_loss_per_point(optim, seed, X, y, steps=200):
    """The closed-form bound's loss per point after ``steps`` SVI steps of the layer's own model/guide with a
    one-sample ``Trace_ELBO`` on minibatches of 128 (README's recipe)."""
    pyro.set_rng_seed(seed)
    gp = ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:16].clone(), ps.Gaussian(0.1))
    svi = SVI(gp.model, gp.guide, optim, Trace_ELBO())
    for _ in range(steps):
        svi.step(X, y, subsample_size=128)
    with torch.no_grad():
        return -gp.analytic_elbo(X, y).item() / len(X)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_readme_recipe_converges_with_a_one_sample_trace_elbo(seed):
    """``SVI(model, guide, NaturalGradient(Adam(0.01), natgrad=0.1), Trace_ELBO())`` with one particle: the
    default positive-definite step ends ahead of Adam alone after the same steps (by 0.14 to 0.7 nats per point over
    these seeds and dtypes); the plain step
    (``retraction=False``) follows the sampled gradient's noise until the loss is astronomical (its precision stays
    positive definite, so nothing is damped), which is why it is not the default under SVI."""
    X, y = _sine_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ps.infer.natgrad.NatGradDampingWarning)  # the default step is never damped
        nat = _svi_loss_per_point(NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1), seed, X, y)
    adam = _svi_loss_per_point(pyro.optim.Adam({"lr": 0.01}), seed, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ps.infer.natgrad.NatGradDampingWarning)
        plain = _svi_loss_per_point(NaturalGradient(pyro.optim.Adam({"lr": 0.01}),
                                                    natgrad=ps.infer.NaturalPolicy(lr=0.1, retraction=False)),
                                    seed, X, y)
    assert math.isfinite(nat) and nat < adam
    assert not plain < 1e3  # diverged (or NaN)


def test_fit_with_a_pyro_elbo_takes_the_positive_definite_step():
    """``fit(..., elbo=Trace_ELBO(), natgrad=0.1)``: a Monte Carlo gradient, so every family takes the
    positive-definite step ("auto" retraction); it ends ahead of Adam alone (``natgrad_lr=None``)."""
    X, y = _sine_data()
    losses = {}
    for lr in (0.1, None):
        gp = ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:16].clone(), ps.Gaussian(0.1))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ps.infer.natgrad.NatGradDampingWarning)
            fit(gp, X, y, num_steps=200, batch_size=128, natgrad=lr, elbo=Trace_ELBO(), seed=0, progress=False)
        with torch.no_grad():
            losses[lr] = -gp.analytic_elbo(X, y).item() / len(X)
    assert math.isfinite(losses[0.1]) and losses[0.1] < losses[None]


@STORES
def test_the_step_is_natgrad_from_grads_and_fits_step(store):
    """One SVI step with NaturalGradient(Adam) equals (i) the ELBO's backward pass, natgrad_from_grads_ and torch's
    Adam by hand, and (ii) one step of fit(..., elbo=Trace_ELBO(), natgrad=...), from the same seed."""
    tol = dict(rtol=1e-6, atol=1e-6) if torch.get_default_dtype() == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    X, y = _data()
    gps = [_gp(True, integrate_f=True) for _ in range(3)]
    for gp in gps:
        gp.likelihood.noise_unconstrained.requires_grad_(False)  # fit would take its Fisher step on it
    a, b, c = gps
    elbo = lambda: Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)  # noqa: E731
    pyro.set_rng_seed(3)
    svi = SVI(a.model, a.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.02}), natgrad=0.3), elbo())
    svi.step(X, y, num_data=N)

    pyro.set_rng_seed(3)
    loss = elbo().differentiable_loss(b.model, b.guide, X, y, num_data=N)
    loss.backward()
    natgrad_from_grads_(b.q_u, 0.3, retraction=True)  # the default of both under a Monte Carlo ELBO
    rest = [p for n, p in b.named_parameters() if "q_u" not in n and p.requires_grad]
    torch.optim.Adam(rest, lr=0.02).step()

    fit(c, X, y, num_steps=1, batch_size=N, lr=0.02, natgrad=0.3, elbo=elbo(), seed=3, progress=False)
    for other in (b, c):
        for got, want in zip(_qu(a), _qu(other), strict=True):
            torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(a.kernel.lengthscale, other.kernel.lengthscale, **tol)
        torch.testing.assert_close(a.Z, other.Z, **tol)
    assert not torch.allclose(a.Z, _gp(True).Z)  # Adam moved Z


def _hyperprior_program(name):
    X, y = _data()
    k = RBF(D)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(D), 1.0).to_event(1))
    gp = ps.SVGP(k, _gp().Z, ps.Gaussian(0.1), name=name, integrate_f=True)
    guide = AutoGuideList(gp.model, create_plates=gp.create_plates)
    guide.append(AutoNormal(poutine.block(gp.model, expose_fn=lambda m: m["name"].startswith(f"{name}.kernel"))))
    guide.append(gp.guide)
    elbo = TraceMeanField_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=1)
    return X, y, gp, guide, elbo


@STORES
def test_hyperpriors_and_an_autoguide_train_beside_natural_steps(store):
    """A PyroSample lengthscale, AutoNormal on it and the layer's guide in an AutoGuideList (docs/composing.md): q(u)
    moves at the first step although the wrapped Adam has lr 0 (only a natural step can move it), the autoguide's
    lazily created parameters train with Adam, and over 50 steps (same seed) the hybrid ends at a lower loss than Adam
    alone at the same learning rate."""
    X, y, gp, guide, elbo = _hyperprior_program("hp0")
    before = _qu(gp)
    SVI(gp.model, guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}), natgrad=0.01), elbo).step(X, y)
    assert _changed(gp.q_u, before)
    runs = {}
    for name, optim in [("nat", NaturalGradient(pyro.optim.Adam({"lr": 0.02}), natgrad=0.01)),
                        ("adam", pyro.optim.Adam({"lr": 0.02}))]:
        X, y, gp, guide, elbo = _hyperprior_program(name)
        svi = SVI(gp.model, guide, optim, elbo)
        pyro.set_rng_seed(0)
        losses = [svi.step(X, y)]
        auto = {n: p.detach().clone() for n, p in guide[0].named_parameters()}
        losses += [svi.step(X, y) for _ in range(49)]
        assert all(math.isfinite(v) for v in losses)
        assert auto  # created at the first step
        for n, p in guide[0].named_parameters():  # and trained by the wrapped Adam
            assert not torch.allclose(p, auto[n]), n
        runs[name] = sum(losses[-10:]) / 10
    assert runs["nat"] < 0.9 * runs["adam"], runs


def _changed(q, before):
    return not torch.allclose(q.u_loc, before[0]) and not torch.allclose(q.u_scale_tril @ q.u_scale_tril.mT,
                                                                        before[1])


@STORES
@pytest.mark.parametrize("lik", ["gaussian", "bernoulli"])
def test_every_deep_gp_layer_takes_natural_steps(store, lik):
    """build_deep_gp (one hidden layer) under TraceMeanField_ELBO: one step of length 0.05 (64 vectorised particles)
    with the wrapped Adam at lr 0 moves every layer's q(u) (so the natural step reached each) and raises the bound
    (the hyperparameters fixed, the same full batch); training with 4 particles stays finite (20 steps; 30 for the
    non-conjugate Bernoulli likelihood) while every q(u) keeps moving."""
    X, y = _data()
    likelihood = ps.Gaussian(0.1) if lik == "gaussian" else ps.Bernoulli()
    if lik == "bernoulli":
        y = (y > 0).to(X.dtype)
    dgp = build_deep_gp(X, [2], likelihood, num_inducing=5, hidden_scale=0.1)
    elbo = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    before = [_qu(layer) for layer in dgp.layers]

    def bound():  # the closed-form estimate (Salimbeni's, hidden layers sampled) on fixed draws: common numbers
        torch.manual_seed(11)
        with torch.no_grad():
            return dgp.analytic_elbo(X, y, num_samples=256).item()

    start = bound()
    many = TraceMeanField_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=2)
    SVI(dgp.model, dgp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}), natgrad=0.05), many).step(X, y)
    for layer, b in zip(dgp.layers, before, strict=True):  # Adam with lr 0 moves nothing: natural steps did
        # (the hidden layer's mean has a zero gradient at this start, where the last layer's mean is zero)
        assert not torch.allclose(layer.q_u.u_scale_tril @ layer.q_u.u_scale_tril.mT, b[1]), layer.name
    # what a small step along the natural gradient of the bound must do, hyperparameters fixed, same (full) batch:
    # raise the bound (by 4-7 nats here with the Bernoulli likelihood, 150-200 with the Gaussian; measured on common
    # draws, whose difference is far less noisy than either value)
    assert bound() > start + 0.5, (start, bound())
    svi = SVI(dgp.model, dgp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.05), elbo)
    steps = 20 if lik == "gaussian" else 30
    losses = [svi.step(X, y) for _ in range(steps)]
    assert all(math.isfinite(v) for v in losses)
    for layer, b in zip(dgp.layers, before, strict=True):
        assert _changed(layer.q_u, b), layer.name
        assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())


@pytest.mark.float64
def test_a_length_one_step_on_a_deep_gps_last_layer_lands_on_its_dense_optimum():
    """``DeepGP(marginalize_last=True)`` under ``TraceMeanField_ELBO``: the last layer's u integrated out of the
    Gaussian likelihood and its KL analytic, so given the hidden layer's output the ELBO is the last layer's closed-form
    bound. With a deterministic hidden layer (identity mean, kernel variance 1e-14: its output is X to 1e-7) the plain
    step of length 1 on the last layer's q(u) alone lands on the optimum computed densely at the inputs X (Hensman,
    Fusi, Lawrence 2013, section 2)."""
    X, y = _data()
    hidden = ps.SVGP(RBF(D, variance=torch.tensor(1e-14)), X[:4].clone(), num_outputs=D,
                     mean_function=ps.mean_functions.Identity(), name="hidden")
    last = _gp(True)
    dgp = DeepGP([hidden, last], marginalize_last=True)
    optim = NaturalGradient(pyro.optim.Adam({"lr": 0.0}), natgrad=ps.infer.NaturalPolicy(lr=1.0, retraction=False),
                            families=[last.q_u])
    before = _qu(last)
    SVI(dgp.model, dgp.guide, optim, TraceMeanField_ELBO(max_plate_nesting=2)).step(X, y)
    m, S = _dense_optimum(last, X, y)
    assert not torch.allclose(before[0], m, atol=1e-2)  # the step had work to do
    mq, Sq = _qu(last)
    torch.testing.assert_close(mq, m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Sq, S, rtol=1e-5, atol=1e-5)


def test_the_step_length_and_the_wrapped_optimiser_are_checked():
    adam = pyro.optim.Adam({"lr": 0.01})
    for bad in (0.0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            NaturalGradient(adam, natgrad=bad)
    with pytest.raises(ValueError, match="pass that optimiser to SVI itself"):  # not fit's "leave natgrad_lr=None"
        NaturalGradient(adam, natgrad=None)
    assert repr(NaturalGradient(adam, 0.1)) == "NaturalGradient(Adam, natgrad=0.1)"  # the wrapped torch class
    assert "retraction=False" in repr(NaturalGradient(adam, ps.infer.NaturalPolicy(lr=0.1, retraction=False)))
    for bad in (torch.optim.Adam, {"lr": 0.01}, None, NaturalGradient(adam, 0.1)):
        with pytest.raises(TypeError, match="pyro.optim.PyroOptim"):
            NaturalGradient(bad, natgrad=0.1)


def test_a_family_with_a_gradient_in_its_mean_only_is_refused():
    X, y = _data()
    gp = _gp(integrate_f=True)
    gp.q_u.u_scale_tril_unconstrained.requires_grad_(False)
    svi = SVI(gp.model, gp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1), Trace_ELBO())
    with pytest.raises(ValueError, match="u_scale_tril"):
        svi.step(X, y)


def test_families_left_out_go_to_the_wrapped_optimiser():
    X, y = _data()
    gp = _gp(integrate_f=True)
    before = _qu(gp)
    SVI(gp.model, gp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}), 1.0, families=[]), Trace_ELBO()).step(X, y)
    torch.testing.assert_close(_qu(gp)[0], before[0])  # Adam with lr 0: no natural step was taken


def test_the_wrapped_optimisers_state_round_trips(tmp_path):
    with pyro.settings.context(module_local_params=False):  # PyroOptim names its states by the global store
        X, y = _data()
        gp = DeepGP([_gp()], marginalize_last=True)  # exact gradients of q(u): no damping at any step length
        opt = NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
        svi = SVI(gp.model, gp.guide, opt, TraceMeanField_ELBO())
        for _ in range(3):
            svi.step(X, y)
        state = opt.get_state()
        steps = {name: int(s["state"][0]["step"]) for name, s in state.items()}  # torch shares the state's tensors
        assert set(steps.values()) == {3}
        assert state and all(".q_u." not in name for name in state)  # q(u) is not Adam's
        assert any(name.endswith("lengthscale") for name in state)
        opt.save(tmp_path / "opt.pt")
        for restore in ("set_state", "load"):
            other = NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
            if restore == "set_state":
                other.set_state(copy.deepcopy(state))
            else:
                other.load(tmp_path / "opt.pt")
            SVI(gp.model, gp.guide, other, TraceMeanField_ELBO()).step(X, y)  # consumes the waiting states
            got = other.get_state()
            assert got.keys() == state.keys()
            for name in state:
                assert int(got[name]["state"][0]["step"]) == steps[name] + 1  # resumed, not restarted


@pytest.mark.parametrize("odvgp", [False, True], ids=["solvegp", "odvgp"])
def test_solvegp_families_take_natural_steps_and_odvgps_mean_goes_to_the_wrapped_optimiser(odvgp):
    """SOLVE-GP: q(u) and the full-covariance q(v⊥) both take a natural step (the factors' own steps, as fit does
    with a Pyro ELBO) although the wrapped Adam has lr 0; ODVGP's mean-only q(v⊥) is no such family: it stays with
    the wrapped optimiser (lr 0: unchanged) while q(u) takes its step."""
    X, y = _data()
    g = torch.Generator(torch.get_default_device()).manual_seed(5)
    O = (torch.rand(4, D, generator=g) * 4 - 2).to(X.dtype)
    gp = ps.SOLVEGP(RBF(D), _gp().Z, O, ps.Gaussian(0.1), integrate_f=True, odvgp=odvgp)
    before = {name: _qu_or_mean(getattr(gp, name)) for name in ("q_u", "q_v")}
    elbo = TraceMeanField_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)
    SVI(gp.model, gp.guide, NaturalGradient(pyro.optim.Adam({"lr": 0.0}), natgrad=0.05), elbo).step(X, y)
    assert _changed(gp.q_u, before["q_u"])
    if odvgp:
        torch.testing.assert_close(gp.q_v.u_loc, before["q_v"][0])
    else:
        assert _changed(gp.q_v, before["q_v"])


def _qu_or_mean(q):
    return _qu(q) if q.learn_scale else (q.u_loc.detach().clone(), None)


@pytest.mark.float64
@STORES
def test_with_num_obs_the_noise_takes_fits_fisher_step(store):
    """NaturalGradient(..., num_obs=N) steps a learnable Gaussian noise as fit does (noise_step_from_grads_): one SVI
    step equals one fit step with elbo=TraceMeanField_ELBO() (deterministic here: u integrated out of the likelihood)
    in q(u), the noise and the kernel; without num_obs the noise is Adam's (it moves by about Adam's lr in log-space,
    far less than the Fisher step of length 1, which lands on the optimum S/n given q(f))."""
    X, y = _data()
    runs = {}
    for how in ("optim", "fit", "adam"):
        dgp = DeepGP([_gp(noise=0.5)], marginalize_last=True)
        if how == "fit":
            fit(dgp, X, y, num_steps=1, batch_size=N, lr=0.01, natgrad=1.0, elbo=TraceMeanField_ELBO(),
                progress=False)
        else:
            opt = NaturalGradient(pyro.optim.Adam({"lr": 0.01}), 1.0, num_obs=N if how == "optim" else None)
            SVI(dgp.model, dgp.guide, opt, TraceMeanField_ELBO()).step(X, y)
        gp = dgp.last
        runs[how] = (*_qu(gp), gp.likelihood.noise.detach().clone(), gp.kernel.lengthscale.detach().clone())
    for got, want in zip(runs["optim"], runs["fit"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(math.log(runs["adam"][2] / 0.5)) < 0.02 < abs(math.log(runs["optim"][2] / 0.5))
    for bad in (0, True):  # True is an int to Python, not a number of observations
        with pytest.raises(ValueError, match="num_obs"):
            NaturalGradient(pyro.optim.Adam({"lr": 0.01}), 0.1, num_obs=bad)
