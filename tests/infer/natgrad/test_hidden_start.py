"""Natural steps on every layer of a deep GP with the hidden layers joining late (issue #26, the DGP target):
``fit(natgrad=ps.infer.NaturalPolicy(layers="all",
                                     hidden_start=k))`` trains the hidden layers' q(u) with Adam for steps ``0 .. k-1``
and with natural steps from step ``k`` on, with one Adam state throughout (no restart), and resumes identically
across the join."""

import importlib
import math
import warnings

import pytest
import torch

import pyro_sparsegp as ps
import pyro_sparsegp.infer.natgrad.optimizer as natural_gradient
from pyro_sparsegp.deep import build_deep_gp
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.natgrad import NatGradDampingWarning
from pyro_sparsegp.infer.natgrad.policy import AUTO_HIDDEN_START, resolve_natgrad

fit_module = importlib.import_module("pyro_sparsegp.infer.training.loop")  # the module; ps.infer.fit is the function


def _data(n=80):
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    dt = torch.get_default_dtype()
    X = (torch.rand(n, 2, generator=g) * 4 - 2).to(dt)
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(n, generator=g).to(dt)


def _dgp(X):
    return build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=10, num_samples=3, seed=0)


def test_hidden_layers_take_natural_steps_from_the_start_with_hidden_start_0():
    """``natgrad_hidden_start=0``: the hidden layer's q(u) takes the (positive-definite) natural step from the first
    step, no failure, and the bound ends above where it starts."""
    X, y = _data()
    dgp = _dgp(X)
    hidden = dgp.layers[0].q_u
    h0 = hidden.u_scale_tril.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NatGradDampingWarning)
        st = fit(dgp, X, y, num_steps=30, batch_size=40, natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=0),
                 progress=False)
    assert all(math.isfinite(v) for v in st.losses)
    # natural steps shrink the hidden layer's precision by about (1 - 0.1) per step (the scale by its root):
    # 30 steps lift the scale about 4.8 times, where Adam's 30 steps of 0.01 on log L_ii lift it at most e^0.3
    assert hidden.u_scale_tril.diagonal(dim1=-2, dim2=-1).min() > 3 * h0.diagonal(dim1=-2, dim2=-1).max()
    assert sum(st.losses[-5:]) / 5 < st.losses[0]


def test_hidden_layers_join_the_natural_steps_at_hidden_start(monkeypatch):
    """Before step ``k`` only the last layer takes natural steps and Adam trains the hidden q(u); from step ``k`` on
    the hidden q(u) takes natural steps and Adam no longer touches it (its Adam state stops at ``k`` steps, the
    kernel's runs on to the last step: one Adam state throughout)."""
    X, y = _data()
    dgp = _dgp(X)
    hidden, last = dgp.layers[0].q_u, dgp.layers[-1].q_u
    stepped, trainers = [[]], []
    real_step, real_trainer = natural_gradient.natgrad_from_grads_, fit_module.TrainingStep

    def spy(q, *args, **kwargs):
        stepped[-1].append(q)
        return real_step(q, *args, **kwargs)

    class Recorded(real_trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(natural_gradient, "natgrad_from_grads_", spy)
    monkeypatch.setattr(fit_module, "TrainingStep", Recorded)
    fit(dgp, X, y, num_steps=8, batch_size=40, natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=3),
        progress=False,
        callback=lambda step, loss: stepped.append([]))
    per_step = [{id(q) for q in s} for s in stepped[:8]]
    assert per_step[:3] == [{id(last)}] * 3
    assert per_step[3:] == [{id(last), id(hidden)}] * 5
    adam = trainers[0].optimizer
    steps = {id(p): int(adam.state[p]["step"]) for g in adam.param_groups for p in g["params"]}
    assert {steps[id(p)] for p in hidden.parameters()} == {3}
    assert not any(id(p) in steps for p in last.parameters())  # the last layer is never Adam's
    assert steps[id(dgp.layers[0].kernel.lengthscale_unconstrained)] == 8


