"""The training loop: it learns, uses the closed-form bound by default (a Pyro ELBO for custom modules), takes the
same batches from tensors, numpy arrays, a batch-reading dataset or a memory-mapped file, guards numerical failures
(restoring the last good parameters), checkpoints and resumes identically."""

import re

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints
from torch.utils.data import DataLoader, TensorDataset

import pyro_sparsegp as ps
from pyro_sparsegp.data_stream import MemmapDataset, write_npy
from pyro_sparsegp.infer import EpochBatchSampler, NonFiniteLossError, fit


def _data(n=300):
    X = torch.rand(n, 1) * 6 - 3
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(n)
    return X, y


def _gp():
    return ps.SVGP(RBF(1), torch.linspace(-3, 3, 12).unsqueeze(-1), ps.Gaussian(0.5))


def _same(a, b, tol=0.0):
    for (k, u), (_, v) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("natgrad_lr", [None, 0.5], ids=["adam", "natgrad"])
def test_fit_learns_a_function(natgrad_lr):
    X, y = _data()
    gp = _gp()
    state = fit(gp, X, y, num_steps=300, batch_size=64, lr=0.03, natgrad=natgrad_lr, progress=False)
    assert len(state.losses) == 300 and state.step == 300
    mean, _ = gp.predict(X)
    rmse = (mean - torch.sin(2 * X[:, 0])).pow(2).mean().sqrt()
    assert rmse < 0.1
    assert gp.likelihood.noise < 0.05


def test_the_default_objective_is_the_closed_form_bound():
    X, y = _data()
    gp = _gp()
    idx = EpochBatchSampler(len(X), 64, seed=4).permutation(0)[:64]
    expected = -gp.analytic_elbo(X[idx], y[idx], num_data=len(X)).item()
    state = fit(gp, X, y, num_steps=1, batch_size=64, seed=4, progress=False)
    assert state.losses[0] == pytest.approx(expected, rel=1e-6)


class _BayesLinear(PyroModule):
    """A custom module with model/guide only (no analytic_elbo): fit must use a Pyro ELBO for it."""

    def __init__(self):
        super().__init__()
        self.w_loc = PyroParam(torch.zeros(()), constraints.real)
        self.w_scale = PyroParam(torch.ones(()), constraints.positive)

    def model(self, X, y, num_data=None):
        w = pyro.sample("w", dist.Normal(0.0, 10.0))
        with pyro.plate("data", num_data, subsample_size=X.shape[0]):
            pyro.sample("y", dist.Normal(w * X[:, 0], 0.1), obs=y)

    def guide(self, X, y, num_data=None):
        pyro.sample("w", dist.Normal(self.w_loc, self.w_scale))


def test_a_custom_pyro_module_trains_with_a_pyro_elbo():
    X = torch.randn(200, 1)
    y = 1.7 * X[:, 0] + 0.1 * torch.randn(200)
    m = _BayesLinear()
    fit(m, X, y, num_steps=300, batch_size=50, lr=0.05, progress=False)
    assert abs(m.w_loc.item() - 1.7) < 0.05
    with pytest.raises(TypeError, match="analytic_elbo"):
        fit(_BayesLinear(), X, y, num_steps=1, elbo="analytic", progress=False)


def test_fit_accepts_a_dataloader_and_shows_progress(capsys):
    X, y = _data()
    gp = _gp()
    loader = DataLoader(TensorDataset(X, y), batch_size=50, shuffle=True, generator=torch.Generator(X.device))
    state = fit(gp, loader, num_data=len(X), num_steps=20, progress=True)
    assert state.step == 20
    err = capsys.readouterr().err
    assert re.search(r"fit: step 20/20 \(100%\)  elbo -?[0-9.]+", err), err


def test_a_loader_refuses_a_batch_size_and_a_num_data_smaller_than_its_batches():
    """A loader's batches are its own: ``batch_size=`` beside it raises (it was ignored); ``num_data`` is the size of
    the whole data set, so one smaller than a batch (a likelihood scaled below 1) raises at the first batch."""
    X, y = _data()
    loader = DataLoader(TensorDataset(X, y), batch_size=50)
    with pytest.raises(ValueError, match="a DataLoader's batches are its own"):
        fit(_gp(), loader, num_data=len(X), num_steps=2, batch_size=50, progress=False)
    with pytest.raises(ValueError, match="batch of 50 rows but num_data=10"):
        fit(_gp(), loader, num_data=10, num_steps=2, progress=False)


