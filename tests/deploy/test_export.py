"""``ps.export``: every model's exported program, saved and loaded in a fresh process that cannot import Pyro or the
package, predicts what ``predict`` does (float64, 1e-10) at batch sizes other than the example's; models that cannot
be exported raise errors naming the fix; the input checks stay out of a traced graph (a user's own wrapper around
``predict`` exports and traces cleanly)."""

import subprocess
import sys
import warnings

import pyro.distributions as dist
import pytest
import torch
from deploy_cases import deep_predict, random_q
from pyro.contrib.gp.kernels import RBF, Cosine, Matern32, Matern52, Sum
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import FixedProjection, Linear

# the bare process: imports torch only; a finder refuses pyro and pyro_sparsegp, and the end asserts neither loaded
LOADER = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyro", "pyro_sparsegp"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch
torch.set_num_threads(1)
where = sys.argv[1]
names = sys.argv[2].split(",")
inputs = torch.load(where + "/inputs.pt")
out = {}
for name in names:
    program = torch.export.load(f"{where}/{name}.pt2").module()
    out[name] = [program(X) for X in inputs[name]]
assert not any(m.split(".")[0] in ("pyro", "pyro_sparsegp") for m in sys.modules), sorted(sys.modules)
torch.save(out, where + "/outputs.pt")
"""


def _models(X):
    """The models of issue 55, tiny, with random q (and ODVGP's mean weights)."""
    D = X.shape[-1]
    svgp = ps.SVGP(RBF(D, lengthscale=torch.tensor([0.7, 1.3])), X[:6].clone(), ps.Gaussian(0.1))
    plain = ps.SVGP(Matern52(D), X[:6].clone(), ps.Gaussian(0.1), whiten=False, num_outputs=2,
                    mean_function=Linear(D, 2, torch.randn(D, 2), torch.randn(2)))
    solve = ps.SOLVEGP(Sum(RBF(D), Matern32(D)), X[:5].clone(), X[5:9].clone(), ps.Gaussian(0.1))
    odvgp = ps.ODVGP(RBF(D), X[:5].clone(), X[5:20].clone(), ps.Gaussian(0.1))
    lmc = ps.SVGP(RBF(D), X[:6].clone(), ps.Gaussian(0.1), num_outputs=3, num_latents=2)
    hidden = ps.SVGP(RBF(D), X[:6].clone(), num_outputs=2, mean_function=FixedProjection.from_pca(X, 2), name="h")
    last = ps.SVGP(RBF(2), torch.randn(5, 2), ps.Gaussian(0.1), name="out")
    deep = ps.DeepGP([hidden, last])
    for gp in (svgp, plain, solve, odvgp, lmc, hidden, last):
        random_q(gp.q_u)
    random_q(solve.q_v)
    with torch.no_grad():
        odvgp.a.copy_(torch.randn_like(odvgp.a))
    return {"svgp": svgp, "plain": plain, "solve": solve, "odvgp": odvgp, "lmc": lmc, "deep": deep}


@pytest.mark.float64
def test_exported_programs_predict_as_predict_in_a_bare_process(tmp_path, monkeypatch):
    X = torch.randn(40, 2)
    models = _models(X)
    inputs, expected = {}, {}
    for name, model in models.items():
        what = ("mean", "var", "y_mean", "y_var") if name in ("svgp", "deep") else ("mean", "var")
        ep = ps.export(model, X[:7], what=what, num_samples=16, seed=3)
        assert "pyro" not in ep.graph_module.code
        torch.export.save(ep, tmp_path / f"{name}.pt2")
        inputs[name] = [torch.randn(3, 2), torch.randn(11, 2)]
        expected[name] = []
        for Xt in inputs[name]:
            mean, var = deep_predict(model, Xt, 16, 3, monkeypatch) if name == "deep" else model.predict(Xt)
            noise = model.likelihood.noise
            expected[name].append((mean, var, mean, var + noise)[: len(what)])
    torch.save(inputs, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-I", "-c", LOADER, str(tmp_path), ",".join(models)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt")
    for name in models:
        for got, want in zip(outputs[name], expected[name], strict=True):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape, name
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


def test_refusals_name_the_fix():
    X = torch.randn(20, 2)
    k = RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
    with pytest.raises(ValueError, match="point values"):
        ps.deploy.predictor(ps.SVGP(k, X[:4].clone(), ps.Gaussian()))
    with pytest.raises(ValueError, match="Cosine has no plain-torch form"):
        ps.deploy.predictor(ps.SVGP(Cosine(2), X[:4].clone(), ps.Gaussian()))
    multi = ps.SVGP(RBF(2), X[:4].clone(), ps.RobustMax(3))
    assert ps.deploy.predictor(multi, what=("mean", "var"))(X[:5])[0].shape == (5, 3)  # f's moments: fine
    with pytest.raises(ValueError, match="export what=\\('mean', 'var'\\) of f"):
        ps.deploy.predictor(multi, what=("y_mean",))
    with pytest.raises(ValueError, match="needs closed-form predictive moments"):
        ps.deploy.predictor(ps.SVGP(RBF(2), X[:4].clone(), ps.Beta()), what=("y_mean",))
    with pytest.raises(ValueError, match="what must be distinct names"):
        ps.deploy.predictor(ps.SVGP(RBF(2), X[:4].clone(), ps.Gaussian()), what=("mean", "sd"))


@pytest.mark.float64
def test_y_moments_match_the_predictive_distribution():
    # the closed forms of the program against the mean and variance of predict's own predictive distribution (its
    # Gauss-Hermite mixture, or Bernoulli's probabilities); one test for the six (a test's own overhead dominates)
    X = torch.randn(20, 2)
    for likelihood in (ps.Poisson(), ps.NegativeBinomial(0.7), ps.NegativeBinomial(0.7, variance="NB1"),
                       ps.Bernoulli(), ps.Bernoulli(link="logit"), ps.StudentT(scale=0.4, df=5.0)):
        gp = ps.SVGP(RBF(2), X[:5].clone(), likelihood)
        random_q(gp.q_u)
        y_mean, y_var = ps.deploy.predictor(gp, what=("y_mean", "y_var"))(X)
        pred = gp.predict(X, full=True)[2]
        tol = 1e-7 if getattr(likelihood, "link", None) == "logit" else 1e-9  # 20 nodes in predict, 100 here
        torch.testing.assert_close(y_mean, pred.mean, rtol=tol, atol=tol, msg=type(likelihood).__name__)
        torch.testing.assert_close(y_var, pred.variance, rtol=tol, atol=tol, msg=type(likelihood).__name__)


@pytest.mark.float64
def test_mean_only_program_folds_the_projection():
    X = torch.randn(20, 2)
    gp = ps.SOLVEGP(RBF(2), X[:4].clone(), X[4:8].clone(), ps.Gaussian(0.1), num_outputs=2, whiten=False)
    random_q(gp.q_u)
    random_q(gp.q_v)
    (mean,) = ps.deploy.predictor(gp, what="mean")(X)
    assert len(gp.strategy.cache) == 0  # the constants are taken; no factor is left behind in the layer's cache
    torch.testing.assert_close(mean, gp.predict(X)[0], rtol=1e-10, atol=1e-10)
    sv = ps.SVGP(RBF(2), X[:4].clone(), ps.Gaussian(0.1))
    ps.deploy.predictor(sv, what="mean")
    assert len(sv.strategy.cache) == 0


class _Wrapper(torch.nn.Module):
    """A user's own module around ``predict``, as issue 55 wrote it."""

    def __init__(self, gp):
        super().__init__()
        self.gp = gp

    def forward(self, X):
        return self.gp.predict(X)[0]


@pytest.mark.float64
def test_a_wrapper_around_predict_exports_and_traces_without_the_checks():
    X = torch.randn(30, 2)
    gp = ps.SVGP(RBF(2), X[:6].clone(), ps.Gaussian(0.1))
    random_q(gp.q_u)
    ep = torch.export.export(_Wrapper(gp), (X[:7],), dynamic_shapes={"X": {0: torch.export.Dim("batch")}})
    torch.testing.assert_close(ep.module()(X[:11]), gp.predict(X[:11])[0], rtol=1e-10, atol=1e-10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(_Wrapper(gp), (X[:7],))
    ours = [w for w in caught if "pyro_sparsegp" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    torch.testing.assert_close(traced(X[:7]), gp.predict(X[:7])[0], rtol=1e-10, atol=1e-10)
