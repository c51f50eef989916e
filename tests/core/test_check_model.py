"""``ps.check_model`` and the automatic checks of ``fit`` and ``NaturalGradient`` (issue 46, item 2): shape mistakes
that Pyro accepts silently (an observed site broadcast against the vectorised particles, a minibatch site without
its scale, a layer's site outside its plate) raise :class:`ps.ModelShapeError` naming the site and its shape; correct
programs pass unchanged and train.

The premise of each mistake is checked independently of the checker: the ELBO of the wrong program counts the
observations several times (its ``y`` term is that many times the corrected program's on the same draws)."""

import random

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroModule, PyroSample, pyro_method

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import FixedProjection

N, B = 64, 16
W = [[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]]  # an LMC mixing matrix: 3 tasks from 2 latent GPs


def _vectorised(num_particles=4):
    return Trace_ELBO(num_particles=num_particles, vectorize_particles=True, max_plate_nesting=2)


# -- the two real mistakes, and their corrections: how y is observed given a layer's f [..., L, B] ---------------------
def squeeze_wrong(gp, f, yb):
    pyro.sample("y", dist.Normal(f.squeeze(), 0.1), obs=yb)  # f [P, 1, B] -> [P, B]: the particles move to dim -2


def squeeze_right(gp, f, yb):
    with gp.outputs_plate():
        pyro.sample("y", dist.Normal(f, 0.1), obs=yb)  # [P, 1, B]: the outputs plate covers dim -2


def lmc_wrong(gp, f, yb):
    F = torch.einsum("pl,...lb->...bp", torch.tensor(W), f)  # [P, B, 3]
    pyro.sample("y", dist.Normal(F, 0.1).to_event(1), obs=yb)  # batch [P, B]: the particles at dim -2


def lmc_right(gp, f, yb):
    F = torch.einsum("pl,...lb->...pb", torch.tensor(W), f)  # [P, 3, B]
    with pyro.plate("tasks", len(W), dim=-2):
        pyro.sample("y", dist.Normal(F, 0.1), obs=yb.mT)  # y [3, B] in its own outputs plate


MISTAKES = {"squeeze": (squeeze_wrong, squeeze_right, None), "lmc": (lmc_wrong, lmc_right, 2)}


class Program(PyroModule):
    """A hand-written model/guide around one layer; ``observe(gp, f, yb)`` registers ``y``. ``fit`` calls it with
    ``num_data``, SVI with ``subsample_size``."""

    def __init__(self, gp, observe):
        super().__init__()
        self.gp, self.observe = gp, observe

    def _plate(self, X, subsample_size, num_data):
        if num_data is not None:
            return pyro.plate("data", num_data, subsample=torch.arange(len(X)))
        return pyro.plate("data", len(X), subsample_size=subsample_size)

    @pyro_method
    def model(self, X, y, subsample_size=None, num_data=None):
        u = self.gp.sample_u()
        with self._plate(X, subsample_size, num_data) as i:
            self.observe(self.gp, self.gp.sample_f(X[i], u), y[i])

    @pyro_method
    def guide(self, X, y, subsample_size=None, num_data=None):
        u = self.gp.sample_u(guide=True)
        with self._plate(X, subsample_size, num_data) as i:
            self.gp.sample_f(X[i], u, guide=True)


def _program(kind, right):
    wrong_fn, right_fn, L = MISTAKES[kind]
    X = torch.randn(N, 2)
    g = torch.stack([X.sum(-1).sin(), X[:, 0]], -1)  # two latent functions [N, 2]
    y = g[:, 0] if L is None else g @ torch.tensor(W).T  # [N] or [N, 3]
    gp = ps.SVGP(RBF(2), X[:6].clone(), num_outputs=1 if L is None else L)
    return Program(gp, right_fn if right else wrong_fn), X, y


