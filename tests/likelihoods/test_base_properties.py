"""Properties of the likelihood base class (``pyro_sparsegp.likelihoods.base``) and its node rules: the number of
Gauss-Hermite nodes follows the documented rule (``num_gh`` up to the node standard deviation, then in proportion
to the widest ``q(f)``, capped at ``max(100, num_gh)``; Student-t's in proportion to ``sqrt(v) / scale``), and the
accuracy that the rule is there for holds (Bernoulli's expected log-likelihood at ``q(f)`` of sd 4 and 8 against
scipy's adaptive quadrature, within the documented error); the probit predictive is ``Phi(m / sqrt(1 + v))``
(Monte Carlo) and the logit one the Gaussian average of the sigmoid; initial parameters are checked to be one
finite number strictly inside their range; bad ``num_gh`` and bad labels are named (at most five shown)."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, special, stats

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods.base import _init_param


@pytest.mark.parametrize("num_gh, sd, expected", [
    (20, 0.0, 20), (20, 1.0, 20), (20, 2.0, 20), (20, 2.5, 25), (20, 4.0, 40), (20, 8.0, 80), (20, 30.0, 100),
    (150, 1.0, 150), (150, 30.0, 150), (7, 3.0, 11),
])
def test_node_rule(num_gh, sd, expected):
    lik = ps.Bernoulli(num_gh=num_gh)  # _node_sd = 2
    f_var = torch.tensor([0.01, sd * sd, 0.5])  # the widest q(f) decides
    assert lik.num_nodes(f_var) == expected
    assert lik.num_nodes(torch.zeros(0)) == num_gh
    assert lik.num_nodes(torch.tensor([float("nan")])) == num_gh
    assert lik.num_nodes(torch.tensor([-1.0])) == num_gh  # negative variances (round-off) count as 0


def test_node_rule_of_a_likelihood_with_node_sd_one():
    lik = ps.Beta(num_gh=20)  # _node_sd = 1: num_gh up to sd 1, then num_gh * sd
    assert [lik.num_nodes(torch.tensor([s * s])) for s in (0.5, 1.0, 2.0, 3.5, 10.0)] == [20, 20, 40, 70, 100]


def test_student_t_node_rule():
    lik = ps.StudentT(scale=0.5, num_gh=10)
    sds = (0.25, 0.5, 1.0, 1.5, 100.0)
    assert [lik.num_nodes(torch.tensor([s * s])) for s in sds] == [10, 10, 20, 30, 100]
    assert lik.num_nodes(torch.zeros(0)) == 10 and lik.num_nodes(torch.tensor([float("nan")])) == 10


@pytest.mark.parametrize("sd, tol", [(4.0, 3e-5), (8.0, 3e-4)])
def test_bernoulli_quadrature_meets_its_documented_error(sd, tol):
    lik = ps.Bernoulli(link="logit")
    for m in (-2.0, 0.0, 3.0):
        for y in (0.0, 1.0):
            s = 2 * y - 1
            ref = integrate.quad(lambda f, m=m, s=s: stats.norm.pdf(f, m, sd) * -np.logaddexp(0.0, -s * f),
                                 m - 12 * sd, m + 12 * sd, epsabs=1e-13, epsrel=1e-12, limit=400)[0]
            got = lik.expected_log_prob(torch.tensor([y]), torch.tensor([m]), torch.tensor([sd * sd]))
            assert abs(float(got) - ref) < (tol * 1.5 if torch.get_default_dtype() == torch.float64 else 1e-3)


def test_bernoulli_predictives():
    f_loc, f_var = torch.tensor([-1.0, 0.3, 2.0]), torch.tensor([0.5, 2.0, 9.0])
    probit = ps.Bernoulli().predictive(f_loc, f_var).probs
    ref = special.ndtr(f_loc.numpy() / np.sqrt(1 + f_var.numpy()))
    torch.testing.assert_close(probit, torch.as_tensor(ref, dtype=probit.dtype), rtol=1e-5, atol=1e-6)
    logit = ps.Bernoulli(link="logit").predictive(f_loc, f_var).probs
    ref = [integrate.quad(lambda f, m=m, v=v: stats.norm.pdf(f, m, math.sqrt(v)) * special.expit(f), -60, 60,
                          epsabs=1e-12)[0] for m, v in zip(f_loc.tolist(), f_var.tolist(), strict=True)]
    torch.testing.assert_close(logit, torch.tensor(ref, dtype=logit.dtype), rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    n = 400_000
    f = f_loc + f_var.sqrt() * torch.randn(n, 3)
    mc = torch.special.ndtr(f).mean(0)  # E[Phi(f)] = Phi(m / sqrt(1 + v))
    assert bool(((mc - probit).abs() < 5 * (0.25 / n) ** 0.5).all())


def test_init_param_checks_one_finite_number_strictly_inside_its_range():
    t = _init_param(0.3, "gate", 0.0, 1.0)
    assert t.shape == () and t.dtype == torch.get_default_dtype() and float(t) == pytest.approx(0.3)
    assert float(_init_param(torch.tensor([2.0]), "scale")) == 2.0
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan"), float("inf"), [0.2, 0.3]):
        with pytest.raises(ValueError, match="gate must be one finite number in"):
            _init_param(bad, "gate", 0.0, 1.0, "Z(gate=0.2)")
    with pytest.raises(ValueError, match=r"scale must be one finite number greater than 0, got 0.0; e.g. StudentT"):
        _init_param(0.0, "scale", example="StudentT(scale=0.5)")


@pytest.mark.parametrize("num_gh", [0, -3, True, 2.5, "20"])
def test_bad_num_gh_is_named(num_gh):
    with pytest.raises(ValueError, match="num_gh"):
        ps.Bernoulli(num_gh=num_gh)


def test_bad_labels_are_named_with_at_most_five_shown():
    lik = ps.Poisson()
    with pytest.raises(ValueError, match=r"outside the support of Poisson .*: -5, -4, -3, -2, -1, \.\.\.; counts"):
        lik.check_y(torch.tensor([-5.0, -4.0, -3.0, -2.0, -1.0, -0.5, 2.0]))
    with pytest.raises(ValueError, match=r": -5, -4, -3, -2, -1; counts"):
        lik.check_y(torch.tensor([-5.0, -4.0, -3.0, -2.0, -1.0, 2.0]))
    with pytest.raises(ValueError, match="NaN or inf"):
        lik.check_y(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="binary labels are 0 and 1"):
        ps.Bernoulli().check_y(torch.tensor([-1.0, 1.0]))


def test_documented_initial_values_and_node_counts():
    """The initial parameters the docstrings state (StudentT df 3, Gamma shape 1: the exponential, dispersions 1)
    and the default 20 Gauss-Hermite nodes."""
    def value(t):
        return float(t.detach())

    assert value(ps.StudentT().df) == pytest.approx(3.0) and value(ps.StudentT().scale) == pytest.approx(1.0)
    assert value(ps.Gamma().shape) == pytest.approx(1.0)
    for cls in (ps.NegativeBinomial, ps.ZeroInflatedNegativeBinomial):
        assert value(cls().dispersion) == pytest.approx(1.0) and cls().num_gh == 20
    assert value(ps.ZeroInflatedNegativeBinomial().gate) == pytest.approx(0.1)
    assert ps.PolyaGammaLogit().num_gh == 20 and ps.ZeroInflatedPoisson().num_gh == 20


@pytest.mark.parametrize("gate", [0.0, 1.0, 1.5])
def test_gate_must_lie_strictly_inside_the_unit_interval(gate):
    with pytest.raises(ValueError, match="gate"):
        ps.ZeroInflatedPoisson(gate=gate)


def test_logit_predictive_with_batch_dimensions_is_elementwise():
    lik = ps.Bernoulli(link="logit")
    f_loc, f_var = torch.randn(2, 3), torch.rand(2, 3) + 0.5
    p = lik.predictive(f_loc, f_var).probs
    assert p.shape == (2, 3)
    for i in range(2):
        torch.testing.assert_close(p[i], lik.predictive(f_loc[i], f_var[i]).probs)