def test_tensors_arrays_lists_datasets_and_memmaps_give_the_same_run(tmp_path):
    """Batches are drawn by index; every data source yields the same batches (a memmap returns a batch's rows in
    sorted order, which leaves the bound, a sum over the batch, unchanged up to round-off)."""
    X, y = _data(200)
    ref = _gp()
    fit(ref, X, y, num_steps=12, batch_size=32, progress=False, seed=2)
    path = tmp_path / "data.npy"
    write_npy(path, X, y)
    sources = [
        dict(X=X.cpu().numpy(), y=y.cpu().numpy()),
        dict(X=X.tolist(), y=y.tolist()),
        dict(X=TensorDataset(X, y), y=None),
        dict(X=MemmapDataset(path), y=None),
    ]
    for src in sources:
        gp = _gp()
        fit(gp, **src, num_steps=12, batch_size=32, progress=False, seed=2)
        tol = 1e-3 if torch.get_default_dtype() == torch.float32 else 1e-10  # summation order
        _same(ref, gp, tol if isinstance(src["X"], MemmapDataset) else 0.0)


def test_memmap_dataset_reads_the_rows_it_is_asked_for(tmp_path):
    X, y = torch.randn(50, 3), torch.randn(50)
    path = tmp_path / "d.npy"
    write_npy(path, X, y, chunk=7)
    ds = MemmapDataset(path)
    assert len(ds) == 50 and ds.num_features == 3
    idx = torch.tensor([40, 3, 17])
    Xb, yb = ds[idx]
    order = idx.sort().values
    assert Xb.device.type == yb.device.type == "cpu"  # rows read into host memory; fit moves each batch
    torch.testing.assert_close(Xb, X[order].to(Xb))
    torch.testing.assert_close(yb, y[order].to(yb))
    with pytest.raises(IndexError, match="indices must be in"):
        ds[torch.tensor([50])]
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros(5))
    with pytest.raises(ValueError, match="bad.npy"):
        MemmapDataset(bad)


def test_non_finite_loss_stops_with_the_step_and_restores_the_last_finite_state():
    X, y = _data()
    gp = _gp()
    seen = {}

    def corrupt(step, loss):
        if step == 4:
            seen["good"] = {k: v.detach().clone() for k, v in gp.state_dict().items()}
        if step == 5:
            with torch.no_grad():
                gp.q_u.u_loc_unconstrained[0] = float("nan")

    with pytest.raises(NonFiniteLossError, match="step 5") as info:  # sync_every=1: a callback at every step, also
        fit(gp, X, y, num_steps=50, batch_size=64, progress=False, callback=corrupt, sync_every=1)  # on a GPU
    assert info.value.step == 5 and info.value.restored_step == 4
    assert len(info.value.state.losses) == 5
    # restored to the parameters at which the step-4 loss was computed (those after step 3's update)
    for k, v in gp.state_dict().items():
        assert torch.isfinite(v).all(), k
        torch.testing.assert_close(v, seen["good"][k], rtol=0, atol=0, msg=k)


def test_a_diverging_learning_rate_names_the_step_and_leaves_a_model_that_predicts():
    """lr = 100 makes the kernel or the noise overflow within a few steps; whatever fails (a non-finite loss, a
    Cholesky refusing inf, a validation error), fit restores the last good parameters and names the step."""
    X, y = _data()
    for elbo in ["analytic", pyro.infer.TraceMeanField_ELBO()]:
        gp = _gp()
        with pytest.raises(NonFiniteLossError, match=r"at step \d+") as info:
            fit(gp, X, y, num_steps=200, batch_size=64, lr=100.0, elbo=elbo, progress=False, natgrad=None)
        assert 0 < info.value.step < 200
        assert info.value.restored_step is not None and info.value.restored_step < info.value.step
        mean, var = gp.predict(X)
        assert torch.isfinite(mean).all() and torch.isfinite(var).all()
        assert len(info.value.state.losses) == info.value.step