def _state(*modules):
    return [p.detach().clone() for m in modules for p in m.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_the_mistakes_count_the_data_several_times(kind):
    """The premise, independently of the checker: on the same draws of the guide, the wrong program's y term is
    P times the corrected one's (P = 4 vectorised particles), which Pyro's own shape check lets through."""
    wrong, X, y = _program(kind, right=False)
    right = Program(wrong.gp, MISTAKES[kind][1])
    P = 4
    with pyro.plate("num_particles_vectorized", P, dim=-3):
        guide_trace = poutine.trace(wrong.guide).get_trace(X, y, subsample_size=B)
        terms = []
        for prog in (wrong, right):
            tr = poutine.trace(poutine.replay(prog.model, trace=guide_trace)).get_trace(X, y, subsample_size=B)
            tr.compute_log_prob()
            terms.append(tr.nodes["y"]["log_prob_sum"])
            pyro.util.check_site_shape(tr.nodes["y"], max_plate_nesting=3)  # Pyro accepts both
    torch.testing.assert_close(terms[0], P * terms[1])


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_check_model_raises_on_the_mistakes(kind):
    prog, X, y = _program(kind, right=False)
    rng = torch.get_rng_state(), random.getstate()
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(3, 3, 16\), expected \(3, 1, 16\)") as err:
        ps.check_model(prog.model, prog.guide, X, y, subsample_size=B)  # plainly, then under 3 particles
    assert torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.getstate()  # restored on failure too
    assert err.value.sites == ["y"]
    assert "counted 3 times" in str(err.value) and "vectorised particles" in str(err.value)
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(8, 8, 16\)"):
        ps.check_model(prog.model, prog.guide, X, y, subsample_size=B, elbo=_vectorised(8))
    # without vectorised particles the program is right, and checked in that configuration it passes
    assert ps.check_model(prog.model, prog.guide, X, y, subsample_size=B, elbo=Trace_ELBO()) is None


def test_the_squeeze_message_names_the_fix():
    prog, X, y = _program("squeeze", right=False)
    with pytest.raises(ps.ModelShapeError) as err:
        ps.check_model(prog.model, prog.guide, X, y, subsample_size=B)
    msg = str(err.value)
    assert "Do not squeeze the outputs dimension" in msg and f"layer {prog.gp.name!r}" in msg, msg
    assert "f[..., :1, :]" in msg


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_fit_raises_on_the_mistakes_before_training(kind):
    prog, X, y = _program(kind, right=False)
    before = _state(prog)
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(4, 4, 16\)"):
        ps.infer.fit(prog, X, y, num_steps=5, batch_size=B, elbo=_vectorised(4), progress=False)
    assert _same(before, _state(prog))


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_natural_gradient_raises_at_the_first_step(kind):
    prog, X, y = _program(kind, right=False)
    before = _state(prog)
    optim = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
    svi = SVI(prog.model, prog.guide, optim, _vectorised(4))
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(4, 4, 16\)"):
        svi.step(X, y, subsample_size=B)
    assert _same(before, _state(prog))  # raised before any update


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_the_corrected_programs_pass_and_train(kind):
    prog, X, y = _program(kind, right=True)
    before, rng = _state(prog), torch.get_rng_state()
    assert ps.check_model(prog.model, prog.guide, X, y, subsample_size=B) is None
    assert ps.check_model(prog.model, prog.guide, X, y, subsample_size=B, elbo=_vectorised(8)) is None
    assert _same(before, _state(prog)) and torch.equal(rng, torch.get_rng_state())
    optim = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
    svi = SVI(prog.model, prog.guide, optim, _vectorised(4))
    losses = [svi.step(X, y, subsample_size=B) for _ in range(15)]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert not ps.checks.program._WAITING and not ps.checks.program._RECORDS[0]  # nothing recorded after the first step
    state = ps.infer.fit(prog, X, y, num_steps=15, batch_size=B, elbo=_vectorised(4), progress=False)
    assert sum(state.losses[-5:]) < sum(state.losses[:5]), state.losses


# -- correct programs of each kind pass unchanged ---------------------------------------------------------------------
def _params_and_rng(*modules):
    return _state(*modules), torch.get_rng_state(), random.getstate()


def _unchanged(snapshot, *modules):
    params, rng, py = snapshot
    return _same(params, _state(*modules)) and torch.equal(rng, torch.get_rng_state()) and py == random.getstate()


@pytest.mark.parametrize("layer", ["svgp", "svgp L=2", "solvegp", "robustmax", "softmax"])
def test_the_layers_own_programs_pass(layer):
    X = torch.randn(N, 2)
    y = X.sum(-1).sin()
    if layer == "svgp":
        gp = ps.SVGP(RBF(2), X[:6].clone(), ps.Gaussian(0.1))
    elif layer == "svgp L=2":
        gp, y = ps.SVGP(RBF(2), X[:6].clone(), ps.Gaussian(0.1), num_outputs=2), torch.stack([y, X[:, 0]], -1)
    elif layer == "solvegp":
        gp = ps.SOLVEGP(RBF(2), X[:4].clone(), X[4:8].clone(), ps.Gaussian(0.1))
    else:  # multi-class: y [..., 1, B], the classes' dimension a singleton
        lik = ps.RobustMax(3) if layer == "robustmax" else ps.Softmax(3, num_samples=8)
        gp, y = ps.SVGP(RBF(2), X[:6].clone(), lik), (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    snapshot = _params_and_rng(gp)
    assert ps.check_model(gp.model, gp.guide, X, y, subsample_size=B) is None
    assert ps.check_model(gp.model, gp.guide, X, y, subsample_size=B,
                          elbo=TraceMeanField_ELBO(num_particles=5, vectorize_particles=True)) is None
    assert _unchanged(snapshot, gp)


def test_a_deep_gp_by_hand_passes_and_trains():
    """README, "A two-layer deep GP by hand", under its ELBO (5 vectorised particles, max_plate_nesting=2)."""
    X = torch.randn(N, 3)
    y = X[:, 0].sin() + X[:, 1]
    Z = X[:8].clone()
    hidden = ps.SVGP(RBF(3), Z, num_outputs=2, mean_function=FixedProjection.from_pca(X, 2), name="h")
    out = ps.SVGP(RBF(2), hidden.mean_function(Z), ps.Gaussian(0.1), name="out")

    def model(X, y):
        u1, u2 = hidden.sample_u(), out.sample_u()
        with pyro.plate("data", len(X), subsample_size=B) as i:
            h = hidden.sample_hidden(X[i], u1)
            pyro.sample("y", out.likelihood.distribution(out.sample_f(h, u2)), obs=y[i])

    def guide(X, y):
        u1, u2 = hidden.sample_u(guide=True), out.sample_u(guide=True)
        with pyro.plate("data", len(X), subsample_size=B) as i:
            out.sample_f(hidden.sample_hidden(X[i], u1, guide=True), u2, guide=True)

    elbo = TraceMeanField_ELBO(num_particles=5, vectorize_particles=True, max_plate_nesting=2)
    snapshot = _params_and_rng(hidden, out)
    assert ps.check_model(model, guide, X, y) is None
    assert ps.check_model(model, guide, X, y, elbo=elbo) is None
    assert _unchanged(snapshot, hidden, out)
    svi = SVI(model, guide, ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.01), elbo)
    losses = [svi.step(X, y) for _ in range(3)]  # the first step checks the program: it passes
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_hyperprior_with_an_autoguide_passes_and_trains():
    """README: a PyroSample hyperprior, AutoGuideList(create_plates=...) with an AutoNormal before the layer's guide."""
    X = torch.randn(N, 2)
    y = X.sum(-1).sin()
    k = RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
    hgp = ps.SVGP(k, X[:6].clone(), ps.Gaussian(0.1), name="hgp")
    guide = AutoGuideList(hgp.model, create_plates=hgp.create_plates)
    guide.append(AutoNormal(poutine.block(hgp.model, expose=["hgp.kernel.lengthscale"])))
    guide.append(hgp.guide)
    poutine.trace(guide).get_trace(X, y, subsample_size=B)  # the autoguide's parameters exist
    snapshot = _params_and_rng(hgp, guide)
    assert ps.check_model(hgp.model, guide, X, y, subsample_size=B) is None
    assert _unchanged(snapshot, hgp, guide)
    optim = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
    svi = SVI(hgp.model, guide, optim, TraceMeanField_ELBO(num_particles=4, vectorize_particles=True))
    losses = [svi.step(X, y, subsample_size=B) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))