def test_the_log_says_when_the_hidden_layers_join(capsys):
    """With progress shown, a line on stderr names the step from which the hidden layers take natural steps (a log
    read later says why the loss changes pace there); none where nothing joins late."""
    X, y = _data()
    fit(_dgp(X), X, y, num_steps=4, batch_size=40, natgrad=ps.infer.NaturalPolicy(layers="all"))
    assert "natural steps from step 2 (NaturalPolicy.hidden_start)" in capsys.readouterr().err
    fit(_dgp(X), X, y, num_steps=4, batch_size=40, natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=0))
    fit(_dgp(X), X, y, num_steps=4, batch_size=40)
    assert "hidden_start" not in capsys.readouterr().err


def test_auto_hidden_start_is_half_the_steps_and_only_for_all():
    """``"auto"``: the hidden layers join after :data:`AUTO_HIDDEN_START` of the steps; only ``natgrad_layers="all"``
    has late families (the default steps the last layer only, from the first step); bad values are refused."""
    X, _ = _data()
    dgp = _dgp(X)
    _, plan = resolve_natgrad(dgp, 0.1, None, "analytic", layers="all", num_steps=5000)
    assert plan.hidden_start == int(AUTO_HIDDEN_START * 5000) == 2500
    assert plan.late(plan.families()) == [dgp.layers[0].q_u]
    assert plan.active(2499, plan.families()) == [dgp.layers[-1].q_u]
    assert plan.active(2500, plan.families()) == plan.families()
    _, plan = resolve_natgrad(dgp, 0.1, None, "analytic", num_steps=5000)
    assert plan.hidden_start == 0 and plan.late(plan.families()) == []
    svgp = ps.SVGP(dgp.layers[0].kernel, X[:5], ps.Gaussian(0.1))  # one layer: nothing is late
    _, plan = resolve_natgrad(svgp, 0.1, None, "analytic", layers="all", num_steps=100)
    assert plan.late(plan.families()) == []
    for bad in (-1, 2.5, True, "half"):
        with pytest.raises(ValueError, match="NaturalPolicy.hidden_start"):
            fit(dgp, *_data(), num_steps=2, natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=bad),
                progress=False)


@pytest.mark.parametrize("layers", [{}, dict(natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=4))],
                         ids=["last", "join"])
def test_a_run_resumed_across_the_join_ends_where_an_unbroken_one_does(tmp_path, layers):
    """A DeepGP run resumed from a checkpoint written at the end of a shorter run (after its exact finish, which
    samples the hidden layers: the checkpoint keeps the loop's RNG state) ends where an unbroken one does, also when
    the hidden layers join the natural steps between the two."""
    X, y = _data()
    kw = dict(batch_size=40, progress=False, seed=2, **layers)
    straight = _dgp(X)
    fit(straight, X, y, num_steps=8, **kw)
    path = tmp_path / "ckpt.pt"
    fit(_dgp(X), X, y, num_steps=3, checkpoint=str(path), **kw)
    resumed = _dgp(X)
    fit(resumed, X, y, num_steps=8, checkpoint=ps.infer.Checkpoint(None, resume=str(path)), **kw)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8), name


def test_an_svi_program_joins_the_hidden_layer_by_changing_the_families(monkeypatch):
    """Under ``SVI`` the same schedule is the user's: ``NaturalGradient(families=natgrad_families(dgp))`` steps the
    last layer and hands the hidden q(u) to the wrapped Adam; setting ``opt.families`` to every layer's q(u) between
    steps makes the hidden one take natural steps from then on, and Adam no longer touches it (Pyro's per-parameter
    Adam keeps the step count it reached)."""
    import pyro
    from pyro.infer import SVI, TraceMeanField_ELBO

    from pyro_sparsegp.infer import NaturalGradient, natgrad_families

    X, y = _data()
    dgp = _dgp(X)
    hidden, last = dgp.layers[0].q_u, dgp.layers[-1].q_u
    pyro.clear_param_store()
    opt = NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=0.1, families=natgrad_families(dgp))
    svi = SVI(dgp.model, dgp.guide, opt, TraceMeanField_ELBO(num_particles=2, vectorize_particles=True))
    stepped, real_step = [], natural_gradient.natgrad_from_grads_

    def spy(q, *args, **kwargs):
        stepped.append(q)
        return real_step(q, *args, **kwargs)

    monkeypatch.setattr(natural_gradient, "natgrad_from_grads_", spy)
    for _ in range(3):
        assert math.isfinite(svi.step(X, y))
    assert [id(q) for q in stepped] == [id(last)] * 3
    raw = hidden.u_loc_unconstrained
    adam = opt.optim.optim_objs[raw]
    assert int(adam.state[raw]["step"]) == 3  # Adam trained the hidden q(u) so far
    opt.families = [layer.q_u for layer in dgp.layers]
    stepped.clear()
    for _ in range(2):
        assert math.isfinite(svi.step(X, y))
    assert sorted(map(id, stepped)) == sorted([id(last), id(hidden)] * 2)
    assert int(adam.state[raw]["step"]) == 3  # and no longer
    assert torch.isfinite(hidden.u_scale_tril).all()


