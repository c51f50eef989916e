"""ps.GPLVM: the minibatch bound against a dense full-data computation (the latents' KL scaled by N/B), NaN-masked
entries, the encoder's gradients, inference of q(x*) for new rows, composability (hyperprior with an autoguide,
vectorised particles) and save/reload. Tiny sizes: the whole file runs in a few CPU-seconds."""

import itertools

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.layers.gplvm import mlp_encoder

N, D, Q, M = 6, 3, 2, 4


def _data(n=N, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 4
    return torch.stack([torch.sin(t + k) for k in range(d)], -1) + 0.1 * torch.randn(n, d, generator=g)


def _gplvm(Y, **kw):
    kw.setdefault("num_data", len(Y))
    return ps.GPLVM(Y.shape[-1], Q, num_inducing=M, likelihood=ps.Gaussian(0.3), **kw)


def _dense_terms(g, Y):
    """Dense, by explicit inverses at x = the latent means: the expected log-likelihood per row [N], KL(q(u))."""
    k, Z, noise = g.kernel, g.gp.Z.detach(), g.likelihood.noise.detach()
    x = g.x_loc.detach()
    Kuu = k(Z).detach()
    Kuu = Kuu + 1e-10 * Kuu.diagonal().mean() * torch.eye(M)  # the layer's float64 jitter (linalg.default_jitter)
    Luu = torch.linalg.cholesky(Kuu)
    rows = torch.zeros(len(Y))
    kl_u = 0.0
    for d in range(Y.shape[-1]):
        mv, Lv = g.gp.q_u.u_loc[d].detach(), g.gp.q_u.u_scale_tril[d].detach()
        mu, var = B.qf_dense(Kuu, k(Z, x).detach(), k(x, diag=True).detach(), Luu @ mv, Luu @ Lv)
        obs = ~torch.isnan(Y[:, d])
        term = dist.Normal(mu, noise.sqrt()).log_prob(Y[:, d].nan_to_num(0.0)) - 0.5 * var / noise
        rows = rows + torch.where(obs, term, torch.zeros(()))
        kl_u = kl_u + B.gauss_kl(mv, Lv)
    return rows, kl_u


@pytest.mark.float64
def test_minibatch_bound_is_unbiased_for_the_dense_full_data_bound():
    """With q(x) of tiny variance the bound is deterministic: the average over all minibatches of B = 2 rows of the
    minibatch bound (num_data = N: rows' terms scaled by N / B, the latents' KL among them) equals the dense
    full-data bound; dropping the scale (num_data=None) does not."""
    Y = _data()
    g = _gplvm(Y, x_scale=1e-6)
    rows, kl_u = _dense_terms(g, Y)
    s = g.x_scale.detach()
    kl_x = (0.5 * (g.x_loc.detach() ** 2 + s**2 - 1) - s.log()).sum(-1)  # [N]
    dense = (rows - kl_x).sum() - kl_u
    X = g.rows()
    with torch.no_grad():
        ests = [g.analytic_elbo(X[list(i)], Y[list(i)], num_data=N) for i in itertools.combinations(range(N), 2)]
        unscaled = g.analytic_elbo(X[:2], Y[:2])
    assert torch.allclose(torch.stack(ests).mean(), dense, rtol=1e-6), (torch.stack(ests).mean(), dense)
    assert not torch.allclose(unscaled, (rows[:2] - kl_x[:2]).sum() * N / 2 - kl_u, rtol=1e-3)


def test_pyro_program_scales_the_latents_like_the_data():
    """The model/guide pair on a minibatch: the x site (prior and guide) and y carry scale N / B, u scale 1, and
    Trace_ELBO's estimate agrees with the closed-form minibatch bound within Monte Carlo error."""
    Y = _data()
    g = _gplvm(Y)
    X = g.rows()[:2]
    guide_tr = poutine.trace(g.guide).get_trace(X, Y[:2], num_data=N)
    model_tr = poutine.trace(poutine.replay(g.model, trace=guide_tr)).get_trace(X, Y[:2], num_data=N)
    for tr in (guide_tr, model_tr):
        assert tr.nodes["gplvm.x"]["scale"] == N / 2 and tr.nodes["gplvm.gp.u"]["scale"] == 1.0
    assert model_tr.nodes["y"]["scale"] == N / 2
    elbo = Trace_ELBO(num_particles=250, vectorize_particles=True, max_plate_nesting=2)
    g.num_samples = 2000  # the closed-form bound averaged over 2000 draws of x
    with torch.no_grad():
        losses = torch.tensor([elbo.loss(g.model, g.guide, X, Y[:2], num_data=N) for _ in range(6)])
        exact = -g.analytic_elbo(X, Y[:2], num_data=N)
    se = losses.std() / 6**0.5
    assert abs(losses.mean() - exact) < 4 * se + 0.02 * abs(exact), (losses.mean(), exact, se)


@pytest.mark.float64
def test_nan_entries_contribute_nothing():
    """A NaN entry gives the bound with that entry's term dropped (dense); the Pyro program masks it too."""
    Y = _data()
    g = _gplvm(Y, x_scale=1e-6)
    Yn = Y.clone()
    Yn[1, 2] = Yn[4, 0] = float("nan")
    rows_full, _ = _dense_terms(g, Y)
    rows_nan, _ = _dense_terms(g, Yn)
    assert not torch.allclose(rows_full, rows_nan)
    X = g.rows()
    with torch.no_grad():
        gap = g.analytic_elbo(X, Y) - g.analytic_elbo(X, Yn)
    assert torch.allclose(gap, (rows_full - rows_nan).sum(), rtol=1e-6)
    tr = poutine.trace(poutine.replay(g.model, trace=poutine.trace(g.guide).get_trace(X, Yn))).get_trace(X, Yn)
    site = tr.nodes["y"]
    assert site["mask"].shape == (D, N) and int((~site["mask"]).sum()) == 2
    f = tr.nodes["gplvm.gp.f"]["value"]  # [D, N]
    by_hand = dist.Normal(f, g.likelihood.noise.sqrt()).log_prob(Yn.mT.nan_to_num(0.0))[site["mask"]].sum()
    assert torch.allclose(tr.log_prob_sum(lambda name, s: name == "y"), by_hand)


def test_encoder_gets_gradients_and_trains():
    """Every encoder parameter has a non-zero gradient after one backward of the bound; SVI moves them (they are
    parameter sites); fit lowers the loss."""
    Y = _data(n=24)
    g = _gplvm(Y, encoder=mlp_encoder(D, Q, hidden=(8,)), num_data=None)
    X = torch.arange(24).unsqueeze(-1)
    (-g.analytic_elbo(X[:8], Y[:8], num_data=24)).backward()
    for name, p in g.encoder.named_parameters():
        assert p.grad is not None and bool((p.grad != 0).any()), name
    before = [p.detach().clone() for p in g.encoder.parameters()]
    svi = SVI(g.model, g.guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(max_plate_nesting=2))
    svi.step(X, Y, subsample_size=8)
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, g.encoder.parameters(), strict=True))
    losses = ps.infer.fit(g, X, Y, num_steps=40, batch_size=8, lr=0.03, progress=False).losses
    assert sum(losses[-10:]) < sum(losses[:10])


