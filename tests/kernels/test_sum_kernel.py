"""Sums of independent GPs (``SumKernel``) with one inducing variable per part (``InducingSum``): van der Wilk et al.
2017's weighted-conv + RBF model. Covariances against the parts computed separately, the bound against the dense
KL-sparse bound, Trace_ELBO against the closed form, SOLVE-GP with the prior q(v⊥) against SVGP, and Pyro idioms."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern52
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroSample
from trace_elbo_checks import assert_trace_elbo_matches_closed_form

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.covariances import Kdiag, Kuf, Kuu, check
from pyro_sparsegp.infer import fit

H, W, C = 5, 4, 1
D = H * W * C


def _kernel(tick=False):
    base = RBF(9, variance=torch.tensor(1.3), lengthscale=torch.tensor(1.7))
    conv = ps.TICK(base, (H, W, C), 3, 1, location_lengthscale=2.0) if tick else ps.ConvKernel(base, (H, W, C), 3, 1)
    with torch.no_grad():
        conv.weights = torch.randn(conv.num_patches).exp()
    return ps.SumKernel(conv, RBF(D, variance=torch.tensor(0.8), lengthscale=torch.tensor(2.5)))


def _inducing(k, Mc=4, Mr=3, L=None):
    lead = () if L is None else (L,)
    Zc = torch.randn(lead + (Mc, 9))
    conv = k.kernels[0]
    part = ps.IndexedInducingPatches(Zc, grid=conv.grid) if isinstance(conv, ps.TICK) else ps.InducingPatches(Zc)
    return ps.InducingSum(part, torch.randn(lead + (Mr, D)))


def _dense(ind, k, X):
    """Kuu (block-diagonal), Kuf (stacked) and the diagonal from each part's own covariances."""
    conv, rbf = k.kernels
    pc, pr = ind.parts
    Kuu_ = torch.block_diag(Kuu(pc, conv), rbf(pr.Z))
    Kuf_ = torch.cat([Kuf(pc, conv, X), rbf(pr.Z, X)], -2)
    return Kuu_, Kuf_, conv.Kff(X).diagonal() + rbf(X, diag=True)


@pytest.mark.float64
@pytest.mark.parametrize("tick", [False, True], ids=["wconv", "tick"])
@torch.no_grad()
def test_sum_covariances_are_the_parts_and_the_joint_is_psd(tick):
    k = _kernel(tick)
    ind = _inducing(k)
    check(ind, k)
    X, X2 = torch.randn(5, D), torch.randn(3, D)
    conv, rbf = k.kernels
    torch.testing.assert_close(k(X, X2), conv.Kff(X, X2) + rbf(X, X2))
    Kuu_, Kuf_, kdiag = _dense(ind, k, X)
    torch.testing.assert_close(Kuu(ind, k), Kuu_)
    torch.testing.assert_close(Kuf(ind, k, X), Kuf_)
    torch.testing.assert_close(Kdiag(k, X), kdiag)
    torch.testing.assert_close(k(X, diag=True), k(X).diagonal())
    assert ind.num_inducing == 7
    joint = torch.cat([torch.cat([Kuu_, Kuf_], -1), torch.cat([Kuf_.mT, k(X)], -1)], -2)
    assert torch.linalg.eigvalsh(joint).min() > -1e-10
    # Kuu of an orthogonal set (SOLVE-GP's Kuv): block-diagonal between the matching parts
    other = _inducing(k, Mc=2, Mr=5)
    Kuv = Kuu(ind, k, other)
    assert Kuv.shape == (7, 7)
    torch.testing.assert_close(Kuv[:4, :2], Kuu(ind.parts[0], conv, other.parts[0]))
    torch.testing.assert_close(Kuv[4:, 2:], rbf(ind.parts[1].Z, other.parts[1].Z))
    floor = 1e3 * torch.finfo(Kuv.dtype).eps * Kuv.abs().max()  # the off-diagonal blocks are zero in exact arithmetic
    assert Kuv[:4, 2:].abs().max() <= floor and Kuv[4:, :2].abs().max() <= floor


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("lik", ["gaussian", "probit"])
def test_svgp_bound_with_a_sum_kernel_is_the_dense_kl_sparse_bound(lik, whiten):
    k = _kernel()
    ind = _inducing(k)
    X = torch.randn(8, D)
    if lik == "gaussian":
        likelihood, y = ps.Gaussian(noise=0.3), torch.randn(8)
        ell = likelihood.expected_log_prob
    else:
        likelihood, y = ps.Bernoulli(), torch.randint(0, 2, (8,)).double()
        ell = likelihood.quadrature_expected_log_prob
    gp = ps.SVGP(k, ind, likelihood, whiten=whiten)
    M = 7
    with torch.no_grad():
        Lq = torch.tril(0.3 * torch.randn(M, M), -1) + torch.diag(0.4 + 0.5 * torch.rand(M))
        gp.q_u.set(0.7 * torch.randn(M), Lq)
        Kuu_, Kuf_, kdiag = _dense(ind, k, X)
        dense = B.kl_sparse_bound(y, ell, Kuu_ + 1e-10 * torch.eye(M), Kuf_, kdiag, gp.q_u.u_loc,
                                  gp.q_u.u_scale_tril, whiten=whiten)
        torch.testing.assert_close(gp.analytic_elbo(X, y), dense, rtol=1e-7, atol=1e-7)


