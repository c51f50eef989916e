"""Deep convolutional GP layers: shapes under particle dims, the identity-convolution mean, per-location sampling
against an SVGP on explicitly sliced patches, and the deep model's ELBO under vectorised particles."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from gradient_checks import assert_gradients, parameter_gradients
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp import ConvLayer, DeepConvGP
from pyro_sparsegp.conv import log_likelihood_and_accuracy
from pyro_sparsegp.inducing import init_patches
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.training.steps import _default_elbo
from pyro_sparsegp.variational import GaussianQ

H, W, C = 7, 6, 2


def _hidden(solve=False, C_out=3, mean="identity", M=5):
    d = 3 * 3 * C
    Z = torch.randn(M, d)
    O = torch.randn(4, d) if solve else None  # noqa: E741
    return ConvLayer(RBF(d, lengthscale=torch.tensor(2.0)), (H, W, C), 3, 1, C_out, Z, O, mean=mean, name="h")


def _deep(solve=False):
    hidden = _hidden(solve, C_out=2)  # -> 5 x 4 x 2
    k = ps.TICK(RBF(2 * 2 * 2, lengthscale=torch.tensor(2.0)), hidden.output_image_shape, 2, 2)
    Z = ps.IndexedInducingPatches(torch.randn(6, k.patch_dim), grid=k.grid)
    lik = ps.RobustMax(3)
    if solve:
        O = ps.IndexedInducingPatches(torch.randn(4, k.patch_dim), grid=k.grid)  # noqa: E741
        out = ps.SOLVEGP(k, Z, O, lik, num_outputs=3, whiten=False, integrate_f=True, name="out")
    else:
        out = ps.SVGP(k, Z, lik, num_outputs=3, whiten=False, integrate_f=True, name="out")
    return DeepConvGP([hidden], out)


def test_identity_conv_mean_is_the_centre_pixel():
    X = torch.randn(4, H * W * C)
    img = X.reshape(4, H, W, C)
    same = _hidden(C_out=C)
    centre = img[:, 1 : H - 1, 1 : W - 1, :]  # 3x3 patches, stride 1: centres at rows/cols 1..H-2
    torch.testing.assert_close(same.mean_function(X), centre.reshape(4, -1, C))
    other = _hidden(C_out=3)
    mixed = centre.mean(-1, keepdim=True).expand(4, 5, 4, 3).reshape(4, 20, 3)
    torch.testing.assert_close(other.mean_function(X), mixed)
    assert (_hidden(mean="zero").mean_function(X) == 0).all()


@pytest.mark.parametrize("solve", [False, True], ids=["svgp", "solvegp"])
def test_hidden_layer_samples_are_svgp_marginals_on_patches(solve):
    layer = _hidden(solve)
    X = torch.randn(3, H * W * C)
    with torch.no_grad(), pyro.poutine.block():
        uv = layer.sample_u(guide=True)
        torch.manual_seed(5)
        F = layer.sample(X, uv)  # [B, P*C_out]
        # independent computation: the GP's marginals of p(f | u) at patches sliced by hand
        img = X.reshape(3, H, W, C)
        pats = torch.stack([img[:, r : r + 3, c : c + 3, :].reshape(3, -1) for r in range(H - 2) for c in range(W - 2)],
                           1)  # [B, P, d]
        loc, var = layer.gp.moments(pats.reshape(-1, pats.shape[-1]), uv, consume=False)  # [C_out, B*P]
        torch.manual_seed(5)
        f = loc + var.sqrt() * torch.randn(loc.shape)
    expect = f.reshape(3, 3, 20).permute(1, 2, 0) + layer.mean_function(X)  # [B, P, C_out]
    torch.testing.assert_close(F, expect.reshape(3, 60))
    assert layer.output_dim == 60 and layer.output_image_shape == (5, 4, 3)


@pytest.mark.parametrize("solve", [False, True], ids=["svgp", "solvegp"])
def test_deep_conv_shapes_under_particle_dims_and_every_parameter_learns(solve):
    gp = _deep(solve)
    X, y = torch.randn(6, H * W * C), torch.randint(0, 3, (6,)).to(torch.get_default_dtype())
    S = 4
    trace = pyro.poutine.trace(pyro.plate("particles", S, dim=-3)(gp.guide)).get_trace(X, y, num_data=30)
    assert trace.nodes["h.u"]["value"].shape == (S, 2, 1, 5)
    with pyro.poutine.block(), pyro.plate("particles", S, dim=-3):
        u = gp.hidden[0].sample_u(guide=True)
        Hs = gp.hidden[0].sample(X, u)
    assert Hs.shape == (S, 1, 6, 5 * 4 * 2)  # the outputs' plate dimension stays as a singleton
    for elbo in (Trace_ELBO, TraceMeanField_ELBO):
        loss = elbo(num_particles=S, vectorize_particles=True, max_plate_nesting=2).differentiable_loss(
            gp.model, gp.guide, X, y, num_data=30)
        assert torch.isfinite(loss)
    loss.backward()
    assert_gradients(parameter_gradients(gp))
    probs = gp.predict_proba(X, num_samples=3)  # the mixture's average over 3 samples
    assert probs.shape == (6, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    ll, acc = log_likelihood_and_accuracy(probs, y)
    assert ll < 0 and 0 <= acc <= 1


def test_deep_model_checks_its_output_layer():
    hidden = _hidden(C_out=2)
    k = ps.ConvKernel(RBF(8), hidden.output_image_shape, 2, 2)
    out = ps.SVGP(k, ps.InducingPatches(torch.randn(4, 8)), ps.RobustMax(3), num_outputs=3, integrate_f=True)
    with pytest.raises(ValueError, match="TICK"):
        DeepConvGP([hidden], out)


def test_init_patches_are_kmeans_centres_of_image_patches():
    X = torch.rand(30, H * W * C)
    Z = init_patches(X, (H, W, C), 3, 8, num_images=20, per_centre=10)
    assert Z.shape == (8, 18) and torch.isfinite(Z).all()
    # every centre lies within the range of the pixels (a convex combination of patches, plus a tiny jitter)
    assert Z.min() > -0.01 and Z.max() < 1.01


def _deep_for_estimators(single_location, solve):
    """A deep conv GP with random q means. ``single_location``: the hidden patch is the whole image (one output
    location), so an image's output depends on one hidden location and marginal sampling is exact. Otherwise the
    hidden q(u) is collapsed to (almost) a point mass, so the locations are independent given the fixed u."""
    ph, pw = (H, W) if single_location else (3, 3)
    d = ph * pw * C
    O = torch.randn(3, d) if solve else None  # noqa: E741
    hidden = ConvLayer(RBF(d, lengthscale=torch.tensor(3.0)), (H, W, C), (ph, pw), 1, 2, torch.randn(4, d), O,
                       name="h")
    p_out = 1 if single_location else 2
    k = ps.TICK(RBF(2 * p_out * p_out, lengthscale=torch.tensor(2.0)), hidden.output_image_shape, p_out, 1)
    Z = ps.IndexedInducingPatches(torch.randn(5, k.patch_dim), grid=k.grid)
    out = ps.SVGP(k, Z, ps.RobustMax(3), num_outputs=3, whiten=False, integrate_f=True, name="out")
    gp = DeepConvGP([hidden], out)
    with torch.no_grad():
        for q in [hidden.gp.q_u] + ([hidden.gp.q_v] if solve else []):
            q.u_loc = torch.randn_like(q.u_loc)
            if not single_location:
                q.u_scale_tril = q.u_scale_tril * 1e-6
        out.q_u.u_loc = torch.randn_like(out.q_u.u_loc)
    return gp


@pytest.mark.parametrize("solve", [False, True], ids=["svgp", "solvegp"])
@pytest.mark.parametrize("single_location", [True, False], ids=["one-location", "point-mass-u"])
def test_deep_conv_analytic_elbo_estimates_the_trace_elbo_bound(single_location, solve):
    """``analytic_elbo`` (hidden marginals, u integrated out, quadrature at the output) and ``Trace_ELBO`` on
    model/guide (every u sampled) estimate the same bound wherever the u-induced correlation between hidden locations
    cannot matter: 8 replicates of 2,500 samples each agree within 4 standard errors computed from the replicates."""
    pyro.set_rng_seed(0)
    torch.manual_seed(0)
    gp = _deep_for_estimators(single_location, solve)
    X, y = torch.randn(6, H * W * C), torch.randint(0, 3, (6,)).to(torch.get_default_dtype())
    S, R = 2500, 8
    elbo = TraceMeanField_ELBO(num_particles=S, vectorize_particles=True, max_plate_nesting=2)
    with torch.no_grad():
        analytic = torch.tensor([float(gp.analytic_elbo(X, y, num_data=30, num_samples=S)) for _ in range(R)])
        trace = torch.tensor([-float(elbo.differentiable_loss(gp.model, gp.guide, X, y, num_data=30))
                              for _ in range(R)])
    se = math.sqrt(analytic.var() / R + trace.var() / R)
    assert se > 0 and abs(analytic.mean() - trace.mean()) < 4 * se, (analytic.mean(), trace.mean(), se)


@pytest.mark.float64
@pytest.mark.parametrize("solve", [False, True], ids=["svgp", "solvegp"])
@pytest.mark.parametrize("single_location", [True, False], ids=["one-location", "point-mass-u"])
def test_deep_conv_analytic_elbo_gives_every_parameter_a_gradient(single_location, solve):
    """Every parameter gets a gradient from the estimator that ``fit`` maximises by default, except one whose true
    gradient is zero: over a single output location the TICK weight only scales ``f`` (``Kfu`` by ``w``, ``Kff`` by
    ``w^2``, the inducing variables live in patch space), and robust-max's ``P(argmax f = y)`` is invariant to a
    positive scale of ``f``, so the bound does not depend on it; its gradient is round-off (``-5e-14`` or ``0.0``
    by machine), checked below the floor of :mod:`gradient_checks`. float64: the hidden layer's true gradients
    (``~1e-6`` beside ``~500`` at the output) sit below float32's round-off floor."""
    pyro.set_rng_seed(0)
    gp = _deep_for_estimators(single_location, solve)
    X, y = torch.randn(6, H * W * C), torch.randint(0, 3, (6,)).to(torch.get_default_dtype())
    gp.analytic_elbo(X, y, num_data=30).backward()
    zero = {"layers.1.kernel.weights_unconstrained": "one location: robust-max is invariant to f's scale"}
    assert_gradients(parameter_gradients(gp), zero if single_location else None)


