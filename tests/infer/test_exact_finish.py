"""fit's exact finish (issue #26, item 4): q(u) and the Gaussian noise set to their joint optimum on all the data at
the end of training, checked against the collapsed bound of Titsias (2009) computed densely and maximised over the
noise on a grid; the ``finish`` argument's policy and errors; checkpoints keep the loop's state to resume from."""

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.nn import PyroParam, PyroSample
from torch.distributions import constraints
from torch.utils.data import DataLoader, TensorDataset

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.training.exact_finish import exact_finish_
from pyro_sparsegp.mean_functions import Constant


def _data(N=200, D=2, L=None):
    X = torch.randn(N, D)
    f = torch.sin(X.sum(-1, keepdim=True) + torch.arange(L or 1))
    y = f + 0.2 * torch.randn_like(f)
    return X, (y[:, 0] if L is None else y)


def _dense_collapsed(gp, X, Y, noise):
    """Titsias's collapsed bound ``sum_l log N(y_l; 0, Q + s2 I) - L tr(K - Q) / (2 s2)`` (``Y [N, L]``), dense."""
    with torch.no_grad():
        Kuu = gp.kernel(gp.Z)
        Kuf = gp.kernel(gp.Z, X)
        Q = Kuf.mT @ torch.linalg.solve(Kuu, Kuf)
        trace = (gp.kernel(X, diag=True) - Q.diagonal()).sum()
        C = Q + noise * torch.eye(len(X))
        mvn = torch.distributions.MultivariateNormal(torch.zeros(len(X)), C)
        return mvn.log_prob(Y.mT).sum() - Y.shape[1] * trace / (2 * noise)


def _same_parameters(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _grid_max(gp, X, Y):
    """``(noise, bound)`` at the maximum of the dense collapsed bound over a log grid of the noise, refined twice."""
    lo, hi = -6.0, 1.0
    for _ in range(3):
        grid = torch.exp(torch.linspace(lo, hi, 201))
        vals = torch.stack([_dense_collapsed(gp, X, Y, s) for s in grid])
        i = int(vals.argmax())
        lo, hi = float(grid[max(i - 2, 0)].log()), float(grid[min(i + 2, 200)].log())
    return float(grid[i]), float(vals[i])


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("L", [None, 2])
def test_the_finish_lands_on_the_collapsed_bound_optimum(whiten, L):
    X, y = _data(L=L)
    gp = ps.SVGP(RBF(2), X[:12].clone(), ps.Gaussian(noise=0.5), whiten=whiten, num_outputs=L)
    steps = exact_finish_(gp, [(X[:70], y[:70]), (X[70:], y[70:])])
    assert 0 < steps < 500
    noise, best = _grid_max(gp, X, y.unsqueeze(-1) if L is None else y)
    assert gp.likelihood.noise.item() == pytest.approx(noise, rel=2e-3)
    # the ELBO at the finished q(u) and noise is the collapsed bound's maximum: q(u) is Titsias's optimum
    assert gp.analytic_elbo(X, y).item() == pytest.approx(best, abs=1e-4)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("kind", ["svgp", "svgp_zl", "solvegp", "solvegp2"])
def test_the_finish_is_a_stationary_point_of_the_layers_own_bound(kind, whiten):
    """The gradient of the module's closed-form bound on all the data (its own code, not the finish's formulas) with
    respect to every variational parameter and the noise vanishes at the finish: SOLVE-GP's joint mean and
    per-family covariances (eq. 8 of Shi, Titsias, Mnih 2020), and two outputs sharing the noise (``solvegp2``; and
    ``svgp_zl`` with inducing inputs per output)."""
    L = 2 if kind in ("solvegp2", "svgp_zl") else None
    X, y = _data(N=150, L=L)
    if kind == "svgp":
        gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.5), whiten=whiten)
    elif kind == "svgp_zl":  # inducing inputs of its own per output, [L, M, D]
        gp = ps.SVGP(RBF(2), torch.randn(2, 8, 2), ps.Gaussian(noise=0.5), whiten=whiten, num_outputs=2)
    else:
        gp = ps.SOLVEGP(RBF(2), X[:6].clone(), X[6:14].clone(), ps.Gaussian(noise=0.5), whiten=whiten,
                        num_outputs=L)
    exact_finish_(gp, [(X[:64], y[:64]), (X[64:], y[64:])])
    named = [(n, p) for n, p in gp.named_parameters() if "q_" in n or "noise" in n]
    assert len(named) == (3 if kind.startswith("svgp") else 5)
    params = [p for _, p in named]
    grads = torch.autograd.grad(gp.analytic_elbo(X, y), params)
    for (name, _), g in zip(named, grads, strict=True):
        assert g.abs().max() < 1e-6 * len(X), (name, g.abs().max())
    # and the check can fail: one minibatch step away from the finish, the gradient is far from zero
    fit(gp, X, y, num_steps=1, batch_size=20, progress=False, natgrad=ps.infer.NaturalPolicy(finish=None), lr=1e-9)
    grads = torch.autograd.grad(gp.analytic_elbo(X, y), params)
    assert max(g.abs().max() for g in grads) > 1e-3


