"""Warnings that say where (issue #46, item 3): raised during a run, each names the layer (its ``name``) and, inside
``fit``, the step, and points at the user's line (``stacklevel``), not the library's."""

import warnings

import pyro
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp import linalg
from pyro_sparsegp.checks import InputPrecisionWarning
from pyro_sparsegp.context import reporting
from pyro_sparsegp.infer.natgrad import NatGradDampingWarning


def _caught(fn):
    linalg.reset_warnings()  # each warning is reported once per cause per process
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        fn()
    return ws


def test_location_and_stacklevel_of_a_warning_raised_in_a_layer_at_a_step():
    def raise_here():
        with reporting.in_layer("gp_7"), reporting.at_step(12):
            reporting.warn("something", UserWarning)

    (w,) = _caught(raise_here)
    assert str(w.message) == "something [layer 'gp_7', fit step 12]" and w.filename == __file__
    (w,) = _caught(lambda: reporting.warn("plain", UserWarning))
    assert str(w.message) == "plain"


def test_an_ill_conditioned_hidden_layer_of_a_deep_gp_is_named_with_the_step():
    """Two layers of the same size M: the warning names the one with duplicate inducing inputs (the issue's
    "three layers had M = 30"), fit's step, and the test's own line."""
    torch.manual_seed(0)
    X = torch.randn(40, 2)
    y = torch.sin(X[:, 0])
    Zdup = X[:6].clone()
    Zdup[3] = Zdup[1]  # a duplicate: un-whitened, the bound inverts a nearly singular Kuu
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hidden = ps.SVGP(RBF(2), Zdup, num_outputs=2, whiten=False, name="hidden_dup")
    out = ps.SVGP(RBF(2), X[10:16].clone(), ps.Gaussian(0.1), name="last")
    dgp = ps.DeepGP([hidden, out], num_samples=2)
    ws = _caught(lambda: ps.infer.fit(dgp, X, y, num_steps=3, batch_size=20, progress=False))
    ill = [w for w in ws if issubclass(w.category, linalg.IllConditionedWarning)]
    assert ill, [str(w.message) for w in ws]
    assert all("[layer 'hidden_dup', fit step 0]" in str(w.message) for w in ill), [str(w.message) for w in ill]
    assert all(w.filename == __file__ for w in ill), [w.filename for w in ill]


def test_a_float32_cast_in_fit_names_the_module():
    X = torch.linspace(0, 1, 50, dtype=torch.float64).unsqueeze(-1) + 1.7e9  # Unix seconds: float32 loses them
    y = torch.sin(torch.linspace(0, 6, 50, dtype=torch.float64))
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float32)
        gp = ps.SVGP(RBF(1), torch.linspace(0, 1, 5).unsqueeze(-1), ps.Gaussian(0.1), name="seconds")
        ws = _caught(lambda: ps.infer.fit(gp, X, y, num_steps=1, progress=False))
    cast = [w for w in ws if issubclass(w.category, InputPrecisionWarning)]
    assert cast and "[layer 'seconds']" in str(cast[0].message) and cast[0].filename == __file__, \
        [str(w.message) for w in ws]


def test_a_damped_natural_step_names_the_layer_and_the_step_in_fit_and_the_layer_under_svi():
    torch.manual_seed(0)
    X = torch.randn(60, 2)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(3), name="rm")
    ws = _caught(lambda: ps.infer.fit(gp, X, y, num_steps=15, natgrad=ps.infer.NaturalPolicy(
        lr=1.0, warmup=0, retraction=False, finish=None), progress=False))
    damped = [w for w in ws if issubclass(w.category, NatGradDampingWarning)]
    assert damped, "a length-1 plain step on robust-max was never damped: the test cannot see the message"
    assert "[layer 'rm', fit step " in str(damped[0].message) and damped[0].filename == __file__
    gp2 = ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(3), name="svi_layer")
    opt = ps.infer.NaturalGradient(pyro.optim.Adam({"lr": 0.01}), natgrad=ps.infer.NaturalPolicy(lr=1.0,
                                                                                                 retraction=False))
    svi = SVI(gp2.model, gp2.guide, opt, Trace_ELBO())
    ws = _caught(lambda: [svi.step(X, y) for _ in range(10)])
    damped = [w for w in ws if issubclass(w.category, NatGradDampingWarning)]
    assert damped, "ten length-1 plain steps on robust-max under SVI were never damped"
    assert "[layer 'svi_layer']" in str(damped[0].message) and damped[0].filename == __file__
