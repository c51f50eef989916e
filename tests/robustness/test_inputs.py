"""One input-conversion path (issue 27): tensors, numpy arrays, lists and pandas-like objects give the same results
at every entry point; ``y`` as ``[N, 1]`` is a single output; errors name N, M, D, K as the user knows them; a cast
that loses most of the data's digits warns; a multi-class likelihood sets ``num_outputs``."""

import math
import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.checks import InputPrecisionWarning
from pyro_sparsegp.checks.inputs import as_tensor, digits_kept


class FrameLike:
    """Stands in for a pandas DataFrame / Series: anything with ``to_numpy()``."""

    def __init__(self, arr):
        self.arr = arr

    def to_numpy(self):
        return self.arr


def _data(N=60, D=2, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    X = torch.randn(N, D, generator=g)
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(N, generator=g)
    return X, y


def _gp(X, **kw):
    return ps.SVGP(RBF(X.shape[1]), X[:8].clone(), ps.Gaussian(0.1), **kw)


CONVERTERS = {
    "numpy": lambda t: t.cpu().numpy(),
    "list": lambda t: t.tolist(),
    "frame": lambda t: FrameLike(t.cpu().numpy()),
    "float32-tensor": lambda t: t.float() if t.dtype == torch.float64 else t.double(),
}


@pytest.mark.parametrize("kind", list(CONVERTERS))
def test_every_entry_point_takes_the_same_data_in_any_container(kind):
    X, y = _data()
    conv = CONVERTERS[kind]
    gp = _gp(X)
    ref = gp.analytic_elbo(X, y)
    if kind == "float32-tensor" and X.dtype == torch.float64:  # the cast rounds the data to float32
        Xr, yr = X.float().double(), y.float().double()
        ref = gp.analytic_elbo(Xr, yr)
    torch.testing.assert_close(gp.analytic_elbo(conv(X), conv(y)), ref)
    m_ref, v_ref = gp.predict(X if kind != "float32-tensor" else X.float().to(X.dtype))
    m, v = gp.predict(conv(X))
    torch.testing.assert_close(m, m_ref)
    torch.testing.assert_close(v, v_ref)
    # model / guide under Pyro's ELBO, and fit
    loss = pyro.infer.Trace_ELBO().differentiable_loss(gp.model, gp.guide, conv(X), conv(y))
    assert torch.isfinite(loss)
    state = ps.infer.fit(gp, conv(X), conv(y), num_steps=3, batch_size=20, progress=False)
    assert len(state.losses) == 3


def test_single_output_as_a_column_is_the_same_as_a_vector():
    X, y = _data()
    gp = _gp(X)
    torch.testing.assert_close(gp.analytic_elbo(X, y[:, None]), gp.analytic_elbo(X, y))
    torch.testing.assert_close(gp.analytic_elbo(X.cpu().numpy(), y[:, None].cpu().numpy()), gp.analytic_elbo(X, y))
    a = ps.infer.fit(_gp(X, name="a"), X, y[:, None].cpu().numpy(), num_steps=4, batch_size=16, progress=False).losses
    b = ps.infer.fit(_gp(X, name="b"), X, y, num_steps=4, batch_size=16, progress=False).losses
    assert a == pytest.approx(b, rel=1e-6)


def test_wrong_targets_name_the_whole_data_size_not_the_minibatch():
    X, y = _data(N=300)
    gp = _gp(X)
    with pytest.raises(ValueError, match=r"y must be \[N\] = \[300\]"):
        ps.infer.fit(gp, X, torch.zeros(300, 3), num_steps=2, batch_size=100, progress=False)
    multi = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), num_outputs=2, name="multi")
    with pytest.raises(ValueError, match=r"y must be \[N, L\] = \[300, 2\]"):
        ps.infer.fit(multi, X, torch.zeros(300, 3), num_steps=2, batch_size=100, progress=False)
    with pytest.raises(ValueError, match=r"X must be \[N, D\] with D = 2 features"):
        gp.predict(np.zeros((5, 3)))


def test_numpy_inducing_inputs_and_shape_errors_that_name_M_and_D():
    X, y = _data()
    gp = ps.SVGP(RBF(2), X[:8].cpu().numpy(), ps.Gaussian(0.1))
    assert isinstance(gp.Z, torch.Tensor) and gp.Z.dtype == torch.get_default_dtype() and gp.Z.shape == (8, 2)
    torch.testing.assert_close(gp.analytic_elbo(X, y), _gp(X, name="t").analytic_elbo(X, y))
    with pytest.raises(ValueError, match=r"Z must be \[M, D\] \(M inducing inputs of D features\)"):
        ps.SVGP(RBF(2), np.zeros(8), ps.Gaussian(0.1), name="bad")


def test_multiclass_likelihood_infers_num_outputs_and_refuses_a_mismatch():
    X, _ = _data()
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(3))
    assert gp.num_outputs == 3
    explicit = ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(3), num_outputs=3, name="explicit")
    explicit.load_state_dict(gp.state_dict())
    torch.testing.assert_close(gp.analytic_elbo(X, y), explicit.analytic_elbo(X, y))
    probs = gp.predict(X.cpu().numpy(), full=True)[2].probs
    assert probs.shape == (60, 3)
    with pytest.raises(ValueError, match=r"K = 3 classes.*num_outputs = 3.*got num_outputs = 2"):
        ps.SVGP(RBF(2), X[:8].clone(), ps.RobustMax(3), num_outputs=2, name="mismatch")


