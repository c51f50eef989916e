"""Properties of the natural-gradient policy (``pyro_sparsegp.infer.natgrad.policy``; Salimbeni, Eleftheriadis,
Hensman 2018; Lin, Schmidt, Khan 2020; Polyak-Ruppert averaging of Hensman, Fusi, Lawrence 2013, section 3.2), as its
docstrings state them: ``natgrad_layers="all"`` lets the hidden layers join after half the steps; robust-max gets
natural steps for ``B / N`` *at least* 1/32; ``cooldown="auto"`` decays only non-conjugate natural steps; a cooldown
of the whole run (1) is allowed; a redone window of steps counts once in the average (its iterates dropped)."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer.natgrad.policy import AUTO_MIN_BATCH_FRACTION, resolve_natgrad


def _gp(lik):
    return ps.SVGP(RBF(1), torch.linspace(-2, 2, 4).unsqueeze(-1), lik,
                   num_outputs=3 if isinstance(lik, ps.RobustMax) else None)


def test_hidden_layers_join_after_half_the_steps():
    gp = _gp(ps.Gaussian(0.1))
    for steps in (40, 41, 7):
        plan = resolve_natgrad(gp, 0.1, None, "analytic", layers="all", num_steps=steps)[1]
        assert plan.hidden_start == steps // 2
    assert resolve_natgrad(gp, 0.1, None, "analytic", layers="last", num_steps=40)[1].hidden_start == 0


def test_robust_max_takes_natural_steps_from_a_batch_fraction_of_one_in_32():
    gp = _gp(ps.RobustMax(3))
    lr = [resolve_natgrad(gp, "auto", None, "analytic", num_steps=10, batch_fraction=f)[0]
          for f in (AUTO_MIN_BATCH_FRACTION, AUTO_MIN_BATCH_FRACTION * 0.99, 1.0, None)]
    assert lr[0] is not None and lr[2] is not None and lr[3] is not None
    assert lr[1] is None
    assert AUTO_MIN_BATCH_FRACTION == pytest.approx(1 / 32)


def test_the_auto_cooldown_decays_only_non_conjugate_natural_steps():
    conj, nonconj = _gp(ps.Gaussian(0.1)), _gp(ps.Bernoulli())
    assert resolve_natgrad(conj, 0.1, None, "analytic", num_steps=10, cooldown="auto")[1].cooldown == 0.0
    assert resolve_natgrad(nonconj, 0.1, None, "analytic", num_steps=10, cooldown="auto")[1].cooldown == 0.5
    assert resolve_natgrad(nonconj, None, None, "analytic", num_steps=10, cooldown="auto")[1].cooldown == 0.0
    whole = resolve_natgrad(nonconj, 0.1, None, "analytic", num_steps=10, cooldown=1)[1]
    assert whole.cooldown == 1.0 and whole.cooldown_start == 0
    none = resolve_natgrad(nonconj, 0.1, None, "analytic", num_steps=10, cooldown=0)[1]  # "None or 0 for none"
    assert none.cooldown == 0.0 and none.adam_multiplier(9) == 1.0
    for bad in (1.5, -0.1, True):
        with pytest.raises(ValueError, match="cooldown"):
            resolve_natgrad(nonconj, 0.1, None, "analytic", num_steps=10, cooldown=bad)


def test_a_redone_window_counts_once_in_the_average():
    """Iterates with one covariance and means ``a_k``: the average of the natural parameters has mean
    ``mean_k a_k``; the steps between ``mark`` and ``rewind`` are dropped from it."""
    gp = _gp(ps.Gaussian(0.1))
    plan = resolve_natgrad(gp, 0.1, None, "analytic", num_steps=4, average=1.0)[1]
    plan.start([gp.q_u], None, 0.1)
    means = [torch.randn(4) for _ in range(4)]
    tril = 0.5 * torch.eye(4)

    def step(k):
        with torch.no_grad():
            gp.q_u.set(means[k], tril)
        plan.after_step(k)

    step(0)
    step(1)
    plan.mark()
    step(2)
    plan.rewind()  # step 2 is redone as step 3's iterate
    step(3)
    assert plan.finish()
    ref = (means[0] + means[1] + means[3]) / 3
    torch.testing.assert_close(gp.q_u.u_loc.detach(), ref)
    torch.testing.assert_close(gp.q_u.u_scale_tril.detach(), tril)


def test_a_one_step_cooldown_ends_at_the_cooldown_factor():
    """Adam's multiplier over a cooldown of one step (10 steps, cooldown 0.1: it starts at step 9): 1 up to the start,
    then the whole log-linear decay over that one step, :data:`COOLDOWN_FACTOR` at step 10 (not half of it)."""
    from pyro_sparsegp.infer.natgrad.policy import COOLDOWN_FACTOR

    plan = resolve_natgrad(_gp(ps.Bernoulli()), 0.1, None, "analytic", num_steps=10, cooldown=0.1)[1]
    assert plan.cooldown_start == 9
    assert plan.adam_multiplier(8) == plan.adam_multiplier(9) == 1.0
    assert plan.adam_multiplier(10) == pytest.approx(COOLDOWN_FACTOR)


def test_the_step_control_scales_the_schedule():
    """The step control's multiplier times the schedule (``_Controlled``): halved lengths after a collapse; a schedule
    without a warm-up reports 0 warm-up steps."""
    from types import SimpleNamespace

    from pyro_sparsegp.infer.natgrad.policy import _Controlled
    from pyro_sparsegp.infer.natgrad.schedules import LogLinearWarmup

    control = SimpleNamespace(scale=0.5)
    constant = _Controlled(lambda step: 0.2, control)
    assert constant(3) == pytest.approx(0.1) and constant.steps == 0
    warm = _Controlled(LogLinearWarmup(0.2, 5), control)
    assert warm.steps == 5 and warm(5) == pytest.approx(0.1)


def test_fit_refuses_a_per_family_retraction():
    """``NaturalPolicy.retraction`` as a function ``family -> bool`` is ``NaturalGradient``'s; ``fit`` refuses it,
    naming the field, rather than passing it on."""
    gp = _gp(ps.Bernoulli())
    with pytest.raises(ValueError, match="retraction under fit"):
        resolve_natgrad(gp, 0.1, None, "analytic", num_steps=10, retraction=lambda q: True)
