"""The program a Pyro user writes around an LMC layer with missing outputs: a ``PyroSample`` hyperprior on the shared
kernel's lengthscale fitted by an ``AutoNormal`` beside the layer's guide, vectorised particles, minibatches, plain
``SVI``; every parameter trains (``W`` included), the particles do not broadcast against each other, and the
estimate is the layer's closed-form bound at the hyperprior's value (Monte Carlo, standard errors)."""

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample

import pyro_sparsegp as ps


def _data(N=120):
    torch.manual_seed(0)
    X = torch.linspace(0, 6, N).unsqueeze(-1)
    g = torch.stack([torch.sin(X[:, 0]), torch.cos(1.3 * X[:, 0])])  # [Q, N]
    y = (torch.tensor([[1.0, 0.5], [0.8, -0.6], [0.3, 1.0]]) @ g).T + 0.1 * torch.randn(N, 3)  # [N, L]
    y[40:70, 0] = float("nan")
    return X, y


def _layer(X):
    kernel = RBF(1)
    kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 0.5))
    return ps.SVGP(kernel, X[::12].clone(), ps.Gaussian(0.1), num_outputs=3, num_latents=2, name="lmc")


def test_hyperprior_autoguide_and_particles_train_every_parameter():
    X, y = _data()
    gp = _layer(X)
    guide = AutoGuideList(gp.model, create_plates=gp.create_plates)
    guide.append(AutoNormal(poutine.block(gp.model, expose=["lmc.kernel.lengthscale"])))
    guide.append(gp.guide)
    elbo = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    ps.check_model(gp.model, guide, X, y, elbo=elbo, subsample_size=40)  # no site counts the data twice
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.03}), elbo)
    svi.step(X, y, subsample_size=40)
    params = {**dict(guide.named_parameters()), **{k: v for k, v in gp.named_parameters()
                                                     if not k.endswith("_map_unconstrained")}}  # contrib.gp's MAP copy
    before = {k: v.detach().clone() for k, v in params.items()}
    assert any("lengthscale" in k for k in before) and any(k.startswith("W") for k in before), sorted(before)
    losses = [svi.step(X, y, subsample_size=40) for _ in range(150)]
    for k, v in params.items():
        assert not torch.equal(v.detach(), before[k]), f"{k} never trained"
    assert sum(losses[-20:]) < sum(losses[:20])


def test_trace_elbo_estimates_the_bound_at_the_hyperprior_value():
    """With the hyperparameter drawn at one value (a point-mass guide before the layer's), the vectorised
    ``Trace_ELBO`` averages to the layer's closed-form bound over the observed entries plus the hyperprior's
    log-density there (4 standard errors of 12 independent estimates)."""
    X, y = _data(60)
    gp = _layer(X)
    value = torch.tensor(3.0)  # where the hyperprior's log-density (-3.7) stands out of the Monte Carlo error
    with torch.no_grad():
        gp.q_u.u_loc.normal_()
    gp.q_u.u_scale_tril = 0.01 * torch.eye(len(gp.Z)).expand(2, -1, -1)  # a narrow q(u): a small Monte Carlo error
    conditioned = {"lmc.kernel.lengthscale": value}
    model = gp.model  # replays the guide's value; its prior's log-density joins the bound

    def guide(X, y):
        pyro.sample("lmc.kernel.lengthscale", dist.Delta(value))  # the hyperparameter drawn before the layer's guide
        return gp.guide(X, y)

    elbo = Trace_ELBO(num_particles=1000, vectorize_particles=True, max_plate_nesting=2)
    with torch.no_grad():
        draws = torch.tensor([-elbo.loss(model, guide, X, y) for _ in range(12)])
        with poutine.condition(data=conditioned):
            bound = gp.analytic_elbo(X, y).item() + dist.LogNormal(0.0, 0.5).log_prob(value).item()
    se = draws.std().item() / 12 ** 0.5
    assert se > 0 and abs(draws.mean().item() - bound) < 4 * se, (draws.mean().item(), bound, se)
