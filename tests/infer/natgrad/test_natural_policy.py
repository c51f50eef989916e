"""The natural-gradient and finish policy shared by ``fit`` and ``NaturalGradient`` (issue 52): one
:class:`~pyro_sparsegp.infer.NaturalPolicy`, its shorthands, its checks; ``fit``'s signature, its data in ``X`` and
its :class:`~pyro_sparsegp.infer.Checkpoint`."""

import inspect

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from torch.utils.data import DataLoader, TensorDataset

import pyro_sparsegp as ps
from pyro_sparsegp.infer import Checkpoint, NaturalGradient, NaturalPolicy, fit
from pyro_sparsegp.infer.natgrad.natural_policy import as_policy


def _data(N=120):
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    X = torch.rand(N, 1, generator=g).to(torch.get_default_dtype()) * 6 - 3
    return X, torch.sin(X[:, 0]) + 0.1 * torch.randn(N, generator=g).to(X.dtype)


def _gp():
    torch.manual_seed(0)
    return ps.SVGP(RBF(1), torch.linspace(-3, 3, 8).unsqueeze(-1), ps.Gaussian(0.5))


def test_fit_has_at_most_14_parameters():
    assert len(inspect.signature(fit).parameters) <= 14


def test_shorthands_equal_the_object():
    assert as_policy(0.3) == NaturalPolicy(lr=0.3)
    assert as_policy(None) == NaturalPolicy(lr=None)
    assert as_policy("auto") == NaturalPolicy()
    policy = NaturalPolicy(lr=0.2, cooldown=None)
    assert as_policy(policy) is policy


@pytest.mark.parametrize("field,value", [("lr", 1.5), ("lr", 0.0), ("lr", True), ("warmup", -1), ("warmup", 2.5),
                                         ("retraction", "yes"), ("layers", "first"), ("hidden_start", -2),
                                         ("average", 1.5), ("average", 0.0), ("cooldown", 2.0), ("finish", "yes"),
                                         ("cooldown", "0.5"), ("average", "0.5")])  # a number's text is no fraction
def test_a_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=f"NaturalPolicy.{field} must be"):
        NaturalPolicy(**{field: value})


def test_fit_and_natural_gradient_accept_the_same_policy_and_the_shorthand_is_the_same_run():
    X, y = _data()
    policy = NaturalPolicy(lr=0.2, warmup=2, retraction=True, cooldown=0.5)
    a, b = _gp(), _gp()
    fit(a, X, y, num_steps=6, batch_size=40, natgrad=policy, progress=False)
    fit(b, X, y, num_steps=6, batch_size=40, natgrad=NaturalPolicy(lr=0.2, warmup=2, retraction=True, cooldown=0.5),
        progress=False)
    for u, v in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(u, v)
    c, d = _gp(), _gp()
    fit(c, X, y, num_steps=6, batch_size=40, natgrad=0.2, progress=False)
    fit(d, X, y, num_steps=6, batch_size=40, natgrad=NaturalPolicy(lr=0.2), progress=False)
    for u, v in zip(c.state_dict().values(), d.state_dict().values(), strict=True):
        assert torch.equal(u, v)
    opt = NaturalGradient(pyro.optim.Adam({"lr": 0.01}), policy, num_steps=10)
    assert opt.natgrad_lr == 0.2 and opt.schedule.start == 5 and opt.retraction is True
    assert "NaturalPolicy(lr=0.2" in repr(opt)


def test_natural_gradient_resolves_auto_and_refuses_fits_fields():
    adam = pyro.optim.Adam({"lr": 0.01})
    plain = NaturalGradient(adam)
    assert plain.natgrad_lr == 0.1 and plain.retraction is True and plain.cooldown is None
    assert plain.average_from is None and repr(plain) == "NaturalGradient(Adam, natgrad=0.1)"
    assert NaturalGradient(adam, num_steps=100).cooldown.start == 50  # "auto": half of num_steps
    assert NaturalGradient(adam, NaturalPolicy(average=0.1), num_steps=100).average_from == 90
    for field, value in (("finish", "exact"), ("layers", "all"), ("hidden_start", 3)):
        with pytest.raises(ValueError, match=f"NaturalPolicy.{field}=.* is fit's"):
            NaturalGradient(adam, NaturalPolicy(**{field: value}))
    with pytest.raises(ValueError, match="needs a step length"):
        NaturalGradient(adam, None)
    with pytest.raises(ValueError, match="average.*num_steps"):
        NaturalGradient(adam, NaturalPolicy(average=0.1))
    with pytest.raises(ValueError, match="cooldown.*num_steps"):
        NaturalGradient(adam, NaturalPolicy(cooldown=0.3))


def test_fit_takes_a_loader_a_dataset_or_tensors_as_X():
    X, y = _data()
    runs = {}
    for name, args in (("tensors", (X, y)), ("dataset", (TensorDataset(X, y),)),
                       ("loader", (DataLoader(TensorDataset(X, y), batch_size=40),))):
        gp = _gp()
        extra = dict(num_data=len(X)) if name == "loader" else dict(batch_size=40)
        runs[name] = fit(gp, *args, num_steps=4, seed=1, progress=False, **extra)
        assert len(runs[name].losses) == 4
    assert runs["tensors"].losses == runs["dataset"].losses  # the same batches, by tensor indexing
    with pytest.raises(ValueError, match="pass y=None"):
        fit(_gp(), TensorDataset(X, y), y, num_steps=1, progress=False)
    with pytest.raises(ValueError, match="pass y=None"):
        fit(_gp(), DataLoader(TensorDataset(X, y)), y, num_data=len(X), num_steps=1, progress=False)


def test_a_checkpoint_object_resumes_a_run_identically(tmp_path):
    X, y = _data()
    kw = dict(batch_size=40, seed=2, progress=False, natgrad=NaturalPolicy(lr=0.3, finish=None))
    whole = _gp()
    fit(whole, X, y, num_steps=10, **kw)
    path = tmp_path / "c.pt"
    fit(_gp(), X, y, num_steps=4, checkpoint=Checkpoint(path, every=2), **kw)
    resumed = _gp()
    state = fit(resumed, X, y, num_steps=10, checkpoint=Checkpoint(path, every=2, resume=True), **kw)
    assert state.step == 10
    for u, v in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(u, v)
    with pytest.raises(ValueError, match="Checkpoint.resume"):
        Checkpoint(None, resume=True)
    with pytest.raises(ValueError, match="checkpoint must be a file path"):
        fit(_gp(), X, y, num_steps=1, checkpoint=3, progress=False)
