"""GroupGP (a GP per group beside a population GP): its bound against a dense per-group computation, the
subsampled-groups estimate's unbiasedness (exactly, over every subset), that a step reads only its groups' rows,
predictions for known and new groups against dense algebra, the Pyro program against the closed form, and
composability (a hyperprior with AutoNormal, vectorised particles with check_model, fit, saving)."""

import copy
import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF, Matern32
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroSample
from pyro.poutine.util import site_is_subsample

import pyro_sparsegp as ps
from pyro_sparsegp.layers.group_data import GroupRows, group_kl, join

G, N_PER, M, NOISE = 4, 3, 5, 0.2


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(G * N_PER, 1, generator=g) * 4 - 2
    group = torch.arange(G).repeat_interleave(N_PER)
    y = torch.sin(2 * X[:, 0]) + torch.randn(G, generator=g)[group] + 0.1 * torch.randn(len(X), generator=g)
    return X, group, y


def _layer(name="ggp", **kw):
    gp = ps.GroupGP(RBF(1, lengthscale=torch.tensor(0.8)), torch.linspace(-2, 2, M).unsqueeze(-1), G,
                    ps.Gaussian(NOISE), population=Matern32(1), name=name, **kw)
    with torch.no_grad():  # a q away from the prior
        gp.q_loc.normal_()
        gp.q_tril.normal_(0, 0.3)
        gp.q_pop.u_loc = torch.randn(M)
        gp.q_pop.u_scale_tril = torch.eye(M) * 0.5 + torch.randn(M, M).tril(-1) * 0.1
    return gp


def _tril(gp):
    return torch.distributions.transform_to(torch.distributions.constraints.lower_cholesky)(
        gp.q_tril.unflatten(-1, (M, M)))


def _dense_q(kernel, Z, X, m, S):
    """q(f) marginals of a whitened q(v) = N(m, S) by dense solves (not the layer's triangular algebra)."""
    Kzz = kernel(Z) + 1e-10 * torch.eye(len(Z))
    Luu = torch.linalg.cholesky(Kzz)
    Kzx = kernel(Z, X)
    P = torch.linalg.solve(Kzz, Kzx)  # Kzz^{-1} Kzx
    Su = Luu @ S @ Luu.mT
    mean = P.mT @ (Luu @ m)
    var = kernel(X, diag=True) - (Kzx * P).sum(0) + (P * (Su @ P)).sum(0)
    return mean, var


def _dense_bound(gp, X, group, y):
    Z = gp.Z.detach()
    L = _tril(gp)
    S0 = gp.q_pop.u_scale_tril @ gp.q_pop.u_scale_tril.mT
    m0, v0 = _dense_q(gp.population, Z, X, gp.q_pop.u_loc, S0)
    total = -torch.distributions.kl_divergence(dist.MultivariateNormal(gp.q_pop.u_loc, S0),
                                               dist.MultivariateNormal(torch.zeros(M), torch.eye(M)))
    for k in range(G):
        rows = group == k
        Sg = L[k] @ L[k].mT
        mg, vg = _dense_q(gp.kernel, Z, X[rows], gp.q_loc[k], Sg)
        mu, var = m0[rows] + mg, v0[rows] + vg
        total = total + (-0.5 * math.log(2 * math.pi * NOISE) - ((y[rows] - mu) ** 2 + var) / (2 * NOISE)).sum()
        total = total - torch.distributions.kl_divergence(dist.MultivariateNormal(gp.q_loc[k], Sg),
                                                          dist.MultivariateNormal(torch.zeros(M), torch.eye(M)))
    return total