def test_a_fixed_noise_keeps_its_value_and_q_u_is_the_optimum_at_it():
    X, y = _data()
    gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.3))
    gp.likelihood.noise_unconstrained.requires_grad_(False)
    assert exact_finish_(gp, [(X, y)]) == 0
    assert gp.likelihood.noise.item() == pytest.approx(0.3, rel=1e-6)
    with torch.no_grad():
        Kuu = gp.kernel(gp.Z)
        A = torch.linalg.solve_triangular(torch.linalg.cholesky(Kuu + 1e-9 * torch.eye(10)), gp.kernel(gp.Z, X),
                                          upper=False)
        S = torch.linalg.inv(torch.eye(10) + A @ A.mT / 0.3)
        m = S @ A @ y / 0.3
    tol = 1e-5 if torch.get_default_dtype() == torch.float64 else 2e-3
    torch.testing.assert_close(gp.q_u.u_loc.detach(), m, atol=tol, rtol=0)
    torch.testing.assert_close(gp.q_u.u_scale_tril @ gp.q_u.u_scale_tril.mT, S, atol=tol, rtol=0)


def test_a_noise_constraint_is_kept():
    """A user's noise floor (``greater_than``) above the unconstrained optimum: the finish stops at the floor."""
    X, y = _data()
    y = torch.sin(X.sum(-1))  # noiseless: the optimum is far below the floor
    gp = ps.SVGP(RBF(2), X[:30].clone(), ps.Gaussian(noise=0.3))
    gp.likelihood.noise = PyroParam(torch.tensor(0.3), constraints.greater_than(0.05))
    exact_finish_(gp, [(X, y)])
    assert 0.05 < gp.likelihood.noise.item() < 0.0501 and torch.isfinite(gp.likelihood.noise_unconstrained)


def test_a_partial_pass_is_scaled_to_num_data():
    """A loader that dropped rows stands for ``num_data`` as the minibatch bound does: the data given twice with
    ``num_data = N`` is the data given once."""
    X, y = _data()
    once = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.3))
    twice = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.3))
    exact_finish_(once, [(X, y)])
    exact_finish_(twice, [(X, y), (X, y)], num_data=len(X))
    _same_parameters(once, twice)


