"""Properties of the SVGP layer's program (``pyro_sparsegp.layers.svgp``, ``layers.base``, ``layers.outputs``;
Hensman, Matthews, Ghahramani 2015, eqs. 18-21): an unwhitened layer starts at ``q(u) = p(u)`` (KL zero, against a
dense Cholesky of ``Kuu``) unless the kernel's hyperparameters are sampled; the guide's ``f`` and likelihood sites
live on the plate's minibatch (``subsample_size``), with the missing outputs of that minibatch masked; the
hyperparameter sites are drawn outside the data plate; bad targets raise; a layer without likelihood has a single
output; ``Z``/``X`` given as arrays or lists equal the tensor versions; batched inputs ``[S, N, D]`` predict what each
slice predicts (with a per-output mean function)."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.inducing import InducingPoints
from pyro_sparsegp.layers.base import qf_points
from pyro_sparsegp.mean_functions import Linear


def _kernel():
    return RBF(1, lengthscale=torch.tensor(0.8), variance=torch.tensor(1.3))


def _Z(M=5):
    return torch.linspace(-2, 2, M).unsqueeze(-1)


def test_an_unwhitened_layer_starts_at_the_prior():
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1), whiten=False)
    Z = _Z().squeeze(-1)
    Kuu = 1.3 * torch.exp(-0.5 * (Z[:, None] - Z[None, :]) ** 2 / 0.8**2)  # dense, independent of the library
    S = gp.q_u.u_scale_tril.detach() @ gp.q_u.u_scale_tril.detach().mT
    torch.testing.assert_close(S, Kuu, rtol=1e-4, atol=1e-4)  # only the jitter differs
    assert float(gp.kl_divergence().detach()) == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("whiten", [False, True])
def test_a_sampled_kernel_starts_at_the_identity_and_its_sites_are_outside_the_data_plate(whiten):
    k = _kernel()
    k.lengthscale = PyroSample(dist.LogNormal(torch.tensor(0.0), 0.3))
    gp = ps.SVGP(k, _Z(), ps.Gaussian(0.1), whiten=whiten)  # theta is a site: no Kuu to start from
    torch.testing.assert_close(gp.q_u.u_scale_tril.detach(), torch.eye(5))
    X, y = torch.randn(12, 1), torch.randn(12)
    tr = pyro.poutine.trace(gp.model).get_trace(X, y, subsample_size=4)
    names = [n for n in tr.nodes if n.endswith("lengthscale")]
    assert len(names) == 1
    site = tr.nodes[names[0]]
    assert site["value"].shape == ()  # one draw, the prior's shape
    assert all(f.name != f"{gp.name}.data" for f in site["cond_indep_stack"])


def test_the_guide_draws_f_on_the_minibatch_of_the_plate():
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1))
    X, y = torch.randn(20, 1), torch.randn(20)
    for yy in (y, None):
        tr = pyro.poutine.trace(gp.guide).get_trace(X, yy, subsample_size=6)
        idx = tr.nodes[f"{gp.name}.data"]["value"]
        f = tr.nodes[f"{gp.name}.f"]
        assert f["value"].shape == (6,)
        loc, var = gp.qf(X[idx])  # q(f) at the minibatch: f ~ p(f | u), u ~ q(u)
        assert f["fn"].loc.shape == (6,)
        u = tr.nodes[f"{gp.name}.u"]["value"]
        torch.testing.assert_close(f["fn"].loc, gp.conditional(X[idx], u).loc)
        assert loc.shape == (6,)


def test_the_guide_masks_the_missing_outputs_of_its_minibatch():
    torch.manual_seed(1)
    gp = ps.SVGP(_kernel(), _Z(), ps.PolyaGammaLogit(), num_outputs=2)
    X = torch.randn(30, 1)
    y = (torch.rand(30, 2) < 0.5).double().to(X.dtype)
    y[::3, 0] = float("nan")
    y[1::3, 1] = float("nan")
    for kwargs in ({"subsample_size": 7}, {}):
        tr = pyro.poutine.trace(gp.guide).get_trace(X, y, **kwargs)
        tr.compute_log_prob()
        idx = tr.nodes[f"{gp.name}.data"]["value"]
        omega = tr.nodes[f"{gp.name}.omega"]
        assert {f.name for f in omega["cond_indep_stack"]} == {f"{gp.name}.outputs", f"{gp.name}.data"}
        assert omega["value"].shape == (2, len(idx))
        observed = ~torch.isnan(y[idx]).mT  # [L, B]
        torch.testing.assert_close(omega["mask"].expand(2, len(idx)), observed)


def test_a_nan_in_a_single_output_target_is_refused():
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1))
    X, y = torch.randn(8, 1), torch.randn(8)
    y[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gp.model(X, y)
    with pytest.raises(ValueError, match="NaN"):
        gp.guide(X, y)
    gpb = ps.SVGP(_kernel(), _Z(), ps.Bernoulli())
    with pytest.raises(ValueError):
        gpb.model(X, torch.full((8,), 2.0))  # not a label in {0, 1}


def test_a_layer_without_likelihood_has_one_output():
    gp = ps.SVGP(_kernel(), _Z())
    assert gp.num_outputs is None
    mean, var = gp.predict(torch.randn(4, 1))
    assert mean.shape == var.shape == (4,)
    X, y = torch.randn(6, 1), torch.randn(6)
    tr = pyro.poutine.trace(gp.model).get_trace(X, y)  # nothing observes y: it is ignored
    assert not any(n.get("is_observed") for n in tr.nodes.values() if n["type"] == "sample")


@pytest.mark.parametrize("num_outputs", [None, 2], ids=["single", "two_outputs"])
def test_inputs_whose_leading_dimension_no_plate_owns_are_refused(num_outputs):
    """``X`` ``[3, (1,) N, D]`` in a program without a plate for the 3: ``f``'s site names the dimension."""
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1), num_outputs=num_outputs)
    X = torch.randn(3, 6, 1) if num_outputs is None else torch.randn(3, 1, 6, 1)
    with pytest.raises(ValueError, match="belongs to no plate"):
        pyro.poutine.trace(gp.guide).get_trace(X, None)


