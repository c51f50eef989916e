"""fit's defaults for a likelihood the papers do not cover (issue #46, item 1): the step control that halves every
step length when the bound collapses, the cooldown of the last half of the steps (natural steps and Adam alike),
the natural finish (damped full-data natural steps, each raising the full-data bound), what "auto" chooses for
which likelihood, and NaturalGradient's cooldown under plain SVI."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_sparsegp as ps
from pyro_sparsegp.infer.natgrad.control import BURN_IN, MIN_SCALE, SPIKE_RUN, StepControl
from pyro_sparsegp.infer.natgrad.policy import AUTO_COOLDOWN, COOLDOWN_FACTOR, resolve_natgrad
from pyro_sparsegp.infer.natgrad.schedules import Cooldown, LogLinearWarmup
from pyro_sparsegp.infer.training.natural_finish import (
    DEFAULT_PASSES,
    EPOCHS_PER_PASS,
    natural_finish_,
    resolve_any_finish,
)


class MyPoisson(ps.Likelihood):
    """A user's likelihood, unknown to the library (docs/extending.md)."""

    support = constraints.nonnegative_integer

    def distribution(self, f):
        return dist.Poisson(f.exp())


def _counts(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=g) * 6 - 3
    rate = torch.exp(1.0 + torch.sin(2 * X[:, 0]))
    return X, torch.poisson(rate.double(), generator=g).to(X.dtype), rate


# -- the cooldown ---------------------------------------------------------------------------------------------------
def test_cooldown_decays_log_linearly_to_its_factor_over_the_last_steps():
    c = Cooldown(LogLinearWarmup(0.1, steps=0), start=600, end=1000, factor=0.1)
    assert [c(k) for k in (0, 599, 600)] == pytest.approx([0.1, 0.1, 0.1])
    assert c(800) == pytest.approx(0.1 * 0.1 ** 0.5) and c(1000) == pytest.approx(0.01) and c(5000) == c(1000)
    ratios = [c(k + 1) / c(k) for k in range(600, 999)]
    assert max(ratios) == pytest.approx(min(ratios)) and max(ratios) < 1  # a constant factor: log-linear
    with pytest.raises(ValueError, match="factor"):
        Cooldown(0.1, 0, 10, factor=0.0)


def test_auto_cools_down_a_non_conjugate_likelihood_and_not_a_conjugate_one():
    Z = torch.linspace(-1, 1, 5).unsqueeze(-1)
    for lik, cooled in ((MyPoisson(), True), (ps.Bernoulli(), True), (ps.Gaussian(0.1), False),
                        (ps.PolyaGammaLogit(), False)):
        lr, plan = resolve_natgrad(ps.SVGP(RBF(1), Z, lik), "auto", None, "analytic", num_steps=100,
                                   cooldown="auto")
        assert lr == 0.1 and (plan.cooldown == AUTO_COOLDOWN) == cooled, type(lik).__name__
        assert (plan.control is not None) == cooled  # the step control comes with the non-conjugate step
    _, plan = resolve_natgrad(ps.SVGP(RBF(1), Z, MyPoisson()), None, None, "analytic", cooldown="auto")
    assert plan.cooldown == 0 and plan.control is None  # Adam alone: as before
    with pytest.raises(ValueError, match="cooldown"):
        resolve_natgrad(ps.SVGP(RBF(1), Z, MyPoisson()), 0.1, None, "analytic", cooldown=1.5)


def test_fit_decays_adam_and_the_natural_steps_together_over_the_last_half():
    """Adam's learning rate, read at every step from the optimiser fit built, follows the plan's multiplier: 1 for the
    first half, then log-linearly to a tenth (an independent recomputation of the schedule)."""
    from pyro_sparsegp.infer.training import steps as steps_module

    X, y, _ = _counts()
    gp = ps.SVGP(RBF(1), X[::30].clone(), MyPoisson())
    seen, real = [], steps_module.TrainingStep.update

    def update(self, yb, context, step=0):
        real(self, yb, context, step)
        seen.append((step, self.optimizer.param_groups[0]["lr"], self.engine.schedule(step)))

    steps_module.TrainingStep.update = update
    try:
        ps.infer.fit(gp, X, y, num_steps=40, batch_size=100, lr=0.02, progress=False,
                     natgrad=ps.infer.NaturalPolicy(finish=None))
    finally:
        steps_module.TrainingStep.update = real
    for step, adam_lr, nat_lr in seen:
        mult = 1.0 if step < 20 else COOLDOWN_FACTOR ** ((step - 20) / 20)
        assert adam_lr == pytest.approx(0.02 * mult), step
        if step >= 5:  # after the warm-up
            assert nat_lr == pytest.approx(0.1 * mult), step


