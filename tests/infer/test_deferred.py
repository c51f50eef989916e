"""Deferred checks (``pyro_sparsegp.context.deferred``): ``fit`` on an accelerator reads nothing back inside a step; a
failed factorisation or an inexact kernel flagged in a window makes ``fit`` redo the window with the remedy.

The deferred path is what every device but the CPU takes; here it is forced on the CPU (``loop._DEFER_ON_CPU``)."""

import importlib
import traceback
import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.context import deferred
from pyro_sparsegp.deep import build_deep_gp
from pyro_sparsegp.linalg import CholeskyJitterWarning, reset_warnings

FIT = importlib.import_module("pyro_sparsegp.infer.training.loop")  # the module (``ps.infer.fit`` is the function)
READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__")


@pytest.fixture
def defer_on_cpu(monkeypatch):
    monkeypatch.setattr(FIT, "_DEFER_ON_CPU", True)


def _data(N=120, D=3, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.randn(N, D, generator=g).to(torch.get_default_dtype())
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(N, generator=g).to(X.dtype)


def _module(kind, X, y):
    if kind == "svgp":
        return ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:16].clone(), ps.Gaussian(0.1)), y
    if kind == "solvegp":
        return ps.SOLVEGP(RBF(3, lengthscale=torch.ones(3)), X[:10].clone(), X[10:20].clone(), ps.Gaussian(0.1)), y
    if kind == "deep":
        return build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=8, num_samples=2), y
    if kind == "bernoulli":
        return ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:16].clone(), ps.Bernoulli()), (y > 0).to(X.dtype)
    if kind == "robustmax":
        labels = (y > 0).long() + (X[:, 1] > 0).long()
        gp = ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:16].clone(), ps.RobustMax(3), num_outputs=3)
        return gp, labels
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["svgp", "solvegp", "deep", "bernoulli", "robustmax"])
def test_a_deferred_step_reads_nothing_back(kind, defer_on_cpu, monkeypatch):
    """Every read of a tensor's value while the deferred context is active (inside a step) is recorded; none may
    happen (Adam's own step counter, a CPU tensor on every device, is the optimiser's, not ours)."""
    X, y = _data()
    gp, y = _module(kind, X, y)
    reads = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, __original=original, __name=name, **kwargs):
            if deferred.active() is not None:
                stack = traceback.extract_stack()[:-1]
                if not any("torch/optim/" in frame.filename for frame in stack):
                    reads.append((__name, [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in stack[-4:]]))
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    state = ps.infer.fit(gp, X, y, num_steps=6, batch_size=40, progress=False, sync_every=3)
    assert reads == []
    assert len(state.losses) == 6 and all(torch.isfinite(torch.tensor(state.losses)))


@pytest.mark.float64
@pytest.mark.parametrize("kind", ["svgp", "solvegp"])
def test_deferred_fit_equals_the_immediate_fit(kind, monkeypatch):
    X, y = _data()
    runs = []
    for defer in (False, True):
        monkeypatch.setattr(FIT, "_DEFER_ON_CPU", defer)
        gp, yy = _module(kind, X, y)
        state = ps.infer.fit(gp, X, yy, num_steps=12, batch_size=40, progress=False, sync_every=4)
        runs.append((state.losses, [p.detach().clone() for p in gp.parameters()]))
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-10, atol=1e-10)
    for a, b in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.float64
def test_a_failed_factorisation_redoes_the_window_with_more_jitter(monkeypatch):
    """A factorisation reported failed in the second window (steps 4-7) makes fit restore the window's parameters
    and Adam moments, raise the jitter tenfold (CholeskyJitterWarning) and run the window again on the same
    minibatches: the run then matches the immediate fit (whose jitter is 1e-10 relative) to the jitter's size."""
    X, y = _data()
    gp0, _ = _module("svgp", X, y)
    immediate = ps.infer.fit(gp0, X, y, num_steps=12, batch_size=40, progress=False, sync_every=4)

    monkeypatch.setattr(FIT, "_DEFER_ON_CPU", True)
    real = torch.linalg.cholesky_ex
    calls = {"n": 0, "failed": 0}

    def flaky(A, *args, **kwargs):  # linalg.cholesky's factorisation of Kuu at step 5 (the second window) fails
        L, info = real(A, *args, **kwargs)
        if traceback.extract_stack()[-2].name != "cholesky":
            return L, info  # the natural-gradient step's own factorisation
        calls["n"] += 1
        window = deferred.active()  # None after the loop (fit's exact finish checks at once)
        if window is not None and window.jitter_scale == 1.0 and calls["n"] == 6:
            calls["failed"] += 1
            return torch.full_like(L, float("nan")), torch.ones_like(info)
        return L, info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", flaky)
    reset_warnings()
    gp1, _ = _module("svgp", X, y)
    with pytest.warns(CholeskyJitterWarning, match="redone"):
        state = ps.infer.fit(gp1, X, y, num_steps=12, batch_size=40, progress=False, sync_every=4)
    assert calls["failed"] == 1
    assert len(state.losses) == 12 and state.step == 12
    torch.testing.assert_close(torch.tensor(state.losses), torch.tensor(immediate.losses), rtol=1e-6, atol=0)
    for a, b in zip(gp1.parameters(), gp0.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_factorisation_that_always_fails_raises_after_the_escalations(defer_on_cpu, monkeypatch):
    X, y = _data()
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex",
                        lambda A, *a, **k: (real(A, *a, **k)[0], torch.ones(A.shape[:-2], dtype=torch.int32)))
    gp, _ = _module("svgp", X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CholeskyJitterWarning)
        with pytest.raises(torch.linalg.LinAlgError, match="times the base jitter"):
            ps.infer.fit(gp, X, y, num_steps=4, batch_size=40, progress=False, sync_every=2)


