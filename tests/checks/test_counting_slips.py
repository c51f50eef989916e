"""The programs of issue 54 that ``check_model`` let through, and the rules added for them: a dimension left of the
plates and particles (an ``unsqueeze`` that lines a one-output ``f`` up with a two-output one: particles broadcast
against particles at dim -4), latent sites held to the same rules as observed ones, and the count of an observed
site's log-probability terms against its plates' sizes.

The premise of each slip is checked independently of the checker: on the same draws of the guide, the slipped
program's ``y`` term is 8 times the corrected one's (8 vectorised particles)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroModule, pyro_method

import pyro_sparsegp as ps

P = 8  # vectorised particles


def _elbo():
    return Trace_ELBO(num_particles=P, vectorize_particles=True)


class TwoLayers(PyroModule):
    """The issue's program: a layer with an outputs plate (``num_outputs=2``: ``max_plate_nesting=2``) and a
    one-output layer whose ``f`` the user ``unsqueeze(-2)``s to line it up with ``[..., 2, B]``."""

    def __init__(self, X, slip=True):
        super().__init__()
        self.two = ps.SVGP(RBF(2), X[:6].clone(), num_outputs=2, name="two")
        self.one = ps.SVGP(RBF(2), X[:6].clone(), name="one")
        self.slip = slip

    def _plate(self, X, num_data):
        n = len(X) if num_data is None else num_data
        return pyro.plate("data", n, subsample=torch.arange(len(X)))

    @pyro_method
    def model(self, X, y, num_data=None):
        u2, u1 = self.two.sample_u(), self.one.sample_u()
        with self._plate(X, num_data) as i:
            f2 = self.two.sample_f(X[i], u2)  # [..., 2, B]
            f1 = self.one.sample_f(X[i], u1)  # [B], or [P, 1, B] under the particles at dim -3
            f1 = f1.unsqueeze(-2) if self.slip else f1  # [1, B] plainly; [P, 1, 1, B] under the particles
            pyro.sample("y", dist.Normal(f2.sum(-2, keepdim=True) + f1, 0.1), obs=y[i])

    @pyro_method
    def guide(self, X, y, num_data=None):
        u2, u1 = self.two.sample_u(guide=True), self.one.sample_u(guide=True)
        with self._plate(X, num_data) as i:
            self.two.sample_f(X[i], u2, guide=True)
            self.one.sample_f(X[i], u1, guide=True)


class SleepStudy(PyroModule):
    """One GP per subject (``f [..., G, B]``, each point's row picked with ``gather``) beside a population GP, on a
    simulated panel (``G`` subjects, ``T`` days each), with the same slip on the population GP's ``f``."""

    def __init__(self, X, subject, G, slip=True):
        super().__init__()
        self.subjects = ps.SVGP(RBF(1), X[:4].clone(), num_outputs=G, name="subjects")
        self.population = ps.SVGP(RBF(1), X[:4].clone(), name="population")
        self.subject, self.slip = subject, slip

    @pyro_method
    def model(self, X, y):
        us, up = self.subjects.sample_u(), self.population.sample_u()
        with pyro.plate("data", len(X)) as i:
            fs = self.subjects.sample_f(X[i], us)  # [..., G, B]
            index = self.subject[i].expand(*fs.shape[:-2], 1, len(i))
            f_subject = fs.gather(-2, index)  # [..., 1, B]: each point's own subject
            fp = self.population.sample_f(X[i], up)
            fp = fp.unsqueeze(-2) if self.slip else fp
            pyro.sample("y", dist.Normal(f_subject + fp, 0.3), obs=y[i])

    @pyro_method
    def guide(self, X, y):
        us, up = self.subjects.sample_u(guide=True), self.population.sample_u(guide=True)
        with pyro.plate("data", len(X)) as i:
            self.subjects.sample_f(X[i], us, guide=True)
            self.population.sample_f(X[i], up, guide=True)


def _two_layers(slip=True):
    X = torch.randn(100, 2)
    y = X.sum(-1).sin() + 0.1 * torch.randn(100)
    return TwoLayers(X, slip), (X, y)


def _sleep_study(slip=True):
    G, T = 4, 6  # subjects, days
    days = torch.arange(T, dtype=torch.get_default_dtype()).repeat(G)
    subject = torch.arange(G).repeat_interleave(T)
    X = ((days - days.mean()) / days.std()).unsqueeze(-1)  # [G T, 1]
    y = 0.5 * X[:, 0] + 0.3 * torch.randn(G)[subject] + 0.1 * torch.randn(G * T)
    return SleepStudy(X, subject, G, slip), (X, y)


PROGRAMS = {"two layers": (_two_layers, (8, 8, 1, 100)), "sleep study": (_sleep_study, (8, 8, 1, 24))}


def _parts(prog, trace, X):
    """The two summands of y's mean per particle, ``[P, B]`` each, read from the trace's f sites."""
    if isinstance(prog, TwoLayers):
        return trace.nodes[f"{prog.two.name}.f"]["value"].sum(-2), trace.nodes[f"{prog.one.name}.f"]["value"][:, 0]
    fs = trace.nodes[f"{prog.subjects.name}.f"]["value"]  # [P, G, B]
    return fs[:, prog.subject, torch.arange(len(X))], trace.nodes[f"{prog.population.name}.f"]["value"][:, 0]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_slip_counts_the_data_once_per_pair_of_particles(name):
    """The premise, by hand: the slipped y term sums log N(y | a_i + b_j) over every pair (i, j) of particles, P^2 B
    terms (each observation counted P times per particle), where the corrected term has the P B of i = j. Pyro's
    shape check accepts it (dim -4 is left of its max_plate_nesting of 3)."""
    build, shape = PROGRAMS[name]
    prog, (X, y) = build()
    sd = 0.1 if isinstance(prog, TwoLayers) else 0.3
    with pyro.plate("num_particles_vectorized", P, dim=-3):
        tr = poutine.trace(prog.guide).get_trace(X, y)
        model = poutine.trace(poutine.replay(prog.model, trace=tr)).get_trace(X, y)
    model.compute_log_prob()
    pyro.util.check_site_shape(model.nodes["y"], max_plate_nesting=3)
    a, b = _parts(prog, model, X)
    pairs = dist.Normal(a[:, None, :] + b[None, :, :], sd).log_prob(y)  # [P, P, B]
    assert tuple(model.nodes["y"]["fn"].batch_shape) == shape and pairs.numel() == P * P * len(X)
    torch.testing.assert_close(model.nodes["y"]["log_prob_sum"], pairs.sum())


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_check_model_names_y_left_of_the_particles(name):
    build, shape = PROGRAMS[name]
    prog, args = build()
    expected = rf"site 'y': batch shape \({', '.join(map(str, shape))}\), expected \({', '.join(map(str, shape[1:]))}\)"
    for elbo in (_elbo(), None):  # in the ELBO's configuration, and in the default mode (3 particles)
        with pytest.raises(ps.ModelShapeError) as err:
            ps.check_model(prog.model, prog.guide, *args, elbo=elbo)
        assert err.value.sites == ["y"], str(err.value)
        assert "left of the particle dimension" in str(err.value) and "f.unsqueeze(-2)" in str(err.value)
    assert __import__("re").search(expected, str(_raised(prog, args)))
    prog.slip = False
    assert ps.check_model(prog.model, prog.guide, *args, elbo=_elbo()) is None
    assert ps.check_model(prog.model, prog.guide, *args) is None


def _raised(prog, args):
    try:
        ps.check_model(prog.model, prog.guide, *args, elbo=_elbo())
    except ps.ModelShapeError as e:
        return e
    raise AssertionError("no error")


def test_fit_and_natural_gradient_catch_the_two_layer_slip_before_training():
    prog, (X, y) = _two_layers()
    before = [p.detach().clone() for p in prog.parameters()]
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(8, 8, 1, 50\)"):
        ps.infer.fit(prog, X, y, num_steps=2, batch_size=50, elbo=_elbo(), progress=False)
    svi = SVI(prog.model, prog.guide, ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1), _elbo())
    with pytest.raises(ps.ModelShapeError, match=r"'y': batch shape \(8, 8, 1, 100\)"):
        svi.step(X, y)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, prog.parameters(), strict=True))