def test_a_window_of_unsynchronised_steps_is_the_same_run_and_restores_its_start():
    X, y = _data()
    a, b = _gp(), _gp()
    fit(a, X, y, num_steps=23, batch_size=64, progress=False)
    seen = []
    state = fit(b, X, y, num_steps=23, batch_size=64, progress=False, sync_every=5,
                callback=lambda step, loss: seen.append((step, loss)))
    assert len(state.losses) == 23
    assert seen == list(enumerate(state.losses, 1))  # every step, in order, once its loss was read back
    _same(a, b)
    # a failure inside a window restores the parameters copied at the window's start
    gp = _gp()
    with pytest.raises(NonFiniteLossError, match=r"at step \d+") as info:
        fit(gp, X, y, num_steps=200, batch_size=64, lr=100.0, progress=False, sync_every=5, natgrad=None)
    j = info.value.step
    assert info.value.restored_step == (j - j % 5 if j % 5 else j - 5)  # the window's start (the previous one's)
    assert len(info.value.state.losses) == j
    assert all(torch.isfinite(v).all() for v in gp.state_dict().values())


@pytest.mark.parametrize("natgrad_lr", [None, 0.5], ids=["adam", "natgrad"])
def test_checkpoint_resumes_identically(tmp_path, natgrad_lr):
    X, y = _data()
    straight = _gp()
    kw = dict(batch_size=64, progress=False, seed=3, natgrad=natgrad_lr)
    fit(straight, X, y, num_steps=30, **kw)

    first = _gp()
    path = tmp_path / "ckpt.pt"
    fit(first, X, y, num_steps=13, checkpoint=str(path), **kw)
    resumed = _gp()
    with torch.no_grad():  # start from a different state to show the checkpoint overrides it
        resumed.q_u.u_loc_unconstrained.add_(1.0)
    state = fit(resumed, X, y, num_steps=30, checkpoint=ps.infer.Checkpoint(None, resume=str(path)), **kw)
    assert state.step == 30 and len(state.losses) == 30
    _same(straight, resumed)


def test_solvegp_trains_with_natural_gradients():
    X, y = _data()
    gp = ps.SOLVEGP(RBF(1), torch.linspace(-3, 3, 6).unsqueeze(-1), torch.linspace(-2.7, 2.7, 6).unsqueeze(-1),
                    ps.Gaussian(0.5))
    fit(gp, X, y, num_steps=200, batch_size=64, lr=0.03, natgrad=0.5, progress=False)
    mean, _ = gp.predict(X)
    assert (mean - torch.sin(2 * X[:, 0])).pow(2).mean().sqrt() < 0.1


def test_the_sampler_visits_every_point_once_per_epoch_in_memory_independent_of_n():
    from pyro_sparsegp.infer.training.batches import _round_keys, permute_positions

    for n in [1, 2, 3, 7, 64, 1000, 4099]:
        p = permute_positions(np.arange(n), n, _round_keys(5, 2))
        assert torch.equal(p.sort().values, torch.arange(n, device=p.device)), n
    s = EpochBatchSampler(103, 10, seed=1)
    it = iter(s)
    epochs = [torch.cat([next(it) for _ in range(s.steps_per_epoch)]) for _ in range(2)]
    for e in epochs:
        assert torch.equal(e.sort().values, torch.arange(103, device=e.device))
    assert not torch.equal(epochs[0], epochs[1])  # a new order each epoch
    assert torch.equal(epochs[1], s.permutation(1))
    # a batch of a huge data set costs O(B): positions only, never the whole permutation
    b = permute_positions(np.arange(5 * 10**11, 5 * 10**11 + 8), 10**12, _round_keys(0, 0))
    assert b.shape == (8,) and bool(((b >= 0) & (b < 10**12)).all()) and len(set(b.tolist())) == 8


def test_memmap_dataset_pickles_for_dataloader_workers(tmp_path):
    import pickle

    X, y = torch.randn(20, 2), torch.randn(20)
    write_npy(tmp_path / "p.npy", X, y)
    ds = pickle.loads(pickle.dumps(MemmapDataset(tmp_path / "p.npy")))
    Xb, yb = ds[torch.tensor([3, 1])]
    torch.testing.assert_close(Xb, X[[1, 3]].to(Xb))


class _RandomIntercepts(PyroModule):
    """A user's hierarchical model whose guide is an autoguide inside the module: its parameters (``locs``,
    ``scales``) are created at the guide's first call, after ``fit`` has been called."""

    def __init__(self, groups):
        super().__init__()
        self.groups = groups
        self.noise = PyroParam(torch.tensor(0.3), constraints.positive)  # created eagerly, as most are
        self.auto = AutoNormal(self.model)

    def model(self, X, y, num_data=None):
        sd = pyro.sample("sd", dist.LogNormal(0.0, 1.0))
        with pyro.plate("groups", self.groups):
            b = pyro.sample("b", dist.Normal(0.0, sd))
        with pyro.plate("data", num_data, subsample_size=X.shape[0]):
            pyro.sample("y", dist.Normal(b[X[:, 0].long()], self.noise), obs=y)

    def guide(self, X, y, num_data=None):
        return poutine.block(self.auto, hide=["noise"])(X, y, num_data=num_data)