def test_an_inexact_kernel_redoes_the_window_on_the_exact_differences(defer_on_cpu, monkeypatch):
    """float32 inputs with an outlier whose neighbour is an inducing input (the product form is inexact there only in
    float32, so the test builds a float32 model in either pass): the product form is flagged inexact, the window is
    redone, and from then on every kernel takes the exact differences."""
    kernels = importlib.import_module("pyro_sparsegp.kernels.batched")
    real, exact_calls = kernels._sqdist_by_differences, {"n": 0}

    def counting(*args):
        if deferred.active() is not None:
            exact_calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(kernels, "_sqdist_by_differences", counting)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        X, y = _data(N=80)
        X[5] = torch.tensor([3e3, 0.0, 0.0])  # an outlier, with an inducing input beside it
        Z = torch.cat([X[:15], X[5:6] + 0.3])
        gp = ps.SVGP(RBF(3, lengthscale=torch.ones(3)), Z, ps.Gaussian(0.1))
        state = ps.infer.fit(gp, X, y, num_steps=6, batch_size=80, progress=False, sync_every=3)
    finally:
        torch.set_default_dtype(previous)
    assert exact_calls["n"] >= 6 * 2  # Kuu and Kuf of every step after the switch (the first window redone)
    assert len(state.losses) == 6 and all(torch.isfinite(torch.tensor(state.losses)))


def test_a_non_finite_loss_is_still_named_in_deferred_mode(defer_on_cpu):
    X, y = _data()
    y = y.clone()
    gp, _ = _module("svgp", X, y)
    dataset = torch.utils.data.TensorDataset(X, y)
    y_bad = y.clone()
    y_bad[50:] = float("nan")  # the steps' value checks are deferred: the NaN reaches the loss

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, idx):
            return X[idx], y_bad[idx]

    with pytest.raises(ps.infer.NonFiniteLossError, match="step"):
        ps.infer.fit(gp, Bad(), num_steps=8, batch_size=40, progress=False, sync_every=4)


@pytest.mark.float64
def test_a_natural_step_to_damp_redoes_the_window_with_damping_at_once(monkeypatch):
    """A natural-gradient step whose new precision has no Cholesky factor (here: the first factorisation of step 5,
    in every pass) is halved at once on the CPU. With deferred checks it is flagged instead, its window (steps 4-7)
    is redone with the halving's host reads switched on for the rest of the run, and the run equals the immediate
    one, the NatGradDampingWarning included (on a GPU this step used to end the run with a NonFiniteLossError)."""
    from pyro_sparsegp.infer.natgrad import NatGradDampingWarning

    real, current = torch.linalg.cholesky_ex, {"step": -1, "calls": 0}
    begin = FIT.StepGuard.begin

    def tracked_begin(self, step):
        current["step"], current["calls"] = step, 0
        return begin(self, step)

    def flaky(A, *args, **kwargs):  # the natural step's own factorisation (natgrad_from_grads_'s ``factor``)
        L, info = real(A, *args, **kwargs)
        if traceback.extract_stack()[-2].name == "factor" and current["step"] == 5:
            current["calls"] += 1
            if current["calls"] == 1:
                return torch.full_like(L, float("nan")), torch.ones_like(info)
        return L, info

    monkeypatch.setattr(FIT.StepGuard, "begin", tracked_begin)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", flaky)
    X, y = _data()
    runs = []
    for defer in (False, True):
        monkeypatch.setattr(FIT, "_DEFER_ON_CPU", defer)
        reset_warnings()
        gp, yy = _module("bernoulli", X, y)
        with pytest.warns(NatGradDampingWarning, match="shortened to 0.25"):
            state = ps.infer.fit(gp, X, yy, num_steps=12, batch_size=40, progress=False, sync_every=4,
                                 natgrad=0.5)
        runs.append((state.losses, [p.detach().clone() for p in gp.parameters()]))
    assert len(runs[1][0]) == 12
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-8, atol=1e-8)
    for a, b in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)
