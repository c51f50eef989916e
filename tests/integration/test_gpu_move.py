"""The GPU path that docs/gpu.md recommends: a module built on the CPU, moved with ``module.to("cuda")``, trained by
``fit`` from CPU data (tensors and numpy) and asked for predictions, with no default device set. The suite's
``PYRO_SPARSEGP_DEVICE=cuda`` pass sets the default device, which would hide a CPU-made tensor meeting a GPU one;
here everything is built under ``torch.device("cpu")``. Needs CUDA: skipped on the CPU (CI)."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.deep import build_deep_gp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _data(N=300):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(N, 2, generator=g) * 4 - 2
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(N, generator=g)


def _model(kind, X, y):
    """The module of ``kind``, its targets and fit's extra arguments (only that module is built)."""
    k = lambda: RBF(2, lengthscale=torch.ones(2))  # noqa: E731
    if kind == "svgp":
        return ps.SVGP(k(), X[:20].clone(), ps.Gaussian(0.1)), y, {}
    if kind == "solvegp":
        return ps.SOLVEGP(k(), X[:10].clone(), X[10:20].clone(), ps.Gaussian(0.1)), y, {}
    if kind == "robustmax":
        labels = (y > 0).long() + (X[:, 1] > 0).long()
        return ps.SVGP(k(), X[:20].clone(), ps.RobustMax(3), num_outputs=3), labels, {"natgrad": "auto"}
    return build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=10, num_samples=2), y, {}


@pytest.mark.parametrize("kind", ["svgp", "solvegp", "robustmax", "deep"])
def test_a_module_moved_to_the_gpu_trains_from_cpu_data_and_predicts(kind):
    with torch.device("cpu"):
        X, y = _data()
        gp, yy, kw = _model(kind, X, y)
    gp = gp.to("cuda")
    state = ps.infer.fit(gp, X.numpy(), yy.numpy(), num_steps=40, batch_size=100, progress=False, **kw)
    assert len(state.losses) == 40 and state.losses[-1] < state.losses[0]
    assert all(p.device.type == "cuda" for p in gp.parameters())
    out = gp.predict(X[:50].to("cuda"))
    first = out[0] if isinstance(out, tuple) else out
    assert first.device.type == "cuda" and torch.isfinite(first).all()


def test_a_shuffled_cpu_dataloader_feeds_a_gpu_module():
    with torch.device("cpu"):
        X, y = _data()
        gp = ps.SVGP(RBF(2, lengthscale=torch.ones(2)), X[:20].clone(), ps.Gaussian(0.1))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=50, shuffle=True)
    gp = gp.to("cuda")
    with torch.device("cpu"):  # no default device here (the suite's CUDA pass sets one: docs/gpu.md's loader note)
        state = ps.infer.fit(gp, loader, num_data=len(X), num_steps=20, progress=False)
    assert state.losses[-1] < state.losses[0] and all(p.device.type == "cuda" for p in gp.parameters())