def test_an_average_of_near_singular_iterates_keeps_the_last_one_and_says_so():
    """A hidden q(u) that Adam trained from 1e-5 of the prior scale has a lower-triangular scale with off-diagonal
    entries of Adam's step size over a 1e-5 diagonal: its precision is not representable in float64. Averaging such
    iterates (``average`` on a short run that joins the hidden layers late) keeps the family's last iterate with a
    ``RuntimeWarning`` naming it, and still averages the well-conditioned family beside it."""
    from pyro_sparsegp.infer.natgrad.averaging import IterateAverage
    from pyro_sparsegp.variational import GaussianQ

    dt = torch.get_default_dtype()
    bad, good = GaussianQ(12, learn_scale=True), GaussianQ(12, learn_scale=True)
    with torch.no_grad():
        L = torch.full((12, 12), 0.03, dtype=dt).tril(-1) + 1e-5 * torch.eye(12, dtype=dt)
        bad.u_scale_tril = L
    before = [t.detach().clone() for t in (bad.u_loc, bad.u_scale_tril)]
    avg = IterateAverage([bad, good], start=0)
    avg.update(0)
    with torch.no_grad():
        good.u_loc = torch.ones(12, dtype=dt)
    avg.update(1)
    with pytest.warns(RuntimeWarning, match="iterate average: .* keeps its last iterate"):
        assert avg.write_()
    assert torch.equal(bad.u_loc.detach(), before[0])
    assert torch.allclose(bad.u_scale_tril.detach(), before[1])
    assert torch.allclose(good.u_loc.detach(), torch.full((12,), 0.5, dtype=dt))  # the mean of 0 and 1
    # positive definite but conditioned beyond MAX_CONDITION (diagonal 1 and 1e-6: 1e12): kept too
    from pyro_sparsegp.infer.natgrad.averaging import MAX_CONDITION

    with torch.no_grad():
        bad.u_scale_tril = torch.diag(torch.tensor([1.0] * 11 + [1e-6], dtype=dt))
    avg = IterateAverage([bad], start=0, warn=False)
    avg.update(0)
    assert 1e12 > MAX_CONDITION and avg.averages()[0][1].diagonal()[-1] == bad.u_scale_tril.diagonal()[-1].double()
    assert avg.kept == [bad._pyro_name or "GaussianQ"]