def test_fit_trains_a_deep_conv_gp_on_its_analytic_elbo():
    pyro.set_rng_seed(0)
    gp = _deep()
    X = torch.randn(40, H * W * C)
    y = (X[:, :10].sum(-1) > 0).to(torch.get_default_dtype()) + (X[:, 10:20].sum(-1) > 0)
    assert _default_elbo(gp) == "analytic"
    state = fit(gp, X, y, num_steps=60, batch_size=20, lr=0.05, progress=False)
    first, last = sum(state.losses[:10]) / 10, sum(state.losses[-10:]) / 10
    assert last < first
    with pytest.raises(ValueError, match="num_samples"):
        DeepConvGP(list(gp.hidden), gp.output, num_samples=0)
    with pytest.raises(ValueError, match=r"D = 84 features \(the first layer.s inputs\)"):
        gp.analytic_elbo(X[:, :-1], y)
    # a PyroSample hyperparameter has no value outside a Pyro program: the closed-form estimator says so loudly
    # (rather than drawing it from the prior at every read); model/guide under SVI remain the way to train it
    gp.hidden[0].gp.kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    with pytest.raises(ValueError, match="PyroSample"):
        fit(gp, X, y, num_steps=1, batch_size=20, progress=False)


@pytest.mark.parametrize("solve", [False, True], ids=["svgp", "solvegp"])
def test_fit_takes_natural_steps_on_every_deep_conv_layer(solve):
    """``fit(..., natgrad=ps.infer.NaturalPolicy(layers="all"))`` on a deep conv GP: the SOLVE-GP layers whose ``q(u)``
    and ``q(v⊥)`` both take natural steps are the GP layers that own an orthogonal strategy (the hidden layer's GP over
    patches and the output layer), never the ConvLayer that exposes its GP's strategy; one small step from the start
    (full batch, hyperparameters held) moves every ``q``, leaves nothing NaN and raises the closed-form bound on common
    draws."""
    from pyro_sparsegp.infer.natgrad import natgrad_pairs

    gp = _deep(solve)
    families = [m for m in gp.modules() if isinstance(m, GaussianQ) and m.learn_scale]
    pairs = natgrad_pairs(gp, families)
    assert pairs == ([gp.hidden[0].gp, gp.output] if solve else [])
    X, y = torch.rand(12, H * W * C), torch.randint(0, 3, (12,)).to(torch.get_default_dtype())
    before = [q.u_loc.detach().clone() for q in families]

    def bound():  # the closed-form estimate on 24 fixed sets of draws (common random numbers before and after)
        with torch.no_grad():
            return torch.tensor([(torch.manual_seed(seed), gp.analytic_elbo(X, y, num_samples=64).item())[1]
                                 for seed in range(24)], dtype=torch.float64)

    start = bound()
    # one small step on the full batch, the hyperparameters held (Adam at lr 1e-12), from the hidden layers on, its
    # gradient from 64 samples through the hidden layers (the default's few would leave the hidden steps' noise)
    gp.num_samples = 64
    fit(gp, X, y, num_steps=1, batch_size=12, lr=1e-12, natgrad=ps.infer.NaturalPolicy(
        lr=0.1, warmup=0, layers="all", hidden_start=0), progress=False)
    for q, b in zip(families, before, strict=True):
        assert torch.isfinite(q.u_loc).all() and not torch.equal(q.u_loc.detach(), b)
    rise = bound() - start  # [24]: the same draws before and after
    # a small natural step raises the bound, by more than 4 standard errors of the paired differences (measured:
    # 0.0055 +- 0.0006 nats for the svgp layers, 0.46-2.5 elsewhere)
    assert rise.mean() > 4 * rise.std() / math.sqrt(len(rise)), rise