@pytest.mark.float64
def test_trace_elbo_with_many_particles_matches_the_closed_form():
    k = _kernel(tick=True)
    gp = ps.SVGP(k, _inducing(k), ps.RobustMax(3), num_outputs=3, whiten=False, integrate_f=True)
    assert_trace_elbo_matches_closed_form(gp, torch.randn(6, D), torch.randint(0, 3, (6,)).double())


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_solvegp_with_sum_inducing_and_prior_qv_equals_svgp(whiten):
    X, y = torch.randn(7, D), torch.randint(0, 3, (7,)).double()
    torch.manual_seed(1)
    k = _kernel()
    Z = _inducing(k)
    sol = ps.SOLVEGP(k, Z, _inducing(k, Mc=3, Mr=2), ps.RobustMax(3), num_outputs=3, whiten=whiten)
    svgp = ps.SVGP(k, Z, ps.RobustMax(3), num_outputs=3, whiten=whiten)
    with torch.no_grad():
        sol.q_u.u_loc.copy_(torch.randn(sol.q_u.u_loc.shape))
        svgp.q_u.set(sol.q_u.u_loc.clone(), sol.q_u.u_scale_tril.clone())
    b = svgp.analytic_elbo(X, y, num_data=20)
    torch.testing.assert_close(sol.analytic_elbo(X, y, num_data=20), b)
    with torch.no_grad():
        sol.q_v.u_loc.add_(0.3)
    assert (sol.analytic_elbo(X, y, num_data=20) - b).abs() > 1e-4


def test_per_output_sets_and_every_parameter_trains_under_fit():
    k = _kernel()
    gp = ps.SVGP(k, _inducing(k, L=3), ps.RobustMax(3), num_outputs=3)
    assert gp.inducing.batch_shape == (3,)
    X, y = torch.randn(20, D), torch.randint(0, 3, (20,))
    mean, var = gp.predict(X[:4])
    assert mean.shape == var.shape == (4, 3)
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    names = set(before)
    for part in ("kernels.0.weights", "kernels.0.base_kernel", "kernels.1", "inducing.parts.0.Z", "inducing.parts.1.Z"):
        assert any(part in n for n in names), (part, names)
    fit(gp, X, y.double() if torch.get_default_dtype() == torch.float64 else y.float(), num_steps=3, lr=0.05,
        progress=False)
    for n, p in gp.named_parameters():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not train"


