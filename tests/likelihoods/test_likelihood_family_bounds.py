"""The count, continuous and heteroscedastic likelihoods in an SVGP: ``Trace_ELBO`` on ``gp.model``/``gp.guide``
(sampled ``f``, scored by ``distribution(f).log_prob``) is an unbiased estimate of ``analytic_elbo`` (which scores
``expected_log_prob``: the closed forms and quadratures), every learnable parameter gets a gradient through both,
a ``PyroSample`` hyperprior replaces a ``PyroParam``; and a "no untested subclass" guard over ``ps.likelihoods``."""

import inspect

import pyro
import pyro.distributions as dist
import pytest
import torch
from likelihood_cases import CASES, simulated
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps

# where the other exported likelihoods are parametrised: test_likelihoods.py (Gaussian, Bernoulli),
# test_polya_gamma_bound.py (PolyaGammaLogit), test_multiclass.py (RobustMax, Softmax)
TESTED_ELSEWHERE = {"Gaussian", "Bernoulli", "PolyaGammaLogit", "RobustMax", "Softmax"}


def test_no_untested_likelihood():
    """Every Likelihood subclass that ps.likelihoods exports is in CASES (every test of this family is parametrised
    over it) or tested elsewhere."""
    exported = {name for name, obj in vars(ps.likelihoods).items()
                if inspect.isclass(obj) and issubclass(obj, ps.Likelihood) and obj is not ps.Likelihood}
    assert exported - set(CASES) - TESTED_ELSEWHERE == set()
    assert {type(make()).__name__ for make, _, _ in CASES.values()} == set(CASES)
    assert all(getattr(ps, name) is getattr(ps.likelihoods, name) for name in CASES)  # ps.<Name> too


def _svgp(name, N=20, M=5, seed=0):
    lik, X, y, _ = simulated(name, N=N, seed=seed)
    return ps.SVGP(RBF(1, lengthscale=torch.tensor(0.8)), X[::N // M].clone(), lik), X, y


@pytest.mark.parametrize("name", list(CASES))
def test_trace_elbo_is_unbiased_for_the_closed_form_bound(name):
    gp, X, y = _svgp(name)
    assert_trace_elbo_matches_closed_form(gp, X, y)


@pytest.mark.parametrize("name", list(CASES))
def test_every_learnable_parameter_gets_a_gradient(name):
    gp, X, y = _svgp(name)
    with torch.no_grad():  # off the prior (at q(u) = p(u), whitened, q(f) does not depend on the length-scale)
        gp.q_u.set(0.5 * torch.randn_like(gp.q_u.u_loc), 0.7 * gp.q_u.u_scale_tril)
    lik_params = {n for n, _ in gp.likelihood.named_parameters()}
    assert len(lik_params) == {"Poisson": 0, "HeteroscedasticGaussian": 0, "HeteroscedasticNegativeBinomial": 0,
                               "StudentT": 2,
                               "ZeroInflatedNegativeBinomial": 2}.get(name, 1)
    for loss in (lambda: -gp.analytic_elbo(X, y),
                 lambda: Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
                 .differentiable_loss(gp.model, gp.guide, X, y)):
        gp.zero_grad()
        loss().backward()
        for n, p in gp.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("name, attr", [("NegativeBinomial", "dispersion"), ("StudentT", "df"), ("Gamma", "shape"),
                                        ("Beta", "precision"), ("ZeroInflatedPoisson", "gate")])
def test_a_pyro_sample_hyperprior_replaces_a_parameter(name, attr):
    """The parameter as a PyroSample with an AutoNormal beside the layer's guide: its site is drawn once per
    particle and its guide's parameters move under SVI."""
    gp, X, y = _svgp(name)
    prior = dist.Beta(2.0, 2.0) if attr == "gate" else dist.LogNormal(torch.tensor(0.0), 1.0)
    setattr(gp.likelihood, attr, PyroSample(prior))
    site = f"gp.likelihood.{attr}"
    guide = AutoGuideList(gp.model, create_plates=gp.create_plates)
    guide.append(AutoNormal(pyro.poutine.block(gp.model, expose=[site])))
    guide.append(gp.guide)
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO(max_plate_nesting=2))
    svi.step(X, y)
    before = {k: v.detach().clone() for k, v in guide.named_parameters() if attr in k}
    assert before
    losses = [svi.step(X, y) for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(v.detach(), before[k]) for k, v in guide.named_parameters() if k in before)
    tr = pyro.poutine.trace(guide).get_trace(X, y)
    assert site in tr.nodes and tr.nodes[site]["value"].shape == ()