def test_arrays_and_lists_equal_tensors():
    Z = _Z()
    a = ps.SVGP(_kernel(), Z, ps.Gaussian(0.1), name="a")
    b = ps.SVGP(_kernel(), Z.tolist(), ps.Gaussian(0.1), name="b")
    c = ps.SVGP(_kernel(), np.asarray(Z.tolist()), ps.Gaussian(0.1), name="c")
    X = torch.randn(6, 1)
    for other in (b, c):
        assert torch.is_tensor(other.Z) and other.Z.dtype == Z.dtype
        torch.testing.assert_close(other.Z, Z)
        torch.testing.assert_close(other.predict(X)[0], a.predict(X)[0])
    d = ps.SVGP(_kernel(), InducingPoints(Z.clone()), ps.Gaussian(0.1), name="d")  # inducing variables as given
    torch.testing.assert_close(d.predict(X)[0], a.predict(X)[0])
    for Xa in (np.asarray(X.tolist()), X.tolist()):
        plate = a.create_plates(Xa)
        assert plate.size == 6
        with plate as idx:
            assert len(idx) == 6


@pytest.mark.parametrize("as_array", [list, np.asarray], ids=["list", "numpy"])
def test_bad_inducing_inputs_given_as_arrays_are_refused_by_name(as_array):
    with pytest.raises(ValueError, match="at least one"):
        ps.SVGP(_kernel(), as_array([[], []]), ps.Gaussian(0.1))  # two inducing inputs of no feature
    with pytest.raises(ValueError, match="input_dim"):
        ps.SVGP(RBF(2), as_array([[0.0], [1.0]]), ps.Gaussian(0.1))  # 1 feature, the kernel reads 2