# -- an unscaled minibatch site, a layer's site outside its plate ---------------------------------------------------
def _one_layer(X):
    return ps.SVGP(RBF(2), X[:6].clone(), name="g")


@pytest.mark.parametrize("how", ["plate of size B", "no plate", "scaled"])
def test_an_unscaled_minibatch_site_raises(how):
    X = torch.randn(N, 2)
    y = X.sum(-1)
    gp = _one_layer(X)

    def program(guide):
        def run(X, y):
            u = gp.sample_u(guide=guide)
            with pyro.plate("data", N, subsample_size=B) as i:
                f = gp.sample_f(X[i], u, guide=guide)
            if guide:
                return
            if how == "plate of size B":  # a plate over the minibatch only: scale 1 where the layer's is N/B
                with pyro.plate("obs", B):
                    pyro.sample("y", dist.Normal(f, 0.1), obs=y[i])
            else:
                with poutine.scale(scale=N / B if how == "scaled" else 1.0):
                    pyro.sample("y", dist.Normal(f, 0.1).to_event(1), obs=y[i])
        return run

    if how == "scaled":
        assert ps.check_model(program(False), program(True), X, y, elbo=Trace_ELBO()) is None
        return
    with pytest.raises(ps.ModelShapeError, match=r"'y'.*minibatch size 16 of plate 'data'.*scale 1") as err:
        ps.check_model(program(False), program(True), X, y, elbo=Trace_ELBO())
    assert "pyro.plate('data', 64, subsample=idx)" in str(err.value)
    assert err.value.sites == ["y"]