def test_fit_ep_takes_numpy_and_column_labels():
    X, _ = _data(N=40)
    y = (X[:, 0] > 0).long()
    a = ps.SVGP(RBF(2), X[:6].clone(), ps.RobustMax(2), name="a")
    b = ps.SVGP(RBF(2), X[:6].clone(), ps.RobustMax(2), name="b")
    sa = ps.infer.fit_ep(a, X, y, num_iters=3, learn_hyperparameters=False)
    sb = ps.infer.fit_ep(b, X.cpu().numpy(), y[:, None].cpu().numpy(), num_iters=3, learn_hyperparameters=False)
    assert sa.log_evidence == pytest.approx(sb.log_evidence, rel=1e-8)
    torch.testing.assert_close(a.predict(X)[0], b.predict(X)[0])


def test_digits_kept_against_a_hand_count():
    x = torch.tensor([[1.7e9], [1.7e9 + 3600.0]], dtype=torch.float64)  # an hour of Unix seconds
    before, after = digits_kept(x, torch.float32)
    ratio = (1.7e9 + 3600.0) / 3600.0
    assert before == pytest.approx(-math.log10(torch.finfo(torch.float32).eps))  # capped at float32's digits
    assert after == pytest.approx(-math.log10(torch.finfo(torch.float32).eps * ratio))
    assert after < before / 2
    z = torch.randn(100, 3, dtype=torch.float64)
    before, after = digits_kept(z, torch.float32)
    assert after >= before - 1.5  # standardised data keep (almost) all that float32 holds


def test_cast_to_float32_warns_only_when_it_destroys_the_data():
    t = 1.7e9 + torch.linspace(0, 3600, 50, dtype=torch.float64)[:, None]
    with pytest.warns(InputPrecisionWarning, match="keeps .* of its .* significant digits"):
        out = as_tensor(t, "X_unix", torch.float32)
    assert out.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        as_tensor(torch.randn(50, 2, dtype=torch.float64), "X_std", torch.float32)  # standardised: silent
        as_tensor(t, "X_unix64", torch.float64)  # no cast: silent here


def test_inputs_that_are_not_numbers_say_how_to_convert():
    with pytest.raises(TypeError, match="numpy array, a list of numbers or a pandas DataFrame"):
        as_tensor({"a": 1}, "X")
    with pytest.raises(TypeError, match="must hold numbers"):
        as_tensor(np.array(["a", "b"]), "X")
    labels = as_tensor(np.array([0, 1, 2]), "y", torch.float64, floating=False)
    assert labels.dtype == torch.int64


def test_read_only_arrays_are_copied_without_a_torch_warning():
    """pandas' copy-on-write gives read-only arrays (``Series.to_numpy()`` of integer labels); torch warns when it
    wraps one, so the conversion copies it (and never writes to the caller's data)."""
    arr = np.arange(6, dtype=np.int64)
    arr.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = as_tensor(FrameLike(arr), "y", floating=False)
    assert t.tolist() == list(range(6)) and not np.shares_memory(t.cpu().numpy(), arr)


def test_labels_outside_the_support_are_named_with_the_fix():
    X = torch.randn(6, 2)
    gp = ps.SVGP(RBF(2), X[:3].clone(), ps.Bernoulli())
    with pytest.raises(ValueError, match=r"outside the support of Bernoulli .*: -1; binary labels are 0 and 1"):
        gp.analytic_elbo(X, torch.tensor([-1.0, 1, 1, -1, 1, 1]))


def test_numpy_data_follow_the_default_device_and_mixed_devices_are_named():
    """Under ``torch.set_default_device`` numpy inducing inputs land where the kernel is built, as ``torch.tensor``
    puts them (a GPU user's path; the ``meta`` device stands in for it on the CPU); a tensor ``Z`` on another device
    than the kernel's parameters (rows read from a memory-mapped file into host memory) or an ``O`` on another
    device than ``Z`` is refused with both devices named, instead of failing inside the first kernel product."""
    from pyro_sparsegp.checks.inputs import as_tensor

    Z = np.random.default_rng(0).normal(size=(5, 2))
    assert as_tensor(Z, "Z").device == torch.get_default_device()
    with torch.device("meta"):
        assert as_tensor(Z, "Z").device.type == "meta" and as_tensor(Z.tolist(), "Z").device.type == "meta"
        kernel = RBF(2)  # a module on meta (its checks read values, which meta tensors do not have, so none is built)
        assert all(p.device.type == "meta" for p in kernel.parameters())
        with pytest.raises(ValueError, match=r"Z is on cpu but the kernel's parameters are on meta"):
            ps.SVGP(kernel, torch.as_tensor(Z, device="cpu", dtype=torch.get_default_dtype()))
    assert as_tensor(torch.zeros(2, device="meta"), "x").device.type == "meta"  # a tensor stays where it is
    with pytest.raises(ValueError, match=r"O is on meta but Z on (cpu|cuda)"):
        ps.SOLVEGP(RBF(2), torch.zeros(3, 2), torch.zeros(2, 2, device="meta"), ps.Gaussian(0.1))