def test_bound_is_the_dense_sum_and_subsets_of_groups_are_unbiased():
    X, group, y = _data()
    gp = _layer()
    Xj = join(X, group)
    full = gp.analytic_elbo(Xj, y)
    assert torch.allclose(full, _dense_bound(gp, X, group, y).detach(), rtol=1e-6, atol=1e-6)
    data = GroupRows(Xj, y)
    for g in (1, 3):  # the mean over every subset of g groups of G/g times its sum is the full bound, exactly
        subsets = list(itertools.combinations(range(G), g))
        mean = sum(gp.analytic_elbo(*data[torch.tensor(s)], num_data=G) for s in subsets) / len(subsets)
        assert torch.allclose(mean, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_step_reads_only_its_groups(sparse):
    X, group, y = _data()
    gp = _layer(sparse=sparse)
    Xb, yb = GroupRows(join(X, group), y)[torch.tensor([1, 2])]
    before = gp.analytic_elbo(Xb, yb, num_data=G)
    with torch.no_grad():  # the groups outside the batch are NaN: any read of them would show
        gp.q_loc[[0, 3]] = float("nan")
        gp.q_tril[[0, 3]] = float("nan")
    after = gp.analytic_elbo(Xb, yb, num_data=G)
    assert torch.equal(before, after)
    after.backward()
    grad = gp.q_loc.grad.to_dense() if sparse else gp.q_loc.grad
    assert grad.shape == (G, M) and grad[[0, 3]].abs().sum() == 0 and grad[[1, 2]].abs().sum() > 0
    if sparse:
        assert gp.q_tril.grad.is_sparse and set(gp.q_tril.grad.coalesce().indices()[0].tolist()) == {1, 2}


def test_auto_gradients_are_sparse_in_fits_steps_only():
    """``sparse="auto"`` (the default): sparse gradients inside ``fit``'s steps (its Adam steps only the batch's rows),
    dense anywhere else, as ``SVI`` with a Pyro optimiser needs."""
    from pyro_sparsegp.context.reporting import at_step

    X, group, y = _data()
    gp = _layer()
    Xb, yb = GroupRows(join(X, group), y)[torch.tensor([1, 2])]
    gp.analytic_elbo(Xb, yb, num_data=G).backward()
    assert not gp.q_loc.grad.is_sparse and not gp.q_tril.grad.is_sparse
    gp.q_loc.grad = gp.q_tril.grad = None
    with at_step(3):
        gp.analytic_elbo(Xb, yb, num_data=G).backward()
    assert gp.q_loc.grad.is_sparse and gp.q_tril.grad.is_sparse
    with pytest.raises(ValueError, match="sparse must be"):
        _layer(name="other", sparse="yes")


def test_predict_for_known_and_new_groups_against_dense_algebra():
    X, group, y = _data()
    gp = _layer()
    Xs, gs = torch.linspace(-1.5, 1.5, 4).unsqueeze(-1), torch.tensor([2, 0, -1, 3])
    mean, var = gp.predict(Xs, gs)
    L = _tril(gp)
    with torch.no_grad():
        m0, v0 = _dense_q(gp.population, gp.Z, Xs, gp.q_pop.u_loc, gp.q_pop.u_scale_tril @ gp.q_pop.u_scale_tril.mT)
        for i, k in enumerate(gs.tolist()):
            if k < 0:  # a new group: the population's q plus the group prior k(x, x)
                mg, vg = torch.zeros(1), gp.kernel(Xs[i:i + 1], diag=True)
            else:
                mg, vg = _dense_q(gp.kernel, gp.Z, Xs[i:i + 1], gp.q_loc[k], L[k] @ L[k].mT)
            assert torch.allclose(mean[i], m0[i] + mg[0], atol=1e-6)
            assert torch.allclose(var[i], v0[i] + vg[0], atol=1e-6)
    _, _, pred = gp.predict(Xs, gs, full=True)  # y*: the noise added, a distribution without gradients
    assert torch.allclose(pred.scale**2, var + NOISE) and not pred.scale.requires_grad
    new_mean, new_var = gp.predict(Xs)  # group=None: every row a new group
    assert torch.allclose(new_mean[2], mean[2]) and torch.allclose(new_var[2], var[2])
    assert torch.allclose(gp.predict(join(Xs[:2], gs[:2]))[0], mean[:2])  # the joined layout reads the group column
    with pytest.raises(ValueError, match="group"):
        gp.predict(Xs, torch.tensor([0, 1, 2, G]))


def _particle_elbos(model, guide, n, *args, **kwargs):
    """The ELBO's ``n`` single-particle draws ``[n]`` under a vectorised particle plate at ``dim=-3`` (as
    ``Trace_ELBO(vectorize_particles=True, max_plate_nesting=2)`` draws them): each site's scaled log-density summed
    over all but the particle dimension."""
    with pyro.plate("particles", n, dim=-3):
        guide_tr = poutine.trace(guide).get_trace(*args, **kwargs)
        model_tr = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(*args, **kwargs)
    total = 0.0
    for tr, sign in ((model_tr, 1.0), (guide_tr, -1.0)):
        tr.compute_log_prob()  # each site's log_prob carries its plates' scale (G / g here)
        for site in tr.nodes.values():
            if site["type"] == "sample" and not site_is_subsample(site):
                total = total + sign * site["log_prob"].reshape(n, -1).sum(-1)
    return total


def test_pyro_program_estimates_the_closed_form_and_composes():
    """The Pyro program's ELBO on a subsample of groups (vectorised particles) is the closed form's G/g-scaled bound
    within 4 standard errors; its p(f | v_0, v) is the dense conditional; a PyroSample hyperprior with AutoNormal
    beside the layer's guide passes check_model and trains under SVI."""
    X, group, y = _data()
    gp = _layer()
    Xb, yb = GroupRows(join(X, group), y)[torch.tensor([0, 3])]
    exact = gp.analytic_elbo(Xb, yb, num_data=G).item()
    n = 4000
    pyro.set_rng_seed(1)
    draws = _particle_elbos(gp.model, gp.guide, n, Xb, yb, num_data=G).detach()
    pyro.set_rng_seed(1)  # Trace_ELBO's own estimate is the mean of these very draws
    elbo = Trace_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=2)
    assert math.isclose(-elbo.loss(gp.model, gp.guide, Xb, yb, num_data=G), draws.mean().item(), rel_tol=1e-6)
    se = draws.std().item() / math.sqrt(n)  # the SE from n iid draws (about 1.1 here)
    # a 4-SE test: it detects a bias above 4 SE, e.g. the groups' KL without its G/g = 2 scale (a shift of the
    # batch's KL, about 6.8 here, asserted below) or the rows' likelihood without it (about 100)
    assert 4 * se < group_kl(*gp._group_rows(torch.tensor([0, 3]))).sum().item()
    assert abs(draws.mean().item() - exact) < 4 * se
    # the conditional p(f | v_0, v) that both programs sample, against dense algebra at the guide's draws (exact:
    # the MC test above cannot resolve an error in its variance, about 2 in the bound)
    tr = poutine.trace(gp.guide).get_trace(Xb, yb, num_data=G)
    v0, v = tr.nodes["ggp.pop.u"]["value"], tr.nodes["ggp.u"]["value"].squeeze(-2)  # [M], [2, M]
    fn = tr.nodes["ggp.f"]["fn"]
    Xf, gb = Xb[:, :-1].double(), Xb[:, -1].long()
    tol = 1e-6 if Xb.dtype == torch.float64 else 1e-3  # float32: the cancellation in k(x, x) - |a|^2
    with torch.no_grad():  # the reference in float64 (a float32 pass converts only the layer's output)
        Z0 = torch.zeros(M, M, dtype=torch.float64)
        kern, pop = copy.deepcopy(gp.kernel).double(), copy.deepcopy(gp.population).double()
        loc0, var0 = _dense_q(pop, gp.Z.double(), Xf, v0.double(), Z0)
        for j, k in enumerate((0, 3)):
            rows = gb == k
            loc, var = _dense_q(kern, gp.Z.double(), Xf[rows], v[j].double(), Z0)
            assert torch.allclose(fn.loc[rows].double(), loc0[rows] + loc, atol=tol)
            assert torch.allclose(fn.scale[rows].double() ** 2, var0[rows] + var, atol=tol)

    k = RBF(1)
    k.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    hgp = ps.GroupGP(k, torch.linspace(-2, 2, M).unsqueeze(-1), G, ps.Gaussian(NOISE), name="hgp")
    guide = AutoGuideList(hgp.model, create_plates=hgp.create_plates)
    guide.append(AutoNormal(poutine.block(hgp.model, expose_fn=lambda m: m["name"].startswith(
        ("hgp.kernel", "hgp.population")))))
    guide.append(hgp.guide)
    Xj = join(X, group)
    ps.check_model(hgp.model, guide, Xj, y, subsample_size=2)  # plainly and under 3 vectorised particles
    svi = pyro.infer.SVI(hgp.model, guide, pyro.optim.Adam({"lr": 0.05}),
                         Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2))
    losses = [svi.step(Xj, y, subsample_size=2) for _ in range(2)]
    assert all(math.isfinite(v) for v in losses)
    names = set(pyro.get_param_store().keys()) | {n for n, _ in guide.named_parameters()}
    assert any("lengthscale" in n for n in names)


