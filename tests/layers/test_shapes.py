"""Shapes, Pyro's distribution contract, vectorised particles and plates, SVI updating every parameter,
Predictive, and two stacked layers."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.distributions import MarginalizedLikelihood

BATCH_SHAPES = [(), (4,), (2, 3)]


@pytest.mark.parametrize("batch_shape", BATCH_SHAPES, ids=str)
@pytest.mark.parametrize("lik", [ps.Gaussian, ps.Bernoulli], ids=["gaussian", "bernoulli"])
def test_marginalized_likelihood_contract(batch_shape, lik):
    lik = lik()
    d = MarginalizedLikelihood(lik, torch.randn(batch_shape), torch.rand(batch_shape) + 0.1, validate_args=True)
    assert d.batch_shape == batch_shape and d.event_shape == ()
    y = d.sample()
    assert y.shape == batch_shape
    assert d.log_prob(y).shape == batch_shape
    e = d.expand((5,) + batch_shape)
    assert e.batch_shape == (5,) + batch_shape
    assert e.log_prob(e.sample()).shape == (5,) + batch_shape
    torch.testing.assert_close(e.log_prob(y)[0], d.log_prob(y))
    assert d.sample((7,)).shape == (7,) + batch_shape
    if isinstance(lik, ps.Bernoulli):
        with pytest.raises(ValueError):
            d.log_prob(torch.full(batch_shape, 2.0))
    with pytest.raises(ValueError):
        MarginalizedLikelihood(lik, torch.zeros(batch_shape), -torch.ones(batch_shape), validate_args=True)


@pytest.mark.parametrize("L", [None, 4], ids=str)
def test_variational_family_shapes(L):
    q = ps.variational.GaussianQ(5, L)
    d = q()
    assert d.event_shape == (5,)
    assert d.batch_shape == (() if L is None else (L, 1))


def _gp(num_outputs=None, whiten=True, lik=None, Z_per_output=False):
    D, M = 2, 5
    Z = torch.randn(num_outputs, M, D) if Z_per_output else torch.randn(M, D)
    return ps.SVGP(RBF(D), Z, lik, num_outputs=num_outputs, whiten=whiten)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize(
    "num_outputs,Z_per_output,nesting",
    # L outputs need the outputs plate at dim -2, so max_plate_nesting >= 2 for them
    [(None, False, 1), (None, False, 2), (None, False, 3), (3, False, 2), (3, False, 3), (3, True, 2), (3, True, 3)],
    ids=str,
)
def test_vectorised_particles_and_plates(num_outputs, Z_per_output, whiten, nesting):
    gp = _gp(num_outputs, whiten, Z_per_output=Z_per_output)
    X = torch.randn(11, 2)
    P = 4
    with pyro.plate("particles", P, dim=-nesting - 1):
        tr = pyro.poutine.trace(gp.guide).get_trace(X)
    u, f = tr.nodes["gp.u"]["value"], tr.nodes["gp.f"]["value"]
    shape = (P,) + (1,) * (nesting - 1 - (num_outputs is not None)) + (() if num_outputs is None else (3,)) + (11,)
    assert f.shape == torch.Size(shape)
    # each particle's mean is that particle's own u pushed through Kfu Kuu^-1 (a naive u @ W mixes them)
    fn = tr.nodes["gp.f"]["fn"]
    Kuu = gp.kernel(gp.Z) if not Z_per_output else torch.stack([gp.kernel(z) for z in gp.Z])
    Kuf = gp.kernel(gp.Z, X) if not Z_per_output else torch.stack([gp.kernel(z, X) for z in gp.Z])
    Luu = torch.linalg.cholesky(Kuu + 1e-10 * torch.eye(5))
    for p in range(P):
        up = u[p].reshape(-1, 5) if num_outputs else u[p].reshape(5)
        if whiten:
            up = (Luu @ up.unsqueeze(-1)).squeeze(-1)
        expect = (torch.linalg.solve(Kuu, Kuf) * up.unsqueeze(-1)).sum(-2)
        tol = 1e-6 if X.dtype == torch.float64 else 1e-4
        torch.testing.assert_close(fn.loc[p].reshape(expect.shape), expect, rtol=tol, atol=tol)
    # the model's trace under the same plates has consistent shapes and ELBOs run vectorised
    gp.likelihood = ps.Gaussian()
    y = torch.randn(11) if num_outputs is None else torch.randn(11, 3)
    for elbo in (Trace_ELBO, TraceMeanField_ELBO):
        loss = elbo(num_particles=P, vectorize_particles=True, max_plate_nesting=nesting).loss(gp.model, gp.guide, X, y)
        assert torch.isfinite(torch.tensor(loss))


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_every_parameter_changes_after_one_svi_step(whiten, local):
    with pyro.settings.context(module_local_params=local):
        gp = _gp(None, whiten, ps.Gaussian())
        gp.kernel = RBF(2, lengthscale=torch.ones(2))
        X, y = torch.randn(20, 2), torch.randn(20)
        svi = SVI(gp.model, gp.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        before = {k: v.detach().clone() for k, v in gp.named_parameters()}
        assert {k.replace("_unconstrained", "") for k in before} == {
            "kernel.variance",
            "kernel.lengthscale",
            "inducing.Z",
            "likelihood.noise",
            "q_u.u_loc",
            "q_u.u_scale_tril",
        }
        svi.step(X, y)
        for k, v in gp.named_parameters():
            changed = v.detach() != before[k]
            if k.startswith("q_u.u_scale_tril"):
                changed = changed[torch.tril_indices(5, 5)[0], torch.tril_indices(5, 5)[1]]
            assert changed.all(), k


def test_predictive_and_predict():
    gp = _gp(None, True, ps.Gaussian())
    X = torch.randn(30, 2)
    pred = Predictive(gp.model, guide=gp.guide, num_samples=13, return_sites=["gp.f", "y"])
    s = pred(X)
    assert s["gp.f"].shape == (13, 30) and s["y"].shape == (13, 30)
    mean, var = gp.predict(X)
    assert mean.shape == var.shape == (30,)
    assert (var > 0).all()
    # Monte Carlo over q(u) p(f|u) agrees with the analytic q(f) marginals
    big = Predictive(gp.model, guide=gp.guide, num_samples=4000, return_sites=["gp.f"], parallel=True)(X)["gp.f"]
    torch.testing.assert_close(big.mean(0), mean, atol=5 * (var.max() / 4000) ** 0.5, rtol=0)
    mean3, var3 = _gp(3, True, ps.Gaussian()).predict(X)
    assert mean3.shape == (30, 3)  # like the training y [N, L]


def test_two_stacked_layers_train():
    """Smoke test of a two-layer deep GP written by hand from the layers' site methods."""
    X = torch.linspace(-2, 2, 40).unsqueeze(-1)
    y = torch.sign(X[:, 0]) + 0.05 * torch.randn(40)
    layer1 = ps.SVGP(Matern32(1), torch.linspace(-2, 2, 6).unsqueeze(-1), num_outputs=2, name="h")
    layer2 = ps.SVGP(RBF(2), torch.randn(6, 2), ps.Gaussian(0.1), name="g")
    lik = layer2.likelihood

    def model(X, y):
        u1, u2 = layer1.sample_u(), layer2.sample_u()
        with pyro.plate("data", X.shape[0], dim=-1):
            h = layer1.sample_hidden(X, u1)  # [..., 1, N, 2]: the next layer's inputs
            f = layer2.sample_f(h, u2)
            lik(f, y)

    def guide(X, y):
        u1, u2 = layer1.sample_u(guide=True), layer2.sample_u(guide=True)
        with pyro.plate("data", X.shape[0], dim=-1):
            h = layer1.sample_hidden(X, u1, guide=True)
            layer2.sample_f(h, u2, guide=True)

    params = list(layer1.parameters()) + list(layer2.parameters())
    opt = torch.optim.Adam(params, lr=0.02)
    elbo = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = elbo.differentiable_loss(model, guide, X, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    assert all(p.grad is not None for p in params)
    _ = dist


@pytest.mark.parametrize("N", [5, 3])  # N == L: a transposed predictive would broadcast silently
def test_multi_output_predictive_is_laid_out_like_y(N):
    """``predict(X, full=True)`` with ``L`` outputs: the predictive distribution of ``y*`` has ``y``'s layout
    ``[N, L]``, entry ``(n, l)`` the Normal of output ``l`` at ``x_n`` with the noise added (an independent check from
    ``mean``/``var``); a ``K``-class likelihood still predicts ``y* [N]``."""
    X = torch.randn(40, 2)
    Y = torch.stack([torch.sin(X[:, 0]), X[:, 1], X[:, 0] * X[:, 1]], -1)
    gp = ps.SVGP(RBF(2), X[:6].clone(), ps.Gaussian(0.2), num_outputs=3)
    mean, var, pred = gp.predict(X[:N], full=True)
    assert mean.shape == var.shape == pred.batch_shape == (N, 3)
    expected = torch.distributions.Normal(mean, (var + 0.2).sqrt()).log_prob(Y[:N])
    torch.testing.assert_close(pred.log_prob(Y[:N]), expected)
    clf = ps.SVGP(RBF(2), X[:6].clone(), ps.RobustMax(3))
    assert clf.predict(X[:N], full=True)[2].batch_shape == (N,)
