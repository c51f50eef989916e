"""Cost guards: one ELBO evaluation factorises Kuu once (the guide computes, the model reuses), with and without
plate subsampling, for the sampled-f and the integrated-f paths."""

from unittest import mock

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
