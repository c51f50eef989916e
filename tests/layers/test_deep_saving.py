"""Deep models saved with their layout (``pyro_sparsegp.saving``) and reloaded without their training data: trained
a few steps, saved, loaded by a fresh Python process that has only the files (``subprocess``), they have the same
parameters and predict the same from the same seed (DGPs of 2 and 3 layers with SVGP and SOLVE-GP hidden layers,
PCA / zero-padding / linear / constant mean functions, Gaussian, robust-max and Bernoulli likelihoods, a deep
convolutional GP). In one process a loaded copy takes fresh names and keeps its own values; every likelihood's and
kernel's settings come back; corrupted or mismatched files raise errors naming the file and the mismatch."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32, Sum, WhiteNoise
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.conv import build_deep_conv_gp
from pyro_sparsegp.deep import build_deep_gp
from pyro_sparsegp.mean_functions import Constant, Linear
from pyro_sparsegp.saving import LayoutError, build, describe

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}

CHILD = """
import sys, torch, pyro_sparsegp as ps
out = {}
for name in sys.argv[1:]:
    model = ps.saving.load(name + ".pt")                 # the layout and the values: no training data here
    X = torch.load(name + "_Xtest.pt")
    torch.manual_seed(0)
    loc, var = model.predict(X, num_samples=7)
    res = {"loc": loc, "var": var, "state": model.state_dict(), "config": model.config()}
    if model.likelihood.support is not ps.Gaussian.support:
        torch.manual_seed(1)
        res["proba"] = model.predict_proba(X, num_samples=7)
    out[name] = res
