"""Cost guards: one ELBO evaluation factorises Kuu once (the guide computes, the model reuses), with and without
plate subsampling, for the sampled-f and the integrated-f paths."""

from unittest import mock

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO

import pyro_sparsegp as ps


@pytest.mark.parametrize("integrate_f", [False, True], ids=["f_site", "integrated"])
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("subsample", [None, 16], ids=["full", "subsampled"])
@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO], ids=["Trace", "MeanField"])
def test_one_cholesky_per_elbo_evaluation(elbo, subsample, whiten, integrate_f):
    gp = ps.SVGP(RBF(2), torch.randn(7, 2), ps.Gaussian(), whiten=whiten, integrate_f=integrate_f)
    X, y = torch.randn(40, 2), torch.randn(40)
    real = torch.linalg.cholesky_ex
    with mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        loss = elbo().differentiable_loss(gp.model, gp.guide, X, y, subsample_size=subsample)
        loss.backward()
    sizes = [c.args[0].shape[-1] for c in chol.call_args_list]
    assert sizes == [7], sizes


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_hand_written_program_factorises_once(whiten):
    """A model/guide written by hand (README): ``X[i]`` is a new tensor in each program, and the model still takes
    what the guide computed for the same inputs."""
    gp = ps.SVGP(RBF(2), torch.randn(7, 2), whiten=whiten)
    X, y = torch.randn(40, 2), torch.randn(40)

    def model(X, y):
        u = gp.sample_u()
        with pyro.plate("data", len(X), subsample_size=16) as i:
            f = gp.sample_f(X[i], u)
            pyro.sample("y", ps.Gaussian(0.3).distribution(f), obs=y[i])

    def guide(X, y):
        u = gp.sample_u(guide=True)
        with pyro.plate("data", len(X), subsample_size=16) as i:
            gp.sample_f(X[i], u, guide=True)

    real = torch.linalg.cholesky_ex
    with mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        Trace_ELBO(max_plate_nesting=1).differentiable_loss(model, guide, X, y).backward()
    assert [c.args[0].shape[-1] for c in chol.call_args_list] == [7]


def test_other_inputs_are_never_served_from_the_cache():
    """The guide leaves p(f | u) at X for the model: a model asking at equal inputs (a new tensor) gets that very
    object; one asking at other inputs of the same shape computes its own."""
    gp = ps.SVGP(RBF(2), torch.randn(7, 2), whiten=True)
    X1, X2, u = torch.randn(9, 2), torch.randn(9, 2), torch.randn(7)
    fresh = gp.conditional(X2, u)
    first = gp.conditional(X1, u)  # the guide at X1 replaces the cache
    served = gp.conditional(X2.clone(), u, consume=True)  # the model at X2: not X1's
    assert served is not first
    torch.testing.assert_close(served.loc, fresh.loc)
    torch.testing.assert_close(served.scale, fresh.scale)
    first = gp.conditional(X1, u)
    assert gp.conditional(X1.clone(), u, consume=True) is first  # equal inputs: the guide's object