def test_pyrosample_hyperprior_on_one_part_with_an_autoguide():
    """A user's program: a LogNormal hyperprior on the RBF part's lengthscale, AutoNormal for it beside the layer's
    own guide, Trace_ELBO; the hyperparameter's guide and the inducing patches both train."""
    k = _kernel()
    k.kernels[1].lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    gp = ps.SVGP(k, _inducing(k), ps.Gaussian(noise=0.3))
    X, y = torch.randn(12, D), torch.randn(12)
    hyper = AutoNormal(pyro.poutine.block(gp.model, expose=[f"{gp.name}.kernel.kernels.1.lengthscale"]))

    def guide(X, y):
        hyper(X, y)
        gp.guide(X, y)

    site = f"{gp.name}.kernel.kernels.1.lengthscale"
    trace = pyro.poutine.trace(gp.model).get_trace(X, y)
    assert site in trace.nodes, list(trace.nodes)
    svi = SVI(gp.model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    svi.step(X, y)
    Zc0 = gp.inducing.parts[0].Z.detach().clone()
    hyper0 = torch.cat([p.detach().flatten() for p in hyper.parameters()])
    for _ in range(5):
        svi.step(X, y)
    assert not torch.equal(gp.inducing.parts[0].Z.detach(), Zc0)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in hyper.parameters()]), hyper0)


def test_sum_errors_are_loud():
    k = _kernel()
    conv = k.kernels[0]
    with pytest.raises(ValueError, match="at least two"):
        ps.SumKernel(conv)
    with pytest.raises(ValueError, match="same features"):
        ps.SumKernel(conv, RBF(D + 1))
    with pytest.raises(ValueError, match="two or more"):
        ps.InducingSum(ps.InducingPatches(torch.randn(3, 9)))
    with pytest.raises(ValueError, match="batch shape"):
        ps.InducingSum(ps.InducingPatches(torch.randn(2, 3, 9)), torch.randn(3, D))
    ind = _inducing(k)
    with pytest.raises(ValueError, match="SumKernel"):
        ps.SVGP(conv, ind)
    with pytest.raises(ValueError, match="SumKernel of as many"):
        ps.SVGP(ps.SumKernel(conv, RBF(D), Matern52(D)), ind)
    with pytest.raises(ValueError, match="convolutional kernel"):  # parts in the wrong order
        ps.SVGP(ps.SumKernel(RBF(D), conv), ind)
    assert ps.SVGP(k, _inducing(k, L=3), ps.RobustMax(3)).num_outputs == 3  # K classes: K latent outputs
    with pytest.raises(ValueError, match="num_outputs = 3"):
        ps.SVGP(k, _inducing(k, L=3), ps.RobustMax(3), num_outputs=2)
    gp = ps.SVGP(k, ind)
    with pytest.raises(TypeError, match="parts"):
        _ = gp.Z
    with pytest.raises(ValueError, match="InducingSum of 2 parts"):
        ps.SOLVEGP(k, _inducing(k), torch.randn(3, D))
    sol = ps.SOLVEGP(k, _inducing(k), _inducing(k))
    with pytest.raises(ValueError, match="to_svgp"):
        sol.to_svgp()


@pytest.mark.float64
def test_user_owned_plate_under_vectorised_particles_estimates_the_closed_form():
    """A user's model/guide around the sum layer: sample_u, their own data plate, sample_f, the likelihood; under
    Trace_ELBO with vectorised particles the estimate matches -analytic_elbo (a shape that broadcast particles
    against each other would bias it) and f carries one row per particle."""
    k = _kernel()
    gp = ps.SVGP(k, _inducing(k), ps.Gaussian(noise=0.3), whiten=False)
    X, y = torch.randn(10, D), torch.randn(10)
    with torch.no_grad():
        gp.q_u.set(0.5 * torch.randn(7), 0.7 * gp.q_u.u_scale_tril)

    def model(X, y):
        u = gp.sample_u()
        with pyro.plate("data", len(X)):
            gp.likelihood(gp.sample_f(X, u), y)

    def guide(X, y):
        u = gp.sample_u(guide=True)
        with ps.context.plate("data", len(X)):
            gp.sample_f(X, u, guide=True)

    elbo = Trace_ELBO(num_particles=400, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad():
        exact = -gp.analytic_elbo(X, y).item()
        vals = torch.tensor([elbo.loss(model, guide, X, y) for _ in range(25)])
        tr = pyro.poutine.trace(elbo._vectorized_num_particles(guide)).get_trace(X, y)
    se = vals.std() / len(vals) ** 0.5
    assert se > 0 and (vals.mean() - exact).abs() < 4 * se, (vals.mean(), exact, se)
    f = [n for n in tr.nodes.values() if n["type"] == "sample" and n["name"].endswith(".f")][0]["value"]
    assert f.shape == (400, 10)