torch.save(out, "child.pt")
"""


def _hand_built(X):
    """3 layers by hand: an SVGP hidden layer with a trained linear mean, a SOLVE-GP hidden layer with a constant
    mean (one set of inducing inputs per output) and Matérn-3/2 kernel, a Bernoulli (logit) last layer."""
    a = ps.SVGP(RBF(3, lengthscale=torch.ones(3)), X[:6].clone(), num_outputs=3, name="a",
                mean_function=Linear(3, 3, A=torch.eye(3) + 0.1 * torch.randn(3, 3)))
    b = ps.SOLVEGP(Matern32(3), torch.randn(2, 5, 3), torch.randn(2, 3, 3), num_outputs=2, whiten=False, name="b",
                   mean_function=Constant(2, 0.3), jitter=1e-5)
    c = ps.SVGP(RBF(2), torch.randn(5, 2), ps.Bernoulli(link="logit", num_gh=7), name="c")
    return ps.DeepGP([a, b, c], num_samples=2, name="hand")


def _models():
    """``name -> (model, X, y)``: the models of the module docstring, built on their training data."""
    X = torch.randn(60, 3)
    labels = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()  # 3 classes
    images = torch.rand(30, 64)
    return {
        "dgp2_svgp_gaussian": (build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=8), X, X[:, 0].sin()),
        "dgp3_solvegp_robustmax": (build_deep_gp(X, [2, 4], ps.RobustMax(3), num_inducing=6, num_orthogonal=4,
                                                 kernel="matern52", whiten=False), X, labels.to(X.dtype)),
        "dgp3_hand_bernoulli": (_hand_built(X), X, (X[:, 0] > 0).to(X.dtype)),
        "deep_conv_solvegp": (build_deep_conv_gp(images, (8, 8, 1), 3, hidden=[(3, 1, 2), (2, 1, 2)], output=(2, 2),
                                                 solve=True, num_inducing=(4, 5), per_centre=3, seed=0),
                              images, torch.randint(0, 3, (30,)).to(images.dtype)),
    }


def _predict(model, X):
    torch.manual_seed(0)
    out = dict(zip(("loc", "var"), model.predict(X, num_samples=7), strict=True))
    if model.likelihood.support is not ps.Gaussian.support:
        torch.manual_seed(1)
        out["proba"] = model.predict_proba(X, num_samples=7)
    return out


def test_deep_models_reload_in_a_fresh_process_without_data(tmp_path):
    models = _models()
    expected = {}
    for name, (model, X, y) in models.items():
        ps.infer.fit(model, X, y, num_steps=3, batch_size=20, progress=False)
        model.save(tmp_path / f"{name}.pt")
        torch.save(X[:9].clone(), tmp_path / f"{name}_Xtest.pt")  # the child's only inputs: nine test points
        expected[name] = _predict(model, X[:9])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(CHILD), *models], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    child = torch.load(tmp_path / "child.pt")
    for name, (model, _, _) in models.items():
        got, state = child[name], model.state_dict()
        assert list(got["state"]) == list(state), name
        unequal = [k for k in state if not torch.equal(got["state"][k], state[k])]
        assert not unequal, (name, unequal)  # kernels, inducing inputs/patches/locations, W, q(u), q(v), noise
        assert got["config"] == model.config(), name  # a fresh process: the saved names too
        for key, value in expected[name].items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, (name, key)
            tol = TOL[value.dtype]
            torch.testing.assert_close(got[key], value, rtol=tol, atol=tol, msg=f"{name}: {key}")


def test_a_copy_loaded_beside_its_original_takes_fresh_names(tmp_path):
    """Under Pyro's global parameter store: loading while the original lives gives the copy fresh names (no
    ParamStoreWarning, which the suite turns into an error), the same predictions, and values of its own: training
    the copy leaves the original as it was."""
    with pyro.settings.context(module_local_params=False):
        pyro.clear_param_store()
        X, y = torch.randn(40, 3), torch.randn(40)
        dgp = build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=6, name="orig")
        with torch.no_grad():
            dgp.last.q_u.u_loc = torch.randn(6)
        dgp.save(tmp_path / "m.pt")
        copy = ps.DeepGP.load(tmp_path / "m.pt")
        assert copy.name != "orig" and {lay.name for lay in copy.layers}.isdisjoint(lay.name for lay in dgp.layers)
        a, b = _predict(dgp, X[:5]), _predict(copy, X[:5])
        torch.testing.assert_close(a["loc"], b["loc"], rtol=0, atol=0)
        before = {k: v.clone() for k, v in dgp.state_dict().items()}
        ps.infer.fit(copy, X, y, num_steps=2, progress=False)
        assert all(torch.equal(before[k], v) for k, v in dgp.state_dict().items())
        assert not torch.equal(before["layers.1.q_u.u_loc_unconstrained"], copy.last.q_u.u_loc)


def _settings(module):
    """The plain settings of every submodule (numbers, strings, tuples, ``None``), names left out."""
    plain = (bool, int, float, str, tuple, type(None))
    return {path: {k: v for k, v in vars(m).items() if isinstance(v, plain) and not k.startswith("_") and k != "name"}
            for path, m in module.named_modules()}


LIKELIHOODS = {"Gaussian": lambda: ps.Gaussian(0.3, num_gh=11), "Bernoulli": lambda: ps.Bernoulli("logit", num_gh=7),
               "PolyaGammaLogit": lambda: ps.PolyaGammaLogit(num_gh=5),
               "RobustMax": lambda: ps.RobustMax(4, epsilon=0.01, num_gh=9),
               "Softmax": lambda: ps.Softmax(3, num_samples=17)}


@pytest.mark.parametrize("kind", list(LIKELIHOODS))
def test_every_likelihoods_settings_come_back(kind):
    lik = LIKELIHOODS[kind]()
    gp = ps.SVGP(Matern32(2, lengthscale=torch.tensor([0.7, 1.3]), active_dims=[1, 3]), torch.randn(5, 4), lik,
                 num_outputs=getattr(lik, "num_classes", None), whiten=False, jitter=1e-5, name="one")
    copy = build(describe(gp), gp.state_dict())
    assert type(copy.likelihood) is type(lik) and _settings(copy) == _settings(gp)
    assert all(torch.equal(v, copy.state_dict()[k]) for k, v in gp.state_dict().items())


def test_conv_and_sum_kernels_come_back():
    """A weighted conv + RBF sum (``InducingSum`` of patches and images) with non-default normalisation and colour
    handling, and a Pyro ``Sum`` kernel: same settings, same predictions (deterministic for an SVGP)."""
    conv = ps.ConvKernel(RBF(9), (6, 6, 2), 3, 1, weighted=True, normalisation="sum", colour="channels")
    k = ps.SumKernel(conv, Sum(RBF(72), WhiteNoise(72, variance=torch.tensor(0.01))))
    Z = ps.InducingSum(ps.InducingPatches(torch.randn(4, 9)), torch.randn(3, 72))
    gp = ps.SVGP(k, Z, ps.RobustMax(3), name="sum")
    with torch.no_grad():
        conv.weights = torch.rand(32) + 0.5
    copy = build(describe(gp), gp.state_dict())
    assert _settings(copy) == _settings(gp)
    X = torch.randn(5, 72)
    torch.testing.assert_close(copy.predict(X), gp.predict(X), rtol=0, atol=0)


def test_single_layer_models_come_back_too():
    """The layout is not the deep models' alone: an SVGP with inducing patches of a TICK kernel and an ODVGP (which
    takes its inducing points as tensors) rebuild with the same settings and predict the same."""
    tick = ps.TICK(RBF(4), (5, 5, 1), 2, 1, location_lengthscale=2.0)
    gp = ps.SVGP(tick, ps.IndexedInducingPatches(torch.randn(3, 4), grid=tick.grid), ps.Gaussian(0.2), name="tick")
    od = ps.ODVGP(RBF(2), torch.randn(4, 2), torch.randn(9, 2), ps.Gaussian(0.2), num_subsample=5, name="od")
    with torch.no_grad():
        od.a = torch.randn(9)
    for model, X in ((gp, torch.rand(6, 25)), (od, torch.randn(6, 2))):
        copy = build(describe(model), model.state_dict())
        assert type(copy) is type(model) and _settings(copy) == _settings(model)
        torch.testing.assert_close(copy.predict(X), model.predict(X), rtol=0, atol=0)


@pytest.fixture
def saved(tmp_path):
    X = torch.randn(30, 3)
    dgp = build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=5)
    path = tmp_path / "dgp.pt"
    dgp.save(path)
    return path


def _rewrite(path, edit):
    payload = torch.load(path)
    edit(payload)
    torch.save(payload, path)


def test_corrupted_files_raise_naming_the_file(saved, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(LayoutError, match=r"junk\.pt' is not a model file"):
        ps.saving.load(junk)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    with pytest.raises(LayoutError, match=r"cut\.pt' is not a model file"):
        ps.saving.load(cut)
    plain = tmp_path / "plain.pt"
    torch.save(ps.saving.load(saved).state_dict(), plain)
    with pytest.raises(LayoutError, match=r"plain\.pt' is no file of .*a state_dict without its layout"):
        ps.DeepGP.load(plain)


def test_mismatched_files_raise_naming_the_mismatch(saved):
    key = "layers.1.inducing.Z_unconstrained"
    _rewrite(saved, lambda p: p["state_dict"].__setitem__(key, torch.zeros(6, 2)))
    with pytest.raises(LayoutError, match=rf"dgp\.pt'.*{key}: \(6, 2\) in the file, \(5, 2\) in the layout"):
        ps.saving.load(saved)
    _rewrite(saved, lambda p: p["state_dict"].pop(key))
    with pytest.raises(LayoutError, match=rf"dgp\.pt'.*missing entries \['{key}'\]"):
        ps.saving.load(saved)
    _rewrite(saved, lambda p: p["config"].__setitem__("class", "subprocess.Popen"))
    with pytest.raises(LayoutError, match=r"dgp\.pt'.*'subprocess\.Popen', which load builds only if you pass it"):
        ps.saving.load(saved)
    _rewrite(saved, lambda p: p["config"].__setitem__("class", "pyro_sparsegp.NoSuchModel"))
    with pytest.raises(LayoutError, match="'pyro_sparsegp.NoSuchModel', which this version does not have"):
        ps.saving.load(saved)
    _rewrite(saved, lambda p: p.__setitem__("version", 99))
    with pytest.raises(LayoutError, match=r"dgp\.pt' has format version 99"):
        ps.saving.load(saved)


def test_a_model_of_another_class_and_an_unsavable_layout_raise(saved, tmp_path):
    with pytest.raises(TypeError, match=r"dgp\.pt' holds a DeepGP, not a DeepConvGP"):
        ps.DeepConvGP.load(saved)
    dgp = ps.DeepGP.load(saved)
    dgp.layers[0].kernel.variance = PyroSample(pyro.distributions.LogNormal(0.0, 1.0))
    with pytest.raises(LayoutError, match="variance of the RBF is a PyroSample"):
        dgp.save(tmp_path / "prior.pt")
    assert not (tmp_path / "prior.pt").exists()