def test_infer_latent_recovers_a_training_row_and_reconstructs_new_rows():
    """After training, the q(x*) inferred for a training row (GP frozen) is near its trained q(x_n); new rows with NaN
    get finite q(x*) and reconstructions, and the encoder version works the same way."""
    Y = _data(n=30, d=4)
    g = ps.GPLVM(4, Q, num_inducing=M, num_data=30, X_init=ps.layers.gplvm.pca_init(Y, Q))
    ps.infer.fit(g, g.rows(), Y, num_steps=60, batch_size=30, lr=0.05, progress=False)
    g.num_samples = 8  # then the latents alone to their optimum given the GP, through the training bound
    opt = torch.optim.Adam([g.x_loc_unconstrained, g.x_scale_unconstrained], lr=0.05)
    for _ in range(120):
        opt.zero_grad()
        (-g.analytic_elbo(g.rows(), Y)).backward()
        opt.step()
    mean, var = g.infer_latent(Y[:5], steps=120, lr=0.05, num_samples=8)
    assert mean.shape == var.shape == (5, Q)
    spread = g.x_loc.detach().std(0).norm()
    assert (mean - g.x_loc.detach()[:5]).norm(dim=-1).max() < 0.2 * spread
    assert torch.allclose(var, g.x_scale.detach()[:5] ** 2, rtol=0.5)
    Yn = _data(n=3, d=4, seed=1)
    Yn[0, 1] = float("nan")
    m, v = g.reconstruct(Yn, steps=20)
    assert m.shape == v.shape == (3, 4) and bool(torch.isfinite(m).all()) and bool((v > 0).all())
    e = ps.GPLVM(4, Q, num_inducing=M, encoder=mlp_encoder(4, Q, hidden=(8,)))
    x_mean, x_var = e.infer_latent(Yn, steps=5)
    assert x_mean.shape == (3, Q) and bool(torch.isfinite(x_var).all())