def test_fit_finishes_exactly_by_default_and_the_full_data_bound_rises():
    X, y = _data(N=600)

    def run(**kw):
        torch.manual_seed(0)
        gp = ps.SVGP(RBF(2), X[:15].clone(), ps.Gaussian(noise=0.5))
        fit(gp, X, y, **{"num_steps": 40, "batch_size": 50, "progress": False, **kw})
        return gp

    last, finished = run(natgrad=ps.infer.NaturalPolicy(finish=None)), run()
    with torch.no_grad():
        assert finished.analytic_elbo(X, y) > last.analytic_elbo(X, y)
        assert not torch.equal(finished.q_u.u_loc, last.q_u.u_loc)
        for (name, a), b in zip(finished.kernel.named_parameters(), last.kernel.parameters(), strict=True):
            assert torch.equal(a, b), name  # hyperparameters: the loop's own
    again = [p.detach().clone() for p in finished.parameters()]
    exact_finish_(finished, [(X, y)])  # a fixed point: finishing twice changes nothing
    for a, b in zip(finished.parameters(), again, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    assert torch.equal(run(natgrad=ps.infer.NaturalPolicy(lr=None, finish=None)).q_u.u_loc,
                       run(natgrad=None).q_u.u_loc)  # Adam: off
    # under one epoch (5 x 50 of 600 rows) the pass would cost more than the training: "auto" leaves it out
    assert torch.equal(run(natgrad=ps.infer.NaturalPolicy(finish=None), num_steps=5).q_u.u_loc,
                       run(num_steps=5).q_u.u_loc)
    assert not torch.equal(run(natgrad=ps.infer.NaturalPolicy(finish="exact"), num_steps=5).q_u.u_loc,
                           run(num_steps=5).q_u.u_loc)


def test_a_frozen_q_u_is_left_alone():
    """A user's ``q_u.requires_grad_(False)`` keeps q(u) through fit (the finish would overwrite it)."""
    X, y = _data(N=300)
    gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.5))
    gp.q_u.requires_grad_(False)
    before = [p.detach().clone() for p in gp.q_u.parameters()]
    fit(gp, X, y, num_steps=20, batch_size=100, progress=False)
    for a, b in zip(gp.q_u.parameters(), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="a variational family is frozen"):
        fit(gp, X, y, num_steps=1, progress=False, natgrad=ps.infer.NaturalPolicy(finish="exact"))


def test_finish_is_off_for_a_loader_and_on_when_asked():
    X, y = _data(N=300)
    loader = DataLoader(TensorDataset(X, y), batch_size=50, shuffle=False)

    def run(**kw):
        torch.manual_seed(0)
        gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.5))
        fit(gp, loader, num_data=len(X), num_steps=12, progress=False, **kw)
        return gp

    assert torch.equal(run().q_u.u_loc, run(natgrad=ps.infer.NaturalPolicy(finish=None)).q_u.u_loc)
    asked, last = run(natgrad=ps.infer.NaturalPolicy(finish="exact")), run(natgrad=ps.infer.NaturalPolicy(finish=None))
    with torch.no_grad():
        assert asked.analytic_elbo(X, y) > last.analytic_elbo(X, y)


def test_a_drop_last_loader_is_named_in_the_finish_line(capsys):
    """The finish line says how many rows a loader gave (it stands for ``num_data``: the statistics are scaled)."""
    X, y = _data(N=300)
    gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.5))
    loader = DataLoader(TensorDataset(X, y), batch_size=80, drop_last=True)
    fit(gp, loader, num_data=300, num_steps=4, natgrad=ps.infer.NaturalPolicy(finish="exact"))
    assert "on the 240 rows of one pass of the loader, scaled to num_data = 300" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["loader", "adam", "short", "average", "none", "finished"])
def test_a_skipped_finish_says_why_where_the_module_could_take_it(case, capsys):
    """``"auto"`` leaves out a finish the module could take (a loader, Adam on q(u), a run under one epoch) with one
    line naming the reason and ``finish="exact"``; no line where the user chose otherwise (``average``,
    ``finish=None``) or where it finished."""
    X, y = _data(N=300)
    gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(noise=0.5))
    kw = {"loader": dict(X=DataLoader(TensorDataset(X, y), batch_size=50), num_data=300),
          "adam": dict(X=X, y=y, natgrad=None), "short": dict(X=X, y=y, batch_size=50),
          "average": dict(X=X, y=y, natgrad=ps.infer.NaturalPolicy(average=0.5)),
          "none": dict(X=X, y=y, natgrad=ps.infer.NaturalPolicy(finish=None)),
          "finished": dict(X=X, y=y)}[case]
    fit(gp, num_steps=3 if case == "short" else 12, **kw)
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("fit: no exact finish: ")]
    want = {"loader": "from a loader", "adam": "natgrad=None", "short": "0.5 of an epoch"}.get(case)
    assert len(said) == (want is not None)
    assert want is None or (want in said[0] and 'NaturalPolicy(finish="exact")' in said[0])
    assert ("fit: exact finish" in err) == (case == "finished")


