"""The count, continuous and heteroscedastic likelihoods in every model and optimiser: SOLVE-GP (``Trace_ELBO``
unbiased for its closed-form bound, the predictive distribution of ``y``), the output layer of a deep GP (the
sampled and the integrated last layer estimate the same bound; prediction), and ``ps.infer.NaturalGradient`` under
plain ``SVI``; ``fit`` with its default natural-gradient policy is exercised by the per-family fits."""

import math

import pyro
import pytest
import torch
from likelihood_cases import CASES, simulated
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps
from pyro_sparsegp.deep import build_deep_gp


@pytest.mark.parametrize("name", list(CASES))
def test_solvegp_bound_and_predictive(name):
    lik, X, y, _ = simulated(name, N=20)
    gp = ps.SOLVEGP(RBF(1, lengthscale=torch.tensor(0.8)), X[::5].clone(), X[2::5].clone(), lik)
    with torch.no_grad():
        gp.q_v.u_loc.copy_(0.3 * torch.randn_like(gp.q_v.u_loc))
    assert_trace_elbo_matches_closed_form(gp, X, y)
    mean, var, pred = gp.predict(X, full=True)
    assert isinstance(pred, torch.distributions.Distribution) and pred.batch_shape == (20,)
    qf = (mean, var) if lik.latent_dim == 1 else (mean.mT, var.mT)  # [N, 2] -> the likelihood's [2, N]
    torch.testing.assert_close(pred.log_prob(y), lik.predictive(*qf).log_prob(y))
    assert torch.isfinite(pred.log_prob(y)).all() and torch.isfinite(pred.mean).all()


@pytest.mark.parametrize("name", list(CASES))
def test_deep_gp_output_layer(name):
    """Two layers: Trace_ELBO with the last layer's f sampled (scored by distribution(f).log_prob) and integrated
    (scored by expected_log_prob) agree within Monte Carlo error; fit trains it and the predictive works."""
    lik, X, y, _ = simulated(name, N=12)
    dgp = build_deep_gp(X, [1], lik, num_inducing=4, hidden_scale=0.3)
    assert dgp.last.num_outputs == (None if lik.latent_dim == 1 else 2)
    elbo = Trace_ELBO(num_particles=200, vectorize_particles=True, max_plate_nesting=2)
    est = []
    for marginalize in (True, False):
        dgp.marginalize_last = marginalize
        with torch.no_grad():
            vals = torch.tensor([elbo.loss(dgp.model, dgp.guide, X, y) for _ in range(8)])
        est.append((vals.mean(), vals.std() / math.sqrt(len(vals))))
    (a, sa), (b, sb) = est
    assert sa > 0 and sb > 0 and (a - b).abs() < 4 * math.hypot(sa, sb), est
    state = ps.infer.fit(dgp, X, y, num_steps=30, lr=0.03, progress=False)
    assert all(math.isfinite(v) for v in state.losses)
    lp = dgp.predictive_log_prob(X, y, num_samples=5)
    assert lp.shape == (12,) and torch.isfinite(lp).all()


@pytest.mark.parametrize("name", list(CASES))
def test_natural_gradient_under_svi_trains_q_u_and_the_likelihood(name):
    lik, X, y, _ = simulated(name, N=40)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.7)), X[::8].clone(), lik)
    optim = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.05}), natgrad=0.1)
    svi = SVI(gp.model, gp.guide, optim, Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=2))
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    losses = [svi.step(X, y) for _ in range(40)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < sum(losses[:10]), losses
    for n, p in gp.named_parameters():  # q(u) by natural steps, the kernel, Z and the likelihood by Adam
        assert not torch.equal(p.detach(), before[n]), n