def test_hyperprior_with_an_autoguide_beside_the_guide():
    """A PyroSample lengthscale, AutoNormal on it beside the GPLVM's guide in AutoGuideList (create_plates: the plate
    from each call's rows): SVI trains both; infer_latent refuses the sampled hyperparameter loudly."""
    Y = _data(n=12)
    k = pyro.contrib.gp.kernels.RBF(Q)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(Q), 1.0).to_event(1))
    g = _gplvm(Y, kernel=k, name="hp")
    guide = AutoGuideList(g.model, create_plates=g.create_plates)
    guide.append(AutoNormal(poutine.block(g.model, expose=["hp.gp.kernel.lengthscale"])))
    guide.append(g.guide)
    svi = SVI(g.model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO(max_plate_nesting=2))
    X = g.rows()
    losses = [svi.step(X, Y, subsample_size=4) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any("lengthscale" in n for n, _ in guide.named_parameters())
    with pytest.raises(ValueError, match="hyperprior"):
        g.infer_latent(Y[:2])


@pytest.mark.parametrize("encoder", [False, True])
def test_vectorised_particles_pass_the_checker(encoder):
    """Trace_ELBO with vectorised particles: ps.check_model passes (x is [P, 1, B, Q], f [P, D, B]) and a few SVI
    steps are finite."""
    Y = _data(n=12)
    Y[3, 1] = float("nan")
    g = _gplvm(Y, encoder=mlp_encoder(D, Q, hidden=(8,)) if encoder else None, num_data=None if encoder else 12)
    X = torch.arange(12).unsqueeze(-1)
    elbo = Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=2)
    assert ps.check_model(g.model, g.guide, X, Y, elbo=elbo) is None
    svi = SVI(g.model, g.guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    assert all(torch.isfinite(torch.tensor(svi.step(X, Y, subsample_size=4))) for _ in range(3))


def test_save_and_reload_give_the_same_reconstructions(tmp_path):
    """state_dict into a module built the same way (both guides), and ps.saving's layout file (per-point guide)."""
    Y = _data(n=10)
    for encoder in (None, mlp_encoder(D, Q, hidden=(8,))):
        g = _gplvm(Y, encoder=encoder, num_data=None if encoder is not None else 10, name="sv")
        ps.infer.fit(g, torch.arange(10).unsqueeze(-1), Y, num_steps=10, batch_size=5, progress=False)
        torch.manual_seed(3)
        ref = g.reconstruct(Y[:3], steps=5)[0]
        torch.save(g.state_dict(), tmp_path / "g.pt")
        enc2 = None if encoder is None else mlp_encoder(D, Q, hidden=(8,))
        g2 = _gplvm(Y, encoder=enc2, num_data=None if encoder is not None else 10, name="sv")
        g2.load_state_dict(torch.load(tmp_path / "g.pt"))
        torch.manual_seed(3)
        assert torch.allclose(g2.reconstruct(Y[:3], steps=5)[0], ref)
    ps.saving.save(g2 if encoder is None else _per_point_fitted(Y), tmp_path / "layout.pt")
    g3 = ps.saving.load(tmp_path / "layout.pt")
    assert isinstance(g3, ps.GPLVM) and g3.x_loc.shape == (10, Q)


def _per_point_fitted(Y):
    g = _gplvm(Y, name="pp")
    ps.infer.fit(g, g.rows(), Y, num_steps=5, batch_size=5, progress=False)
    return g