# -- the step control -----------------------------------------------------------------------------------------------
def test_step_control_ignores_noise_and_single_outliers_and_halves_on_a_collapse():
    g = torch.Generator().manual_seed(0)
    noisy = (100 + torch.randn(300, generator=g)).tolist()
    c = StepControl()
    assert c.observe(0, noisy) == [] and c.scale == 1.0
    outliers = list(noisy)
    for k in range(40, 300, 25):
        outliers[k] += 50  # one bad batch at a time
    c = StepControl()
    assert c.observe(0, outliers) == [] and c.scale == 1.0
    collapse = noisy[:100] + [v + 50 for v in noisy[100:103]] + noisy[103:]
    c = StepControl()
    events = c.observe(0, collapse)
    assert events == [(100 + SPIKE_RUN - 1, 0.5)] and c.scale == 0.5
    c = StepControl()
    assert c.observe(0, noisy[:BURN_IN - 5] + [v + 50 for v in noisy[:5]]) == []  # no verdict during the burn-in
    c = StepControl()
    c.observe(0, noisy[:50] + [1e6] * 40)
    assert c.scale == MIN_SCALE  # halved at most down to the floor


def test_step_control_replays_to_the_same_state_in_any_chunks():
    """fit rebuilds a resumed run's control from its loss history; the GPU reads losses every sync_every steps."""
    losses = [100.0 + (k % 7) for k in range(60)] + [400.0] * 4 + [100.0] * 30
    whole, chunked = StepControl(), StepControl()
    whole.observe(0, losses)
    for i in range(0, len(losses), 20):
        chunked.observe(i, losses[i:i + 20])
    assert whole.state_dict() == chunked.state_dict() and whole.scale < 1


def test_a_collapse_in_fit_halves_the_steps_and_says_so(monkeypatch, capsys):
    """A loss sequence with a collapse (the callback sees the losses fit read back): the control halves the natural
    step, and fit's progress stream names the step."""
    from pyro_sparsegp.infer.training import guard as guard_module

    X, y, _ = _counts()
    gp = ps.SVGP(RBF(1), X[::30].clone(), MyPoisson())
    real = guard_module.StepGuard.record

    def record(self, step, loss, grads):  # the losses of steps 30-32 reported 100x too large
        real(self, step, loss * (100 if 30 <= step < 33 else 1), grads)

    monkeypatch.setattr(guard_module.StepGuard, "record", record)
    seen = []
    ps.infer.fit(gp, X, y, num_steps=40, batch_size=100, callback=lambda s, l: seen.append(l),
                 natgrad=ps.infer.NaturalPolicy(cooldown=None, finish=None))
    err = capsys.readouterr().err
    assert "fit: step 31: the bound collapsed on 2 batches in a row; every step length is now 0.5" in err, err


# -- the natural finish ---------------------------------------------------------------------------------------------
def _optimum_by_lbfgs(gp, X, y):
    """The full-data bound maximised over q(u) alone by L-BFGS (an independent optimiser), hyperparameters held."""
    params = [gp.q_u.u_loc_unconstrained, gp.q_u.u_scale_tril_unconstrained]
    others = [p for p in gp.parameters() if all(p is not q for q in params)]
    for p in others:
        p.requires_grad_(False)
    opt = torch.optim.LBFGS(params, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -gp.analytic_elbo(X, y)
        loss.backward()
        return loss

    opt.step(closure)
    for p in others:
        p.requires_grad_(True)
    with torch.no_grad():
        return float(gp.analytic_elbo(X, y))


@pytest.mark.float64
@pytest.mark.parametrize("lik", [MyPoisson, lambda: ps.Bernoulli(link="logit")], ids=["poisson", "logit"])
def test_natural_finish_raises_the_bound_to_the_optimum_of_q_u(lik):
    X, y, _ = _counts(200)
    if not isinstance(lik(), MyPoisson):
        y = (y > 2).to(X.dtype)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), X[::20].clone(), lik())
    ref = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), X[::20].clone(), lik())
    ref.load_state_dict(gp.state_dict())
    best = _optimum_by_lbfgs(ref, X, y)
    report = natural_finish_(gp, lambda: ((X[i:i + 64], y[i:i + 64]) for i in range(0, 200, 64)), 200, passes=30)
    with torch.no_grad():
        after = float(gp.analytic_elbo(X, y))
    assert report["after"] == pytest.approx(after, abs=1e-8 * abs(after))  # the batches' sum is the full bound
    assert report["before"] < after - 1.0  # started from the prior: far from the optimum
    assert after == pytest.approx(best, abs=1e-5 * abs(best)), (after, best, report)
    assert gp.kernel.lengthscale.item() == pytest.approx(0.7) and all(p.grad is None for p in gp.parameters())