# -- the rules on their own ----------------------------------------------------------------------------------------
def _flat(observe, latent=None, guide_latent=None):
    """A program without layers: a global ``mu``, a local ``w`` in the data plate, ``y`` observed by ``observe``."""
    y = torch.randn(6)

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 6):
            w = pyro.sample("w", dist.Normal((latent or (lambda t: t))(mu + torch.zeros(6)), 1.0))
            observe(w, y)

    def guide():
        pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 6):
            pyro.sample("w", dist.Normal((guide_latent or (lambda t: t))(torch.zeros(6)), 1.0))

    return model, guide


def test_an_observed_value_with_more_dimensions_is_counted():
    """The distribution's batch is right but the observed value broadcasts it to (2, 6): twice the terms."""
    model, guide = _flat(lambda w, y: pyro.sample("y", dist.Normal(w, 1.0), obs=y.expand(2, 6)))
    with pytest.raises(ps.ModelShapeError, match=r"site 'y': batch shape \(2, 6\) \(the distribution's \(6,\) "
                                                 r"broadcast with the observed value.*12 log-probability terms per "
                                                 r"particle where its plates \('data' \(6\)\) give 6"):
        ps.check_model(model, guide, elbo=Trace_ELBO())


@pytest.mark.parametrize("where", ["model", "guide"])
def test_a_latent_site_left_of_the_plates_raises(where):
    """An expand on a latent site's loc: the model's prior of w (or the guide's q(w)) is counted twice."""
    def two(t):
        return t.expand(2, *t.shape)

    model, guide = _flat(lambda w, y: pyro.sample("y", dist.Normal(w, 1.0), obs=y),
                         **({"latent": two} if where == "model" else {"guide_latent": two}))
    which = "" if where == "model" else r" \(guide\)"
    with pytest.raises(ps.ModelShapeError, match=rf"site 'w'{which}: batch shape \(2, 6\), expected \(6,\)"):
        ps.check_model(model, guide, elbo=Trace_ELBO())