def test_finish_refuses_what_it_cannot_do():
    X, y = _data(N=100)
    gp = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(noise=0.5))
    with pytest.raises(ValueError, match="finish must be"):
        fit(gp, X, y, num_steps=1, progress=False, natgrad=ps.infer.NaturalPolicy(finish="yes"))
    with pytest.raises(ValueError, match="choose one"):
        fit(gp, X, y, num_steps=1, progress=False, natgrad=ps.infer.NaturalPolicy(average=0.5, finish="exact"))
    odvgp = ps.SOLVEGP(RBF(2), X[:5].clone(), X[5:10].clone(), ps.Gaussian(noise=0.5), odvgp=True)
    with pytest.raises(ValueError, match="the prior's covariance"):
        fit(odvgp, X, y, num_steps=1, progress=False, natgrad=ps.infer.NaturalPolicy(finish="exact"))
    hyper = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(noise=0.5))
    hyper.kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    with pytest.raises(ValueError, match="RBF.lengthscale is a PyroSample"):
        ps.infer.training.exact_finish_(hyper, [(X, y)])
    with_mean = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(noise=0.5), mean_function=Constant())
    with pytest.raises(ValueError, match="it has a mean function"):
        fit(with_mean, X, y, num_steps=1, progress=False, natgrad=ps.infer.NaturalPolicy(finish="exact"))
    clf = ps.SVGP(RBF(2), X[:5].clone(), ps.Bernoulli())
    with pytest.raises(ValueError, match="its likelihood is Bernoulli, not Gaussian"):
        exact_finish_(clf, [(X, (y > 0).to(X.dtype))])


def test_a_checkpoint_holds_the_final_model_and_resumes_from_the_loop(tmp_path):
    X, y = _data(N=300)
    kw = dict(batch_size=40, progress=False, seed=2)

    def gp():
        return ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(noise=0.5))

    straight = gp()
    fit(straight, X, y, num_steps=20, **kw)
    first = gp()
    fit(first, X, y, num_steps=9, checkpoint=str(tmp_path / "c.pt"), **kw)
    saved = torch.load(tmp_path / "c.pt")
    for k, v in first.state_dict().items():  # "module" is the finished model the call returned
        assert torch.equal(saved["module"][k], v), k
    resumed = gp()
    fit(resumed, X, y, num_steps=20, checkpoint=ps.infer.Checkpoint(None, resume=str(tmp_path / "c.pt")),
        **kw)  # continues from the loop's iterate
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _dgp(X):
    from pyro_sparsegp.deep import build_deep_gp

    return build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=10, num_samples=4, init="random")


def test_a_deep_gps_finish_is_its_last_layers_on_the_hidden_samples():
    """A DeepGP's finish is the last layer's on ``S`` samples per point of its inputs, each weighted ``1 / S``:
    the same as finishing the last layer on those samples with ``num_data = N``."""
    X, y = _data(N=120)
    deep = _dgp(X)
    twin = copy.deepcopy(deep)
    pyro.set_rng_seed(3)
    exact_finish_(deep, [(X[:50], y[:50]), (X[50:], y[50:])])
    pyro.set_rng_seed(3)
    rows = []
    with torch.no_grad():
        for Xb, yb in [(X[:50], y[:50]), (X[50:], y[50:])]:
            h = twin.propagate(Xb, 4)[0][-1]
            twin.clear_cache()
            rows.append((h.reshape(-1, h.shape[-1]), yb.repeat(4)))
    exact_finish_(twin.last, rows, num_data=len(X))
    _same_parameters(deep, twin)