def test_natural_finish_never_lowers_the_bound_of_a_non_log_concave_likelihood():
    """Robust-max (not log-concave): every accepted step raised the bound (backtracking), so the end is no worse."""
    torch.manual_seed(0)
    X = torch.randn(90, 2)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    gp = ps.SVGP(RBF(2), X[:12].clone(), ps.RobustMax(3))
    ps.infer.fit(gp, X, y, num_steps=30, batch_size=30, progress=False, natgrad=ps.infer.NaturalPolicy(finish=None))
    with torch.no_grad():
        before = float(gp.analytic_elbo(X, y))
    report = natural_finish_(gp, lambda: [(X, y)], 90, passes=4)
    with torch.no_grad():
        after = float(gp.analytic_elbo(X, y))
    assert after >= before - 1e-9 * abs(before) and report["after"] == pytest.approx(after, rel=1e-9)


def test_what_the_finish_auto_chooses():
    Z = torch.linspace(-1, 1, 5).unsqueeze(-1)
    pois, gauss = ps.SVGP(RBF(1), Z, MyPoisson()), ps.SVGP(RBF(1), Z, ps.Gaussian(0.1))
    assert resolve_any_finish(gauss, "auto", "analytic", 0.1, None, None, 100, 10.0)[0] == "exact"
    kind, skipped, passes = resolve_any_finish(pois, "auto", "analytic", 0.1, None, None, 100, 12.0)
    assert (kind, skipped, passes) == ("natural", None, int(12 // EPOCHS_PER_PASS))
    assert resolve_any_finish(pois, "auto", "analytic", 0.1, None, None, 100, 1e3)[2] == DEFAULT_PASSES
    for args, says in ((("analytic", None, None, None, 100, 50.0), "Adam"),
                       (("analytic", 0.1, object(), None, 100, 50.0), "loader"),
                       (("analytic", 0.1, None, None, 100, 2.0), "2 epochs")):
        kind, skipped, _ = resolve_any_finish(pois, "auto", *args)
        assert kind is None and skipped.startswith("no natural finish") and says in skipped, skipped
    assert resolve_any_finish(pois, "auto", Trace_ELBO(), 0.1, None, None, 100, 50.0)[:2] == (None, None)
    assert resolve_any_finish(pois, "natural", "analytic", None, None, None, 100, 0.5)[0] == "natural"
    with pytest.raises(ValueError, match="choose one"):
        resolve_any_finish(pois, "natural", "analytic", 0.1, None, 0.25, 100, 50.0)
    with pytest.raises(ValueError, match='finish must be'):
        resolve_any_finish(pois, "newton", "analytic", 0.1, None, None, 100, 50.0)


def test_the_issues_poisson_run_ends_on_a_stable_model():
    """The user's Poisson likelihood with fit's defaults on minibatches (docs/extending.md): the returned model is at
    least as good as the one the loop ended with (the finish only raises the full-data bound), and recovers the
    rate."""
    X, y, rate = _counts(400)
    gp = ps.SVGP(RBF(1), X[::20].clone(), MyPoisson())
    ps.infer.fit(gp, X, y, num_steps=300, batch_size=100, lr=0.02, progress=False)
    mean, var = gp.predict(X)
    rmse = float((torch.exp(mean + var / 2) - rate).pow(2).mean().sqrt())
    assert rmse < 0.25 * float(rate.std()), rmse


# -- NaturalGradient under plain SVI ---------------------------------------------------------------------------------
def test_natural_gradient_with_num_steps_cools_down_its_wrapped_optimiser():
    X, y, _ = _counts(100)
    gp = ps.SVGP(RBF(1), X[::20].clone(), MyPoisson())
    opt = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.02}), natgrad=0.1, num_steps=10)
    svi = SVI(gp.model, gp.guide, opt, Trace_ELBO())
    rates = []
    for _ in range(10):
        svi.step(X, y)
        rates.append(sorted({g["lr"] for o in opt.optim.optim_objs.values() for g in o.param_groups}))
    assert all(len(r) == 1 for r in rates)
    expected = [0.02 * (1.0 if k + 1 < 5 else COOLDOWN_FACTOR ** (min(k + 1 - 5, 5) / 5)) for k in range(10)]
    assert [r[0] for r in rates] == pytest.approx(expected)
    assert opt.schedule(9) == pytest.approx(0.1 * COOLDOWN_FACTOR ** (4 / 5))
    with pytest.raises(ValueError, match="num_steps"):
        ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.02}), num_steps=0)
    assert math.isclose(ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.02})).schedule(10 ** 6), 0.1)
