"""The ONNX route: an SVGP's and a deep GP's predictive means and variances, exported through
``ps.deploy.export_onnx`` (``torch.onnx.export(..., dynamo=True)``) as one graph (one export keeps the test's cost
down; each model's part is its own subgraph of the plain predictor), run in ONNX Runtime in float64 at two batch
sizes other than the example's, equal ``predict`` to 1e-10."""

import numpy as np
import pytest
import torch
from deploy_cases import deep_predict, random_q
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import FixedProjection


class _Both(torch.nn.Module):
    """Two predictors served as one program: ``X -> (svgp mean, svgp var, deep mean, deep var)``."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, X):
        return self.a(X) + self.b(X)


@pytest.mark.float64
def test_onnx_runtime_predicts_as_predict(tmp_path, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    X = torch.randn(30, 2)
    svgp = ps.SVGP(RBF(2, lengthscale=torch.tensor([0.8, 1.2])), X[:6].clone(), ps.Gaussian(0.1))
    hidden = ps.SVGP(RBF(2), X[:6].clone(), num_outputs=2, mean_function=FixedProjection.from_pca(X, 2), name="h")
    last = ps.SVGP(RBF(2), torch.randn(5, 2), ps.Gaussian(0.1), name="out")
    deep = ps.DeepGP([hidden, last])
    for gp in (svgp, hidden, last):
        random_q(gp.q_u)
    both = _Both(ps.deploy.predictor(svgp), ps.deploy.predictor(deep, num_samples=8, seed=1))
    ps.deploy.export_onnx(both, X[:7], tmp_path / "both.onnx")
    session = ort.InferenceSession(str(tmp_path / "both.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(double)"  # float64 as exported
    for n in (3, 11):
        Xt = torch.randn(n, 2)
        got = session.run(None, {"X": Xt.numpy()})
        want = svgp.predict(Xt) + deep_predict(deep, Xt, 8, 1, monkeypatch)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-10)
