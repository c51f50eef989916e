"""Properties of the natural-gradient step-length schedules (``pyro_sparsegp.infer.natgrad.schedules``): the
log-linear warm-up of Salimbeni, Eleftheriadis, Hensman (2018) starts at ``start``, reaches ``target`` at step ``K``
and holds it, with a constant ratio between steps; the running-average start makes the iterates of
``theta <- (1 - rho) theta + rho x_k`` the running mean of the ``x_k`` until the floor; the cool-down multiplies by
1 before its start and by ``factor`` from its end on, geometrically between; and every bad argument is refused."""

import math

import pytest

from pyro_sparsegp.infer.natgrad.schedules import (
    Cooldown,
    LogLinearWarmup,
    RunningAverageStart,
    as_schedule,
    constant_schedule,
)


def test_warmup_is_geometric_from_start_to_target():
    s = LogLinearWarmup(0.1, steps=5, start=1e-4)
    lengths = [s(k) for k in range(8)]
    assert lengths[0] == pytest.approx(1e-4)
    assert lengths[5:] == [0.1, 0.1, 0.1]
    ratios = [b / a for a, b in zip(lengths[:5], lengths[1:6], strict=True)]
    assert ratios == pytest.approx([(0.1 / 1e-4) ** (1 / 5)] * 5)
    assert s(-3) == pytest.approx(1e-4)  # negative steps count as the first
    assert LogLinearWarmup(0.5, steps=0)(0) == 0.5
    assert LogLinearWarmup(0.5).steps == 5 and LogLinearWarmup(0.5).start == pytest.approx(1e-4)


@pytest.mark.parametrize("kwargs", [dict(target=0.0), dict(target=1.5), dict(target=True), dict(target="0.1"),
                                    dict(target=0.1, start=0.2), dict(target=0.1, start=0.0),
                                    dict(target=0.1, steps=-1), dict(target=0.1, steps=2.0),
                                    dict(target=0.1, steps=True)])
def test_warmup_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="LogLinearWarmup"):
        LogLinearWarmup(**kwargs)


def test_warmup_accepts_its_bounds():
    assert LogLinearWarmup(1.0, steps=0, start=1.0)(0) == 1.0  # target 1 and start == target are allowed


def test_running_average_start_gives_the_running_mean_until_its_floor():
    s = RunningAverageStart(0.25)
    assert [s(k) for k in range(6)] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.25, 0.25])
    assert s(-2) == 1.0
    xs = [3.0, -1.0, 4.0, 2.0]
    theta = 100.0  # forgotten at the first step (rho_0 = 1)
    for k, x in enumerate(xs[:4]):
        theta = (1 - s(k)) * theta + s(k) * x
        assert theta == pytest.approx(sum(xs[:k + 1]) / (k + 1))
    with pytest.raises(ValueError):
        RunningAverageStart(0.0)


def test_cooldown_multiplier():
    c = Cooldown(0.5, start=10, end=20, factor=0.1)
    assert c.multiplier(0) == 1.0 and c.multiplier(9) == 1.0
    assert c.multiplier(10) == pytest.approx(1.0)
    assert c.multiplier(15) == pytest.approx(math.sqrt(0.1))
    assert c.multiplier(20) == pytest.approx(0.1) and c.multiplier(50) == pytest.approx(0.1)
    assert c(15) == pytest.approx(0.5 * math.sqrt(0.1))
    assert c.target == 0.5 and c.steps == 0
    d = Cooldown(LogLinearWarmup(0.2, steps=4), start=3, end=3)  # end <= start: a one-step decay
    assert d.end == 4 and d.multiplier(4) == pytest.approx(0.1) and d.steps == 4
    assert d(2) == pytest.approx(LogLinearWarmup(0.2, steps=4)(2))
    assert Cooldown(0.5, start=0, end=10).factor == pytest.approx(0.1)  # the documented default


@pytest.mark.parametrize("kwargs", [dict(factor=0.0), dict(factor=1.5), dict(factor=True), dict(start=-1),
                                    dict(end=-2), dict(start=1.0), dict(end=True)])
def test_cooldown_refuses_bad_arguments(kwargs):
    args = dict(base=0.5, start=1, end=5, factor=0.5) | kwargs
    with pytest.raises(ValueError, match="Cooldown"):
        Cooldown(**args)
    assert Cooldown(0.5, 1, 5, factor=1.0).multiplier(5) == 1.0


def test_constant_and_as_schedule():
    c = constant_schedule(0.3)
    assert [c(k) for k in (0, 1, 100)] == [0.3, 0.3, 0.3]
    s = as_schedule(0.1, warmup=4)
    assert s(0) == pytest.approx(1e-4) and s(4) == 0.1
    small = as_schedule(1e-5, warmup=3)  # the start never exceeds the target
    assert small(0) == pytest.approx(1e-5) and small(3) == pytest.approx(1e-5)
    assert as_schedule(0.2)(0) == 0.2  # no warm-up by default
    f = lambda k: 0.7  # noqa: E731
    assert as_schedule(f) is f
    with pytest.raises(ValueError):
        as_schedule(2.0)