@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_parameters_created_at_the_first_call_are_trained(local):
    """fit trains the parameters a guide creates lazily (an AutoNormal inside a user's PyroModule): every group's
    intercept reaches its data's mean (before, they kept their initial values, silently)."""
    with pyro.settings.context(module_local_params=local):
        pyro.clear_param_store()
        g = torch.arange(200) % 4
        X = g[:, None].to(torch.get_default_dtype())
        means = torch.tensor([-2.0, -0.5, 1.0, 2.5])
        y = means[g] + 0.1 * torch.randn(200)
        m = _RandomIntercepts(4)
        fit(m, X, y, num_steps=400, batch_size=50, lr=0.05, progress=False, elbo=Trace_ELBO())
        locs = m.auto.locs.b.detach()
        torch.testing.assert_close(locs, means, atol=0.15, rtol=0)


def test_a_run_with_lazily_created_parameters_resumes_exactly(tmp_path):
    """The checkpoint of a module whose guide creates its parameters at the first call loads into a fresh module
    (they are created before the checkpoint is read), and the resumed run ends where an unbroken one does."""
    g = torch.arange(120) % 4
    X = g[:, None].to(torch.get_default_dtype())
    y = torch.tensor([-2.0, -0.5, 1.0, 2.5])[g] + 0.1 * torch.randn(120)
    kw = dict(batch_size=30, lr=0.05, progress=False, elbo=Trace_ELBO())
    whole = _RandomIntercepts(4)
    fit(whole, X, y, num_steps=40, **kw)
    ckpt = tmp_path / "run.pt"
    part = _RandomIntercepts(4)
    fit(part, X, y, num_steps=20, checkpoint=str(ckpt), **kw)
    resumed = _RandomIntercepts(4)
    fit(resumed, X, y, num_steps=40, checkpoint=ps.infer.Checkpoint(str(ckpt), resume=True), **kw)
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("natgrad_lr", [0.1, None])
def test_fits_update_is_the_natural_gradient_optimiser_over_its_adam(natgrad_lr):
    """fit and a user's SVI share one engine: fit's update is ps.infer.NaturalGradient wrapping fit's own Adam (the
    optimiser its checkpoints hold); without natural gradients it is that Adam alone."""
    from pyro_sparsegp.infer.training.steps import TrainingStep

    X = torch.randn(40, 2)
    gp = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(0.1))
    step = TrainingStep(gp, "analytic", 40, 0.01, natgrad_lr)
    assert isinstance(step.engine, ps.infer.NaturalGradient) == (natgrad_lr is not None)
    adam = step.engine.optim if natgrad_lr else step.engine
    assert adam.optimizer is step.optimizer
    if natgrad_lr:
        assert step.engine.families == [gp.q_u] and step.engine.num_obs is not None
        stepped = {id(p) for g in step.optimizer.param_groups for p in g["params"]}
        assert not stepped & {id(p) for p in [*gp.q_u.parameters(), gp.likelihood.noise_unconstrained]}


def test_the_fit_loop_keeps_to_the_house_rules():
    """fit is a short loop over parts in modules of their own: no function over 80 lines of code (docstrings not
    counted), no class over 200 lines, no file over 400, no ``nonlocal``."""
    import ast
    import pathlib

    folder = pathlib.Path(ps.__file__).parent / "infer" / "training"
    for name in ["loop", "arguments", "batches", "checkpoint", "guard", "distributed", "steps", "exact_finish",
                 "progress"]:
        src = (folder / f"{name}.py").read_text()
        assert len(src.splitlines()) <= 400 and "nonlocal" not in src, name
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if ast.get_docstring(node) is not None:
                    lines -= node.body[0].end_lineno - node.body[0].lineno + 1
                assert lines <= (200 if isinstance(node, ast.ClassDef) else 80), (name, node.name, lines)


def test_fit_inside_no_grad_says_so():
    X, y = _data()
    gp = _gp()
    with torch.no_grad(), pytest.raises(RuntimeError, match="inside torch.no_grad"):
        fit(gp, X, y, num_steps=2, progress=False)