def test_fit_finishes_a_deep_gps_last_layer_and_its_bound_rises():
    X, y = _data(N=400)

    def run(**kw):
        torch.manual_seed(0)
        pyro.set_rng_seed(0)
        deep = _dgp(X)
        fit(deep, X, y, num_steps=20, batch_size=100, progress=False, **kw)
        return deep

    last, finished = run(natgrad=ps.infer.NaturalPolicy(finish=None)), run()
    finished_ids = {id(p) for p in finished.last.q_u.parameters()} | {id(finished.likelihood.noise_unconstrained)}
    for (name, a), b in zip(finished.named_parameters(), last.parameters(), strict=True):
        if id(a) not in finished_ids:
            assert torch.equal(a, b), name  # the hidden layers and every hyperparameter: the loop's own
    assert not torch.equal(finished.last.q_u.u_loc, last.last.q_u.u_loc)
    with torch.no_grad():  # the bound on all the data, averaged over many samples of the hidden layers
        bound = [sum(m.analytic_elbo(X, y, num_samples=64).item() for _ in range(8)) / 8 for m in (last, finished)]
    assert bound[1] > bound[0], bound


@pytest.mark.parametrize("M", [20, 40])
def test_noise_free_float32_data_are_finished_and_predicted(M):
    """Issue 45, item 4: noise-free targets in float32 (``y = sin(X)``, no noise at all) drive the noise's optimum
    towards zero; summed in float32 the statistics' ``Phi Phi^T`` was indefinite by its round-off, the precision
    ``P + G / noise`` with it, and the finish's Cholesky factorisation raised, so ``fit`` returned nothing. It finishes
    now (the sums in float64), with a small noise, and the returned model predicts the function (RMSE below 1e-3 at
    new inputs; measured 3e-5 to 4e-5 over seeds 0-4 and M = 20, 40, 80)."""
    torch.set_default_dtype(torch.float32)  # whatever the pass (the fixture restores the default)
    X = torch.rand(200, 1) * 4
    y = torch.sin(X[:, 0])
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(2.0)), torch.linspace(0, 4, M).unsqueeze(-1), ps.Gaussian(0.1))
    state = fit(gp, X, y, num_steps=50, batch_size=100, progress=False)  # an epoch and more: finish="auto" finishes
    assert len(state.losses) == 50
    assert 0 < gp.likelihood.noise.item() < 1e-4
    Xt = torch.rand(100, 1) * 4
    mean, var = gp.predict(Xt)
    assert (mean - torch.sin(Xt[:, 0])).pow(2).mean().sqrt() < 1e-3
    assert torch.isfinite(var).all() and (var >= 0).all()


def test_a_finish_that_cannot_factorise_keeps_the_trained_state(monkeypatch):
    """The finish never loses a run: where its optimum cannot be factorised (forced here, since no case is known
    since the sums are in float64), ``fit`` warns in one line why and returns the trained state, the module as the
    loop left it (the same as ``finish=None`` from the same seed)."""
    import pyro_sparsegp.infer.training.exact_finish as finish_module

    X, y = _data()
    ref = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="ref")
    fit(ref, X, y, num_steps=10, batch_size=50, progress=False, natgrad=ps.infer.NaturalPolicy(finish=None))

    def fails(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.cholesky: the input is not positive-definite (forced)")

    monkeypatch.setattr(finish_module, "_optimum", fails)
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="gp")
    with pytest.warns(RuntimeWarning, match=r"no exact finish: .*200-point optimum could not be factorised.*keeps"):
        state = fit(gp, X, y, num_steps=10, batch_size=50, progress=False,
                    natgrad=ps.infer.NaturalPolicy(finish="exact"))
    assert len(state.losses) == 10
    for (name, p), (_, q) in zip(gp.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