def test_a_layer_f_outside_any_plate_raises():
    X = torch.randn(N, 2)
    y = X.sum(-1)
    gp = _one_layer(X)

    def model(X, y):
        f = gp.sample_f(X[:B], gp.sample_u())
        pyro.sample("y", dist.Normal(f, 0.1).to_event(1), obs=y[:B])

    def guide(X, y):
        gp.sample_f(X[:B], gp.sample_u(guide=True), guide=True)

    with pytest.raises(ps.ModelShapeError, match=r"'g.f' \(model, shape \(16,\)\) is under no plate at dim -1") as err:
        ps.check_model(model, guide, X, y, elbo=Trace_ELBO())
    assert err.value.sites == ["g.f"] and "(guide, shape (16,))" in str(err.value)


def test_a_layer_u_inside_the_data_plate_raises():
    """With a minibatch of one point the layer's own alignment check cannot see u inside the data plate, where its
    KL would be scaled by N."""
    X = torch.randn(N, 2)
    y = X.sum(-1)
    gp = _one_layer(X)

    def program(guide):
        def run(X, y):
            with pyro.plate("data", N, subsample_size=1) as i:
                f = gp.sample_f(X[i], gp.sample_u(guide=guide), guide=guide)
                if not guide:
                    pyro.sample("y", dist.Normal(f, 0.1), obs=y[i])
        return run

    with pytest.raises(ps.ModelShapeError, match=r"'g.u' \(model, shape \(1, 6\)\) is inside plate 'data'") as err:
        ps.check_model(program(False), program(True), X, y, elbo=Trace_ELBO())
    assert err.value.sites == ["g.u"] and "sample_u() before entering the data plate" in str(err.value)


def test_natural_gradient_skips_a_program_without_layers():
    """A layer program traced while an optimiser waits (recorded), then SVI on a program with no layer: the record is
    another program's (none of SVI's parameters), so the first step does not check it."""
    prog, X, y = _program("squeeze", right=False)
    optim = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1)
    with pyro.plate("num_particles_vectorized", 4, dim=-3):
        guide_trace = poutine.trace(prog.guide).get_trace(X, y, subsample_size=B)
        poutine.trace(poutine.replay(prog.model, trace=guide_trace)).get_trace(X, y, subsample_size=B)
    assert "model" in ps.checks.program._RECORDS[0]

    def model(y):
        pyro.sample("y", dist.Normal(pyro.param("m", torch.zeros(())), 1.0).expand([len(y)]).to_event(1), obs=y)

    SVI(model, lambda y: None, optim, Trace_ELBO()).step(y)
    assert pyro.param("m").item() != 0.0 and not ps.checks.program._RECORDS[0]


def test_a_covered_dimension_of_another_size_raises():
    """A distribution whose ``expand`` ignores the plates (a user's class) keeps a batch of size 1 under a plate of
    16: the covered dimension does not have the plate's size."""

    class NoExpand(dist.Normal):
        def expand(self, batch_shape, _instance=None):
            return self

    X = torch.randn(N, 2)
    y = X.sum(-1)
    gp = _one_layer(X)

    def program(guide):
        def run(X, y):
            u = gp.sample_u(guide=guide)
            with pyro.plate("data", N, subsample_size=B) as i:
                f = gp.sample_f(X[i], u, guide=guide)
                if not guide:
                    pyro.sample("y", NoExpand(f.mean(-1, keepdim=True), 1.0).to_event(0), obs=y[i][:1])
        return run

    with pytest.raises(ps.ModelShapeError, match=r"'y'.*dim -1 has size 1 but its plate 'data' has size 16"):
        ps.check_model(program(False), program(True), X, y, elbo=Trace_ELBO())


def test_a_program_that_fails_only_under_the_checks_own_particles_says_so():
    """Without ``elbo=`` the check adds a pass under 3 vectorised particles; a program that cannot run there (here
    ``f.reshape(-1)``, right only for ``f [1, B]``) is reported with that context and the way out (``elbo=``)."""
    X = torch.randn(N, 2)
    y = X.sum(-1)
    gp = ps.SVGP(RBF(2), X[:6].clone(), num_outputs=1)

    def program(guide):
        def run(X, y):
            u = gp.sample_u(guide=guide)
            with pyro.plate("data", N, subsample_size=B) as i:
                f = gp.sample_f(X[i], u, guide=guide)
                if not guide:
                    pyro.sample("y", dist.Normal(f.reshape(-1), 0.1), obs=y[i])
        return run

    with pytest.raises(ps.ModelShapeError, match="fails under 3 vectorised particles") as err:
        ps.check_model(program(False), program(True), X, y)
    assert "elbo=Trace_ELBO()" in str(err.value) and err.value.__cause__ is not None
    assert ps.check_model(program(False), program(True), X, y, elbo=Trace_ELBO()) is None
