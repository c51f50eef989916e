"""Defects found while writing the composability tutorials (tutorials/hierarchical_gp.ipynb, gplvm.ipynb), each with
the smallest program that shows it."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample

import pyro_sparsegp as ps


def _hyper(msg):
    return msg["name"].startswith(("gp.kernel.", "gp.likelihood."))


def _svgp(X):
    k = RBF(X.shape[-1])
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(X.shape[-1]), 1.0).to_event(1))
    return ps.SVGP(k, X[:5].clone(), ps.Gaussian(0.1))


def test_autoguide_list_plate_of_another_size_is_refused_loudly():
    """AutoGuideList draws the model's data plate from its prototype trace (the training size and minibatch). A
    program run on other inputs (Predictive on test points) joined those indices silently: the layer's guide then
    failed with a shape mismatch, and a user's guide ``X[i]`` picked rows by indices of the training set. The join
    must refuse a plate of another size and name the fix (AutoGuideList(..., create_plates=...))."""
    torch.manual_seed(0)
    X, y, Xt = torch.randn(40, 2), torch.randn(40), torch.randn(25, 2)
    gp = _svgp(X)
    guide = AutoGuideList(gp.model)
    guide.append(AutoNormal(poutine.block(gp.model, expose_fn=_hyper)))
    guide.append(gp.guide)
    SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO()).step(X, y, subsample_size=10)
    with pytest.raises(ValueError, match="create_plates"):
        Predictive(gp.model, guide=guide, num_samples=3, return_sites=["gp.f"])(Xt)


def test_user_guide_plate_of_another_size_is_refused_loudly():
    """The same with a data plate the user owns (ps.context.plate in the guide part)."""
    X = torch.randn(40, 2)
    gp = _svgp(X)

    def model(X):
        u = gp.sample_u()
        with pyro.plate("data", len(X), subsample_size=10) as i:
            gp.sample_f(X[i], u)

    def guide(X):
        u = gp.sample_u(guide=True)
        with ps.context.plate("data", len(X), subsample_size=10) as i:
            gp.sample_f(X[i], u, guide=True)

    g = AutoGuideList(model)
    g.append(AutoNormal(poutine.block(model, expose_fn=_hyper)))
    g.append(guide)
    poutine.trace(g).get_trace(X)
    with pytest.raises(ValueError, match="create_plates"):
        poutine.trace(g).get_trace(torch.randn(60, 2))  # indices from range(40) would index the 60 rows silently


def test_create_plates_predicts_on_new_inputs():
    """The documented fix: AutoGuideList(model, create_plates=...) draws the plate from the call's own inputs, so
    Predictive on test points gives f at every test point, in order, averaged over q(theta) q(u)."""
    torch.manual_seed(0)
    X, Xt = torch.randn(40, 2), torch.randn(25, 2)
    y = X.sum(-1)
    gp = _svgp(X)
    guide = AutoGuideList(gp.model, create_plates=gp.create_plates)  # the layer's own plate, from each call's X
    guide.append(AutoNormal(poutine.block(gp.model, expose_fn=_hyper)))
    guide.append(gp.guide)
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    for _ in range(3):
        svi.step(X, y, subsample_size=10)
    tr = poutine.trace(guide).get_trace(X, y, subsample_size=10)
    assert tr.nodes["gp.data"]["value"].shape == (10,)
    tr = poutine.trace(guide).get_trace(X[:10], y[:10], num_data=40)  # a minibatch of 40 points: scaled by 4
    assert tr.nodes["gp.data"]["value"].tolist() == list(range(10)) and tr.nodes["gp.data"]["fn"].size == 40
    f = Predictive(gp.model, guide=guide, num_samples=200, return_sites=["gp.f"])(Xt)["gp.f"]
    assert f.shape == (200, 25)
    # independent: the layer's predict under each of the autoguide's draws of the lengthscale, averaged
    means = []
    for _ in range(200):
        ls = guide[0]()["gp.kernel.lengthscale"].detach()
        with poutine.condition(data={"gp.kernel.lengthscale": ls}):
            means.append(gp.predict(Xt)[0])
    means = torch.stack(means)
    # two independent 200-draw Monte Carlo means of E[f*]: 4 computed standard errors of their difference, per point
    se = (means.var(0) / len(means) + f.var(0) / len(f)).sqrt()
    assert ((f.mean(0) - means.mean(0)).abs() < 4 * se).all(), ((f.mean(0) - means.mean(0)) / se).abs().max()


def test_autoguide_hyperprior_inside_a_deep_gp():
    """A PyroSample hyperprior on a DeepGP layer's kernel, drawn by an AutoNormal beside the DeepGP's guide: the
    model reads the guide's draw (replay gives the same value, and two conditioned values give two losses), and SVI
    trains the autoguide. Before, DeepGP's own method asked the nested layer for site names it did not have yet."""
    torch.manual_seed(0)
    X = torch.randn(50, 2)
    y = X.sum(-1)
    k = RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
    gp = ps.SVGP(k, X[:6].clone(), ps.Gaussian(0.1), name="hyp")
    dgp = ps.DeepGP([gp], marginalize_last=True)
    guide = AutoGuideList(dgp.model, create_plates=dgp.create_plates)
    guide.append(AutoNormal(poutine.block(dgp.model, expose=["hyp.kernel.lengthscale"])))
    guide.append(dgp.guide)
    svi = SVI(dgp.model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
    svi.step(X, y)
    name = "locs.hyp.kernel.lengthscale_unconstrained"
    loc0 = dict(guide[0].named_parameters())[name].detach().clone()
    losses = [svi.step(X, y) for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    loc = dict(guide[0].named_parameters())[name].detach()
    assert not torch.equal(loc, loc0)
    tr = poutine.trace(guide).get_trace(X, y)
    mtr = poutine.trace(poutine.replay(dgp.model, trace=tr)).get_trace(X, y)
    assert torch.equal(mtr.nodes["hyp.kernel.lengthscale"]["value"], tr.nodes["hyp.kernel.lengthscale"]["value"])
    vals = []
    for ls in (0.3, 3.0):  # the model's likelihood follows the lengthscale the guide drew
        tr.nodes["hyp.kernel.lengthscale"]["value"] = torch.full((2,), ls)
        vals.append(poutine.trace(poutine.replay(dgp.model, trace=tr)).get_trace(X, y).log_prob_sum().item())
    assert abs(vals[0] - vals[1]) > 1.0, vals