@pytest.mark.parametrize("sparse", [False, True, "auto"])
def test_fit_trains_every_parameter_and_saving_reloads(sparse, tmp_path):
    X, group, y = _data()
    gp = _layer(sparse=sparse)
    before = {n: p.detach().clone() for n, p in gp.named_parameters()}
    state = ps.infer.fit(gp, join(X, group), y, num_steps=5, batch_size=2, progress=False)
    assert len(state.losses) == 5 and all(math.isfinite(v) for v in state.losses)
    assert all(not torch.equal(before[n], p) for n, p in gp.named_parameters()), "a parameter was not trained"
    path = tmp_path / "ggp.pt"
    ps.saving.save(gp, path)
    Xs, gs = torch.linspace(-1, 1, 3).unsqueeze(-1), torch.tensor([0, -1, 3])
    want = gp.predict(Xs, gs)
    del gp, state  # the name is free again: loading while the original lives costs two full garbage collections
    back = ps.saving.load(path)
    assert back.name == "ggp"
    for a, b in zip(want, back.predict(Xs, gs), strict=True):
        assert torch.equal(a, b)


def test_defaults_names_and_num_groups():
    """By default a GroupGP has a population GP (a copy of the kernel): at the initial q (both at their prior) a new
    group's predictive variance is k(x, x) + k_0(x, x) = 2 k(x, x); two layers left unnamed get distinct names;
    num_groups must be an integer >= 1."""
    Z, Xs = torch.linspace(-2, 2, M).unsqueeze(-1), torch.linspace(-1, 1, 3).unsqueeze(-1)
    kern = RBF(1, lengthscale=torch.tensor(0.8))
    a, b = ps.GroupGP(kern, Z, G), ps.GroupGP(kern, Z, G)
    assert a.name != b.name
    mean, var = a.predict(Xs)
    with torch.no_grad():
        assert torch.allclose(mean, torch.zeros(3), atol=1e-5)
        assert torch.allclose(var, 2 * kern(Xs, diag=True), rtol=1e-4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_groups"):
            ps.GroupGP(kern, Z, bad)


def test_input_checks_and_y_column():
    """A group column that is not an integer is refused, ``y [N, 1]`` is read as ``y [N]``, and ``predict`` refuses
    features of the wrong width even with a well-shaped ``group``."""
    X, group, y = _data()
    gp = _layer()
    Xj = join(X, group)
    bad = Xj.clone()
    bad[0, -1] = 1.5
    with pytest.raises(ValueError, match="group"):
        gp.analytic_elbo(bad, y)
    assert torch.equal(gp.analytic_elbo(Xj, y.unsqueeze(-1)), gp.analytic_elbo(Xj, y))
    with pytest.raises(ValueError, match="predict takes"):
        gp.predict(torch.zeros(3, 3), torch.tensor([0, 1, 2]))


def test_join_of_batched_features_and_split():
    """``join`` appends the group as the last column for features with leading dimensions too (``[B, N, D]``,
    ``group [B, N]``), as ``split`` reads ``[..., N, D + 1]``."""
    X = torch.arange(12.0).reshape(2, 3, 2)
    group = torch.tensor([[0, 1, 1], [0, 1, 1]])
    J = join(X, group)
    assert J.shape == (2, 3, 3)
    for b in range(2):
        assert torch.equal(J[b], torch.cat([X[b], group[b].to(X.dtype).unsqueeze(-1)], -1))
    Xf, g = ps.layers.groups.split(J)
    assert torch.equal(Xf, X) and torch.equal(g, group[0])


def test_model_log_density_on_a_subsample_is_the_dense_scaled_joint():
    """The model's log density at the guide's draw on g of the G groups (no num_data) is the dense joint
    log N(v_0; 0, I) + G/g sum over the drawn groups of [log N(v_k; 0, I) + sum over their rows of
    log p(f_n | v_0, v_k) + log N(y_n; f_n, noise)]."""
    X, group, y = _data()
    gp = _layer()
    Xj = join(X, group)
    pyro.set_rng_seed(3)
    gtr = poutine.trace(gp.guide).get_trace(Xj, y, subsample_size=2)
    mtr = poutine.trace(poutine.replay(gp.model, trace=gtr)).get_trace(Xj, y, subsample_size=2)
    idx = gtr.nodes["ggp.groups"]["value"]
    rows = torch.isin(group, idx).nonzero().squeeze(-1)
    with torch.no_grad():
        d = lambda t: t.detach().double()  # noqa: E731
        v0, v = d(gtr.nodes["ggp.pop.u"]["value"]), d(gtr.nodes["ggp.u"]["value"]).squeeze(-2)  # [M], [2, M]
        f = d(gtr.nodes["ggp.f"]["value"])  # [R]
        kern, pop = copy.deepcopy(gp.kernel).double(), copy.deepcopy(gp.population).double()
        Z, Xf, Z0 = gp.Z.double(), X.double(), torch.zeros(M, M, dtype=torch.float64)
        std = dist.Normal(torch.zeros(M, dtype=torch.float64), 1.0).to_event(1)
        loc0, var0 = _dense_q(pop, Z, Xf, v0, Z0)
        groups = 0.0
        for j, k in enumerate(idx.tolist()):
            sel = group[rows] == k
            loc, var = _dense_q(kern, Z, Xf[rows][sel], v[j], Z0)
            fk = f[sel]
            groups = groups + std.log_prob(v[j]) + dist.Normal(loc0[rows][sel] + loc, (var0[rows][sel] + var).sqrt()
                                                               ).log_prob(fk).sum()
            groups = groups + dist.Normal(fk, math.sqrt(NOISE)).log_prob(y[rows][sel].double()).sum()
        want = std.log_prob(v0) + G / 2 * groups
    tol = 1e-6 if X.dtype == torch.float64 else 1e-2
    assert math.isclose(mtr.log_prob_sum().item(), want.item(), rel_tol=tol, abs_tol=tol)


def test_variance_hyperprior_under_vectorised_particles():
    """A PyroSample kernel variance drawn per particle ``[P, 1, 1]``: ``p(f | v)`` has batch shape ``[P, 1, R]`` and
    each particle's variance is the dense conditional's under that particle's kernel."""
    k = RBF(1, lengthscale=torch.tensor(0.8))
    k.variance = PyroSample(dist.LogNormal(0.0, 1.0))
    gp = ps.GroupGP(k, torch.linspace(-2, 2, M).unsqueeze(-1), 3, ps.Gaussian(NOISE), population=None, name="hv")
    X, group = torch.linspace(-1, 1, 6).unsqueeze(-1), torch.tensor([0, 0, 1, 1, 2, 2])
    P = 3
    with pyro.plate("particles", P, dim=-3):
        tr = poutine.trace(gp.guide).get_trace(join(X, group), torch.zeros(6))
    fn, var_p = tr.nodes["hv.f"]["fn"], tr.nodes["hv.kernel.variance"]["value"].detach()
    v = tr.nodes["hv.u"]["value"].detach().squeeze(-2)  # [P, 3, M]
    assert fn.batch_shape == (P, 1, 6)
    tol = 1e-6 if X.dtype == torch.float64 else 1e-3
    with torch.no_grad():
        for p in range(P):
            kp = RBF(1, variance=var_p[p].reshape(()).double(), lengthscale=torch.tensor(0.8, dtype=torch.float64))
            for g in range(3):
                rows = group == g
                loc, var = _dense_q(kp, gp.Z.double(), X[rows].double(), v[p, g].double(),
                                    torch.zeros(M, M, dtype=torch.float64))
                assert torch.allclose(fn.loc[p, 0, rows].double(), loc, atol=tol)
                assert torch.allclose(fn.scale[p, 0, rows].double() ** 2, var, atol=tol)


def test_without_a_population_the_bound_and_predictions_are_the_groups_alone():
    """``population=False``: the bound is the dense per-group sum with no population term or KL, a known group
    predicts its own q, a new group its prior ``N(0, k(x, x))``; one group (``G = 1``) is a valid layer."""
    X, group, y = _data()
    gp = _layer(name="nopop")
    gp_alone = ps.GroupGP(RBF(1, lengthscale=torch.tensor(0.8)), torch.linspace(-2, 2, M).unsqueeze(-1), G,
                          ps.Gaussian(NOISE), population=False, name="alone")
    with torch.no_grad():
        gp_alone.q_loc.copy_(gp.q_loc)
        gp_alone.q_tril.copy_(gp.q_tril)
    assert gp_alone.population is None and gp_alone.q_pop is None
    Z, L = gp_alone.Z.detach(), _tril(gp_alone).detach()
    want = 0.0
    for k in range(G):
        rows = group == k
        Sg = L[k] @ L[k].mT
        mu, var = _dense_q(gp_alone.kernel, Z, X[rows], gp_alone.q_loc[k].detach(), Sg)
        want += (-0.5 * math.log(2 * math.pi * NOISE) - ((y[rows] - mu) ** 2 + var) / (2 * NOISE)).sum()
        want -= torch.distributions.kl_divergence(dist.MultivariateNormal(gp_alone.q_loc[k].detach(), Sg),
                                                  dist.MultivariateNormal(torch.zeros(M), torch.eye(M)))
    got = gp_alone.analytic_elbo(join(X, group), y).detach()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)
    Xs = torch.linspace(-1, 1, 3).unsqueeze(-1)
    mean, var = gp_alone.predict(Xs, torch.tensor([2, -1, 2]))
    m2, v2 = _dense_q(gp_alone.kernel, Z, Xs, gp_alone.q_loc[2].detach(), L[2] @ L[2].mT)
    k = gp_alone.kernel(Xs, diag=True).detach()
    assert torch.allclose(mean, torch.stack([m2[0], torch.tensor(0.0, dtype=m2.dtype), m2[2]]), atol=1e-5)
    assert torch.allclose(var, torch.stack([v2[0], k[1], v2[2]]), rtol=1e-5, atol=1e-6)
    one = ps.GroupGP(RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1), 1, ps.Gaussian(NOISE), name="one")
    assert one.num_groups == 1 and one.q_loc.shape == (1, M)
    with pytest.raises((TypeError, ValueError), match="likelihood"):
        ps.GroupGP(RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1), G, likelihood="gaussian", name="badlik")