def test_an_average_of_the_hidden_layers_goes_with_the_exact_finish_of_the_last(monkeypatch, capsys):
    """``natgrad_layers="all"`` with ``average``: the hidden layers' q(u) end at the average of their iterates over the
    window (natural parameters), and the last layer's q(u) and the noise take the exact finish (which sets them at
    their optimum given the averaged hidden layers), where an SVGP's ``average`` and ``finish="exact"`` still clash."""
    from pyro_sparsegp.infer.natgrad.averaging import IterateAverage

    X, y = _data()
    dgp = _dgp(X)
    hidden = dgp.layers[0].q_u
    seen, trainers, real_trainer = [], [], fit_module.TrainingStep

    class Recorded(real_trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(fit_module, "TrainingStep", Recorded)
    fit(dgp, X, y, num_steps=8, batch_size=40, natgrad=ps.infer.NaturalPolicy(layers="all", hidden_start=0, average=0.5,
                                                                              finish="exact"),
        callback=lambda step, loss: seen.append(IterateAverage.natural(hidden)) if step > 4 else None)
    assert "exact finish of the last layer's q(u)" in capsys.readouterr().err
    averager = trainers[0].plan.averager
    assert averager.families == [hidden] and averager.noises == [] and averager.count == 4
    eta, prec = IterateAverage.natural(hidden)
    assert torch.allclose(prec, sum(p for _, p in seen) / 4, rtol=1e-6)
    assert torch.allclose(eta, sum(e for e, _ in seen) / 4, rtol=1e-6, atol=1e-8)
    svgp = ps.SVGP(dgp.layers[0].kernel, X[:5], ps.Gaussian(0.1))
    with pytest.raises(ValueError, match="choose one"):
        fit(svgp, X, y, num_steps=2, natgrad=ps.infer.NaturalPolicy(average=0.5, finish="exact"), progress=False)


def test_auto_average_covers_the_hidden_layers_of_all_beside_the_exact_finish(monkeypatch, capsys):
    """``average="auto"`` (the default) is :data:`AUTO_HIDDEN_AVERAGE` of the steps for a deep GP's hidden layers
    under ``natgrad_layers="all"`` with the exact finish, and no average elsewhere (the last layer only, no finish,
    an SVGP). A run too short for it keeps the last iterate and says so on the progress stream, not as a warning."""
    from pyro_sparsegp.infer.natgrad.policy import AUTO_HIDDEN_AVERAGE

    X, y = _data()
    trainers, real_trainer = [], fit_module.TrainingStep

    class Recorded(real_trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(fit_module, "TrainingStep", Recorded)
    dgp = _dgp(X)
    state = fit(dgp, X, y, num_steps=10, batch_size=40,
                natgrad=ps.infer.NaturalPolicy(layers="all"))  # progress shown; warnings: errors
    assert state.not_averaged == ["layer0.q_u"]
    plan = trainers[-1].plan
    assert plan.average == AUTO_HIDDEN_AVERAGE and plan.averager.families == [dgp.layers[0].q_u]
    assert plan.averager.start == 9 and plan.averager.kept == ["layer0.q_u"]  # 10 steps: near its 1e-5 start
    assert "no iterate average of layer0.q_u" in capsys.readouterr().err
    for kw in (dict(), dict(natgrad=ps.infer.NaturalPolicy(layers="all", finish=None))):
        fit(_dgp(X), X, y, num_steps=2, batch_size=40, progress=False, **kw)
        assert trainers[-1].plan.average is None and trainers[-1].plan.averager is None
    fit(ps.SVGP(dgp.layers[0].kernel, X[:5], ps.Gaussian(0.1)), X, y, num_steps=2, progress=False)
    assert trainers[-1].plan.average is None


def test_adam_still_trains_a_second_gaussian_noise_beside_the_natural_steps():
    """The Adam inside ``fit`` steps every parameter it owns that has a gradient except families that joined the
    natural steps: a module with two Gaussian likelihoods (the module's own takes the Fisher-scoring step, the other
    is Adam's) trains both noises."""
    from pyro.contrib.gp.kernels import RBF
    from pyro.nn import PyroModule

    X, y = _data()

    class Two(PyroModule):
        def __init__(self):
            super().__init__()
            self.a = ps.SVGP(RBF(2), X[:6].clone(), ps.Gaussian(0.1))
            self.b = ps.SVGP(RBF(2), X[6:12].clone(), ps.Gaussian(0.1))
            self.likelihood = self.a.likelihood

        def analytic_elbo(self, Xb, yb, num_data=None):
            return self.a.analytic_elbo(Xb, yb, num_data=num_data) + self.b.analytic_elbo(Xb, yb, num_data=num_data)

    two = Two()
    noises = [float(two.a.likelihood.noise.detach()), float(two.b.likelihood.noise.detach())]
    fit(two, X, y, num_steps=5, batch_size=40, natgrad=ps.infer.NaturalPolicy(lr=0.1, finish=None), progress=False)
    assert float(two.a.likelihood.noise.detach()) != noises[0] and float(two.b.likelihood.noise.detach()) != noises[1]