def test_a_latent_site_with_an_undeclared_dimension_raises():
    """A latent inside the plates whose loc has a dimension no plate declares (dim -2 of size 3, nesting 2)."""
    def model():
        with pyro.plate("groups", 2, dim=-2), pyro.plate("data", 6):
            pyro.sample("y", dist.Normal(0.0, 1.0), obs=torch.zeros(2, 6))
        with pyro.plate("data2", 6):
            pyro.sample("v", dist.Normal(torch.zeros(3, 6), 1.0))

    def guide():
        with pyro.plate("data2", 6):
            pyro.sample("v", dist.Normal(torch.zeros(3, 6), 1.0))

    with pytest.raises(ps.ModelShapeError, match=r"site 'v': batch shape \(3, 6\), expected \(1, 6\).*dim -2 "
                                                 r"\(size 3\) belongs to no plate"):
        ps.check_model(model, guide, elbo=Trace_ELBO())


def test_enumerated_dimensions_are_not_slips():
    """TraceEnum_ELBO puts an enumerated site's values left of the plates (here dim -2 of y's batch, 3 values of z):
    the first-step check of NaturalGradient, which reads SVI's traces, leaves those dimensions alone."""
    from pyro_sparsegp.checks.program import check_traces

    def model():
        z = pyro.sample("z", dist.Categorical(torch.ones(3) / 3), infer={"enumerate": "parallel"})
        with pyro.plate("data", 5):
            pyro.sample("y", dist.Normal(torch.tensor([0.0, 1.0, 2.0])[z], 1.0), obs=torch.zeros(5))

    trace = poutine.trace(poutine.enum(model, first_available_dim=-2)).get_trace()
    assert trace.nodes["y"]["fn"].batch_shape == (3, 5)
    assert check_traces(trace, poutine.trace(lambda: None).get_trace()) is None
