"""``Trace_ELBO`` against a layer's closed-form bound: the Monte Carlo estimate of the sample-site path equals
``-analytic_elbo`` within its standard error (shared by the convolutional and the sum-kernel tests)."""

import math

import torch
from pyro.infer import Trace_ELBO


def assert_trace_elbo_matches_closed_form(gp, X, y):
    """``Trace_ELBO`` (20 batches of 500 vectorised particles) equals ``-analytic_elbo`` within 4 standard errors,
    at a ``q(u)`` moved off its initial value (a multi-output robust-max layer with ``f`` integrated out)."""
    with torch.no_grad():
        gp.q_u.u_loc.copy_(0.5 * torch.randn_like(gp.q_u.u_loc))
        gp.q_u.u_scale_tril.mul_(0.7)
    exact = -gp.analytic_elbo(X, y, num_data=X.shape[0]).item()
    elbo = Trace_ELBO(num_particles=500, vectorize_particles=True, max_plate_nesting=2)
    with torch.no_grad():
        vals = torch.tensor([elbo.loss(gp.model, gp.guide, X, y) for _ in range(20)])
    se = vals.std() / math.sqrt(len(vals))
    assert se > 0
    assert (vals.mean() - exact).abs() < 4 * se, (vals.mean(), exact, se)
