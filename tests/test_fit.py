"""The training loop: it learns, guards non-finite losses, checkpoints and resumes identically."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from torch.utils.data import DataLoader, TensorDataset

import pyro_sparsegp as ps
from pyro_sparsegp.infer import NonFiniteLossError, fit


def _data(n=300):
    X = torch.rand(n, 1) * 6 - 3
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(n)
    return X, y


def _gp():
    return ps.SVGP(RBF(1), torch.linspace(-3, 3, 12).unsqueeze(-1), ps.Gaussian(0.5))


@pytest.mark.parametrize("natgrad_lr", [None, 0.5], ids=["adam", "natgrad"])
def test_fit_learns_a_function(natgrad_lr):
    X, y = _data()
    gp = _gp()
    state = fit(gp, X, y, num_steps=300, batch_size=64, lr=0.03, natgrad_lr=natgrad_lr, progress=False)
    assert len(state.losses) == 300 and state.step == 300
    mean, _ = gp.predict(X)
    rmse = (mean - torch.sin(2 * X[:, 0])).pow(2).mean().sqrt()
    assert rmse < 0.1
    assert gp.likelihood.noise < 0.05


def test_fit_accepts_a_dataloader_and_shows_progress(capsys):
    X, y = _data()
    gp = _gp()
    loader = DataLoader(TensorDataset(X, y), batch_size=50, shuffle=True)
    state = fit(gp, loader=loader, num_data=len(X), num_steps=20, progress=True)
    assert state.step == 20
    err = capsys.readouterr().err
    assert "fit" in err and "elbo=" in err


def test_non_finite_loss_stops_with_the_step_and_restores_the_last_finite_state():
    X, y = _data()
    gp = _gp()
    seen = {}

    def corrupt(step, loss):
        if step == 5:
            seen["before"] = {k: v.detach().clone() for k, v in gp.state_dict().items()}
            with torch.no_grad():
                gp.q_u.u_loc_unconstrained[0] = float("nan")

    with pytest.raises(NonFiniteLossError, match="step 5") as info:
        fit(gp, X, y, num_steps=50, batch_size=64, progress=False, callback=corrupt)
    assert info.value.step == 5
    for k, v in gp.state_dict().items():
        assert torch.isfinite(v).all(), k
    # restored to the parameters at which the step-4 loss was computed (before step 4's update)
    assert not torch.equal(gp.state_dict()["q_u.u_loc_unconstrained"], seen["before"]["q_u.u_loc_unconstrained"])


def test_checkpoint_resumes_identically(tmp_path):
    X, y = _data()
    straight = _gp()
    fit(straight, X, y, num_steps=30, batch_size=64, progress=False, seed=3)

    first = _gp()
    path = tmp_path / "ckpt.pt"
    fit(first, X, y, num_steps=13, batch_size=64, progress=False, seed=3, checkpoint=str(path))
    resumed = _gp()
    with torch.no_grad():  # start from a different state to show the checkpoint overrides it
        resumed.q_u.u_loc_unconstrained.add_(1.0)
    state = fit(resumed, X, y, num_steps=30, batch_size=64, progress=False, seed=3, resume=str(path))
    assert state.step == 30 and len(state.losses) == 30
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_fit_validates_arguments():
    X, y = _data()
    with pytest.raises(ValueError, match="different numbers of rows"):
        fit(_gp(), X, y[:-1], num_steps=1, progress=False)
    with pytest.raises(ValueError, match="num_data"):
        fit(_gp(), loader=DataLoader(TensorDataset(X, y)), num_steps=1, progress=False)
    solve = ps.SOLVEGP(RBF(1), torch.randn(3, 1), torch.randn(3, 1), ps.Gaussian())
    with pytest.raises(ValueError, match="SVGP's q\\(u\\) only"):
        fit(solve, X, y, num_steps=1, natgrad_lr=0.1, progress=False)
