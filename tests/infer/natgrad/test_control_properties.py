"""Properties of the collapse control of natural-gradient runs (``pyro_sparsegp.infer.natgrad.control``; the
trust-region backtracking of Nocedal and Wright 2006, section 4.1): steady or noisy losses never halve the step,
nor does one outlier; a sustained jump after the burn-in halves it at its second loss, again for each further pair,
down to the floor; nothing before the burn-in or the start step counts; the running level is the exponential
average of the losses; the state survives a round trip."""

import random

from pyro_sparsegp.infer.natgrad.control import BURN_IN, MIN_SCALE, SPIKE_RUN, SPIKE_SIZE, StepControl


def _noisy(n, seed=0, level=10.0, spread=0.1):
    rng = random.Random(seed)
    return [level + rng.uniform(-spread, spread) for _ in range(n)]


def test_documented_constants():
    assert SPIKE_RUN == 2 and BURN_IN == 20 and MIN_SCALE == 1 / 16 and SPIKE_SIZE == 8.0


def test_steady_losses_and_one_outlier_never_halve():
    c = StepControl()
    assert c.observe(0, _noisy(200)) == [] and c.scale == 1.0
    assert c.observe(200, [1e6]) == [] and c.observe(201, _noisy(5, seed=1)) == []
    assert c.scale == 1.0 and c.events == []


def test_a_sustained_jump_halves_at_its_second_loss_down_to_the_floor():
    c = StepControl()
    c.observe(0, _noisy(100))
    out = c.observe(100, [1e3] * 20)
    # halvings at the 2nd, 4th, ... high loss, until the multiplier reaches MIN_SCALE
    assert out == [(101, 0.5), (103, 0.25), (105, 0.125), (107, 1 / 16)]
    assert c.events == out and c.scale == MIN_SCALE


def test_nothing_counts_during_the_burn_in_or_before_the_start_step():
    c = StepControl()
    assert c.observe(0, [10.0] * (BURN_IN - 5) + [1e3] * 4) == []  # still in the burn-in
    late = StepControl(start=1000)
    late.observe(0, _noisy(100))
    assert late.observe(100, [1e3] * 10) == [] and late.scale == 1.0
    assert late.observe(1000, [1e6] * 2) == [(1001, 0.5)]


def test_the_burn_in_ends_after_exactly_burn_in_losses():
    """The first loss sets the level; the verdicts start once ``BURN_IN`` more losses were seen."""
    assert StepControl().observe(0, [10.0] * BURN_IN + [1e3] * 2) == []
    assert StepControl().observe(0, [10.0] * (BURN_IN + 1) + [1e3] * 2) == [(BURN_IN + 2, 0.5)]


def test_level_is_the_exponential_average_and_deviation_the_mean_absolute_deviation():
    c = StepControl()
    c.observe(0, [4.0] * 300)
    assert abs(c.level - 4.0) < 1e-12 and abs(c.dev) < 1e-12
    assert c.scale == 1.0 and c.events == []  # a loss at the level is no spike, even with zero deviation
    c.observe(300, [4.0 + (1.0 if k % 2 else -1.0) for k in range(400)])
    assert abs(c.level - 4.0) < 0.1 and abs(c.dev - 1.0) < 0.1
    c2 = StepControl()
    c2.observe(0, [0.0, 1.0])
    assert abs(c2.level - 0.05) < 1e-12 and abs(c2.dev - 0.05) < 1e-12  # one step of weight 0.05 towards 1


def test_state_round_trip():
    c = StepControl()
    c.observe(0, _noisy(60))
    c.observe(60, [1e4] * 2)
    state = c.state_dict()
    d = StepControl()
    d.load_state_dict(state)
    assert d.state_dict() == state and d.events == [(61, 0.5)]
    assert d.observe(62, [1e4] * 2) == c.observe(62, [1e4] * 2)