def test_inputs_with_the_wrong_number_of_features_are_refused_by_name():
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1))
    for X in (torch.randn(6, 2), torch.randn(3, 6, 2)):
        with pytest.raises(ValueError, match="D = 1"):
            gp.predict(X)


@pytest.mark.parametrize("num_outputs", [None, 2], ids=["single", "two_outputs"])
def test_batched_inputs_predict_what_each_slice_predicts(num_outputs):
    torch.manual_seed(2)
    L = num_outputs or 1
    mf = Linear(1, L, A=torch.tensor([[0.5, -1.5]])[:, :L], b=torch.tensor([0.3, -0.2])[:L])  # per-output means
    gp = ps.SVGP(_kernel(), _Z(), ps.Gaussian(0.1), num_outputs=num_outputs, mean_function=mf)
    batch = () if num_outputs is None else (2,)
    with torch.no_grad():
        gp.q_u.set(torch.randn(batch + (5,)), 0.4 * torch.eye(5).expand(batch + (5, 5)).clone())
    X = torch.randn(3, 4, 1)  # [S, N, D] with N != D and S not in {1, L}
    mean, var = gp.predict(X)
    shape = (3, 4) if num_outputs is None else (3, 4, 2)
    assert mean.shape == var.shape == shape
    for s in range(3):
        ms, vs = gp.predict(X[s])
        torch.testing.assert_close(mean[s], ms)
        torch.testing.assert_close(var[s], vs)
    mean2, var2 = gp.predict(X[0])
    assert mean2.shape == shape[1:]


def test_inducing_sets_per_output_need_as_many_outputs():
    """``Z`` ``[L, M, D]`` (one set per output) needs ``num_outputs = L``; inducing variables given as an object are
    checked against the kernel as a tensor ``Z`` is."""
    Z = _Z().expand(2, 5, 1).clone()
    with pytest.raises(ValueError, match="one set per output"):
        ps.SVGP(_kernel(), Z, ps.Gaussian(0.1))
    with pytest.raises(ValueError, match="one set per output"):
        ps.SVGP(_kernel(), Z, ps.Gaussian(0.1), num_outputs=3)
    gp = ps.SVGP(_kernel(), Z, ps.Gaussian(0.1), num_outputs=2)
    assert gp.predict(torch.randn(3, 1))[0].shape == (3, 2)
    with pytest.raises(ValueError, match="features"):
        ps.SVGP(RBF(2), InducingPoints(_Z()), ps.Gaussian(0.1))  # 1 feature, the kernel reads 2


@pytest.mark.parametrize("num_outputs", [None, 2], ids=["single", "two_outputs"])
def test_marginals_of_sample_batched_points_are_the_layer_s_marginals(num_outputs):
    """``qf_points`` (flattening ``[..., 1, B, D]`` into one projection) gives ``layer.qf(X)``'s values and shapes for
    every input layout, with ``X``'s dim -3 a singleton or one row per output."""
    torch.manual_seed(4)
    k = RBF(2, lengthscale=torch.tensor(0.9))
    gp = ps.SVGP(k, torch.randn(5, 2), ps.Gaussian(0.1), num_outputs=num_outputs)
    batch = () if num_outputs is None else (2,)
    with torch.no_grad():
        gp.q_u.set(torch.randn(batch + (5,)), 0.5 * torch.eye(5).expand(batch + (5, 5)).clone())
    shapes = [(4, 2), (1, 4, 2), (6, 1, 4, 2), (2, 6, 1, 4, 2)]
    if num_outputs is not None:
        shapes += [(2, 4, 2), (6, 2, 4, 2)]
    for shape in shapes:
        X = torch.randn(shape)
        with torch.no_grad():
            got, ref = qf_points(gp, X), gp.qf(X)
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)
