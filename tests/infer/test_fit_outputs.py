"""``fit`` with several outputs: missing outputs (``NaN``) counted nowhere (the noise's natural step, the exact
finish), an LMC layer that borrows strength across outputs to fill a missing block, and the data checks."""

import importlib

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer.training import exact_finish_

F32 = torch.get_default_dtype() == torch.float32


def _problem(N=40, seed_shift=0.0):
    X = torch.linspace(0, 10, N).unsqueeze(-1)
    g = torch.stack([torch.sin(X[:, 0] + seed_shift), torch.cos(1.3 * X[:, 0])])
    W = torch.tensor([[1.0, 0.5], [0.8, -0.6], [0.3, 1.0]])
    f = (W @ g).T  # [N, 3]
    y = f + 0.1 * torch.randn_like(f)
    return X, f, y


def test_the_noise_step_counts_the_observed_entries():
    X, _, y = _problem()
    y[3:9, 1] = float("nan")
    y[20, 0] = float("nan")
    gp = ps.SVGP(RBF(1), X[::5].clone(), ps.Gaussian(0.5), num_outputs=3)
    with torch.no_grad():
        mean, var = gp.predict(X)  # q(f) before the step
        obs = ~torch.isnan(y)
        target = (((y - mean) ** 2 + var)[obs].sum() / obs.sum()).item()  # the noise's optimum given q(f), S / n
    # one full-batch Fisher-scoring step of length 1 lands on S / n, with n the observed entries (not N L)
    ps.infer.fit(gp, X, y, num_steps=1, natgrad=ps.infer.NaturalPolicy(lr=1.0, warmup=0, finish=None), progress=False)
    assert gp.likelihood.noise.item() == pytest.approx(target, rel=1e-4 if F32 else 1e-9)


@pytest.mark.float64
def test_the_exact_finish_lands_on_the_optimum_of_the_masked_bound():
    X, _, y = _problem()
    y[3:9, 1] = float("nan")
    y[30:, 2] = float("nan")
    gp = ps.SVGP(RBF(1), X[::5].clone(), ps.Gaussian(0.5), num_outputs=3)
    exact_finish_(gp, [(X[:25], y[:25]), (X[25:], y[25:])])
    params = [gp.q_u.u_loc_unconstrained, gp.q_u.u_scale_tril_unconstrained, gp.likelihood.noise_unconstrained]
    grads = torch.autograd.grad(gp.analytic_elbo(X, y), params)
    assert max(g.abs().max().item() for g in grads) < 1e-6
    # the gradients are not small by accident: the bound with the missing entries filled in has its optimum elsewhere
    filled = torch.autograd.grad(gp.analytic_elbo(X, y.nan_to_num(0.0)), params)
    assert max(g.abs().max().item() for g in filled) > 1e-2


def test_lmc_fills_a_missing_block_from_the_other_outputs():
    X, f, y = _problem(N=60)
    block = (X[:, 0] > 3.5) & (X[:, 0] < 7)
    y[block, 0] = float("nan")  # output 0 unobserved over a third of the range; outputs 1 and 2 see the latents
    rmse = {}
    for name, kw in [("lmc", dict(num_latents=2)), ("independent", {})]:
        gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(1.0)), torch.linspace(0, 10, 15).unsqueeze(-1),
                     ps.Gaussian(0.1), num_outputs=3, **kw)
        ps.infer.fit(gp, X, y, num_steps=120, lr=0.05, progress=False)
        mean, _ = gp.predict(X[block])
        rmse[name] = (mean[:, 0] - f[block, 0]).pow(2).mean().sqrt().item()
    assert rmse["lmc"] < 0.6 * rmse["independent"], rmse


def test_fit_checks_the_rows_once():
    X, _, y = _problem()
    y[7] = float("nan")
    gp = ps.SVGP(RBF(1), X[::5].clone(), ps.Gaussian(0.5), num_outputs=3, num_latents=2)
    with pytest.raises(ValueError, match="y row 7 has no observed output"):
        ps.infer.fit(gp, X, y, num_steps=1, progress=False)
    one = ps.SVGP(RBF(1), X[::5].clone(), ps.Gaussian(0.5))
    with pytest.raises(ValueError, match="nothing can be masked"):
        ps.infer.fit(one, X, y[:, 0], num_steps=1, progress=False)
    y[7] = 0.0
    y[8, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        ps.infer.fit(gp, X, y, num_steps=1, progress=False)


@pytest.mark.float64
@pytest.mark.parametrize("num_latents", [None, 2], ids=["independent", "lmc"])
def test_the_deferred_fit_masks_as_the_immediate_fit(num_latents, monkeypatch):
    """On an accelerator ``fit`` reads nothing back inside a step (``pyro_sparsegp.context.deferred``), so the mask is
    formed on every minibatch, missing entries or not: the run equals the CPU's, which masks only where something is
    missing."""
    fit_module = importlib.import_module("pyro_sparsegp.infer.training.loop")
    X, _, y = _problem()
    y[3:9, 1] = float("nan")
    runs = []
    for defer in (False, True):
        monkeypatch.setattr(fit_module, "_DEFER_ON_CPU", defer)
        torch.manual_seed(1)
        gp = ps.SVGP(RBF(1), X[::5].clone(), ps.Gaussian(0.5), num_outputs=3, num_latents=num_latents)
        state = ps.infer.fit(gp, X, y, num_steps=8, batch_size=10, progress=False, sync_every=4)
        runs.append((torch.tensor(state.losses), [p.detach().clone() for p in gp.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-10, atol=1e-10)
    for a, b in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
