"""fit refuses bad arguments and bad checkpoints at entry, with messages that name the problem (and the file), before
any step is taken."""

import os

import numpy as np
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit, load_checkpoint


def _data(n=100):
    X = torch.rand(n, 1) * 6 - 3
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(n)


def _gp():
    return ps.SVGP(RBF(1), torch.linspace(-3, 3, 5).unsqueeze(-1), ps.Gaussian(0.5))


def _no_step(step, loss):
    raise AssertionError("fit took a step before refusing its arguments")


def _refuses(match, exc=ValueError, **kw):
    X, y = _data()
    kw = {"X": X, "y": y, "num_steps": 3, "progress": False, "callback": _no_step, **kw}
    gp = _gp()
    before = {k: v.clone() for k, v in gp.state_dict().items()}
    with pytest.raises(exc, match=match):
        fit(gp, **kw)
    for k, v in gp.state_dict().items():  # untouched
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1"])
def test_natgrad_lr_must_be_in_zero_one(value):
    _refuses("NaturalPolicy.lr must be a step length in \\(0, 1\\]", natgrad=value)


@pytest.mark.parametrize("value", [-1, 2.5, True, None])
def test_num_steps_must_be_a_non_negative_integer(value):
    _refuses("num_steps must be an integer >= 0", num_steps=value)


@pytest.mark.parametrize("value", [0, -3, 2.0, 64.5, False])
def test_batch_size_must_be_a_positive_integer(value):
    _refuses("batch_size must be an integer >= 1", batch_size=value)


@pytest.mark.parametrize("name,value", [("lr", 0.0), ("lr", -1.0), ("sync_every", 0)])
def test_other_numbers_are_checked(name, value):
    _refuses(name, **{name: value})


def test_data_is_converted_or_refused():
    X, y = _data()
    _refuses("X must be a torch.Tensor, a numpy array, a list of numbers or a pandas", TypeError, X="not data")
    _refuses("X must hold numbers", TypeError, X=np.array([["a"], ["b"]], dtype=object))
    _refuses("X must be \\[N, D\\]", X=X[:, 0])
    _refuses("different numbers of rows", y=y[:-1])
    _refuses("for 3 outputs build the layer with num_outputs=3", y=y.unsqueeze(-1).expand(-1, 3))
    _refuses("y contains NaN or inf", y=torch.cat([y[:-1], torch.tensor([float("nan")])]))
    _refuses("pass y=None", X=torch.utils.data.TensorDataset(X, y))  # fit(dataset, y)
    _refuses("needs y", y=None)
    # numpy float32 and integer lists are converted to the module's dtype
    gp = _gp()
    fit(gp, X.cpu().numpy().astype(np.float32), y.tolist(), num_steps=2, progress=False)
    assert all(torch.isfinite(v).all() for v in gp.state_dict().values())


def test_a_hyperprior_is_refused_by_the_closed_form_bound_naming_the_way_to_train_it():
    """A PyroSample hyperparameter has no value for fit's closed-form bound: refused at entry, naming the attribute
    and SVI with a guide for it (not the prediction advice that a first call of the bound would give)."""
    import pyro.distributions as dist
    from pyro.nn import PyroSample

    X, y = _data()
    k = RBF(1)
    k.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    gp = ps.SVGP(k, torch.linspace(-3, 3, 5).unsqueeze(-1), ps.Gaussian(0.5))
    with pytest.raises(ValueError, match="RBF.lengthscale is a PyroSample.*SVI and a guide for it"):
        fit(gp, X, y, num_steps=3, progress=False, callback=_no_step)


def test_a_checkpoint_in_a_missing_folder_is_refused_at_entry(tmp_path):
    path = tmp_path / "no" / "such" / "ckpt.pt"
    _refuses("folder of checkpoint .*ckpt.pt.* does not exist", checkpoint=str(path))
    with pytest.raises(ValueError, match="Checkpoint.every needs a checkpoint path"):
        ps.infer.Checkpoint(None, every=5)
    with pytest.raises(ValueError, match="Checkpoint.every must be an integer >= 0"):
        ps.infer.Checkpoint("c.pt", every=-1)


def _checkpoint(tmp_path, **kw):
    X, y = _data()
    path = tmp_path / "good.pt"
    fit(_gp(), X, y, num_steps=4, batch_size=16, progress=False, checkpoint=str(path), **kw)
    return path


def test_bad_checkpoint_files_are_refused_naming_the_file(tmp_path):
    good = _checkpoint(tmp_path)
    raw = good.read_bytes()
    cases = {
        "missing.pt": None,
        "empty.pt": b"",
        "truncated.pt": raw[: len(raw) // 2],
        "garbage.pt": os.urandom(256),
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        _refuses(f"checkpoint .*{name}", checkpoint=ps.infer.Checkpoint(None, resume=str(path)), batch_size=16)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": torch.zeros(3)}, foreign)
    _refuses("foreign.pt.* was not written by pyro_sparsegp", checkpoint=ps.infer.Checkpoint(None, resume=str(foreign)),
             batch_size=16)
    pickled = tmp_path / "pickled.pt"
    torch.save({"obj": _gp()}, pickled)  # arbitrary objects: never unpickled
    _refuses("pickled.pt.* not a readable torch file", checkpoint=ps.infer.Checkpoint(None, resume=str(pickled)),
             batch_size=16)
    other = ps.SVGP(RBF(1), torch.zeros(7, 1), ps.Gaussian())  # another layout (M = 7)
    with pytest.raises(ValueError, match="good.pt.* another module layout"):
        load_checkpoint(str(good), other)


def test_resuming_with_another_batch_size_or_seed_is_refused(tmp_path):
    good = _checkpoint(tmp_path)
    _refuses("good.pt.* batch_size=16; this run has batch_size=32",
             checkpoint=ps.infer.Checkpoint(None, resume=str(good)), batch_size=32, num_steps=10)
    _refuses("good.pt.* seed=0; this run has seed=1", checkpoint=ps.infer.Checkpoint(None, resume=str(good)),
             batch_size=16, seed=1, num_steps=10)
    _refuses("good.pt.* is at step 4, beyond num_steps=3", checkpoint=ps.infer.Checkpoint(None, resume=str(good)),
             batch_size=16, num_steps=3)
    # written with natural gradients on q(u) ("auto"); Adam alone would train q(u) too: refused before any load
    _refuses("good.pt.* Adam trained other parameters.*natgrad kind",
             checkpoint=ps.infer.Checkpoint(None, resume=str(good)), batch_size=16, num_steps=10, natgrad=None)


def test_a_resumed_run_takes_this_calls_learning_rate(tmp_path):
    """Adam's moments come from the checkpoint, its learning rate from the call: the same lr continues the run
    exactly, another one continues it at that rate."""
    good = _checkpoint(tmp_path)
    X, y = _data()
    ends = {}
    for lr in (0.01, 0.01, 0.3):
        gp = _gp()
        fit(gp, X, y, num_steps=8, batch_size=16, lr=lr, progress=False, checkpoint=ps.infer.Checkpoint(None,
                                                                                                        resume=str(good)))
        ends.setdefault(lr, []).append(gp.kernel.lengthscale.detach().clone())
    assert torch.equal(ends[0.01][0], ends[0.01][1])
    assert not torch.allclose(ends[0.01][0], ends[0.3][0])
