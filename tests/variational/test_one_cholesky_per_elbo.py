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


def _cholesky_sizes(elbo, model, guide, *args, **kwargs):
    real = torch.linalg.cholesky_ex
    with mock.patch("torch.linalg.cholesky_ex", side_effect=real) as chol:
        elbo.differentiable_loss(model, guide, *args, **kwargs).backward()
    return sorted(c.args[0].shape[-1] for c in chol.call_args_list)


def test_sum_kernel_layer_factorises_once():
    """A sum of a convolutional and an RBF GP (``SumKernel`` over ``InducingSum``): the joint Kuu of both parts
    (4 patches + 3 points) is factorised once per ELBO evaluation."""
    H = W = 5
    base = RBF(9, lengthscale=torch.tensor(2.0))
    k = ps.SumKernel(ps.ConvKernel(base, (H, W, 1), 3, 1), RBF(H * W, lengthscale=torch.tensor(3.0)))
    Z = ps.InducingSum(ps.InducingPatches(torch.randn(4, 9)), torch.randn(3, H * W))
    gp = ps.SVGP(k, Z, ps.Gaussian(0.3))
    X, y = torch.randn(12, H * W), torch.randn(12)
    assert _cholesky_sizes(Trace_ELBO(), gp.model, gp.guide, X, y) == [7]


@pytest.mark.parametrize("orthogonal", [0, 3], ids=["svgp_layers", "solvegp_layers"])
def test_deep_gp_factorises_each_layer_once(orthogonal):
    """A 3-layer DGP (M = 5 per layer; SOLVE-GP layers add an M2 = 3 factor each) under vectorised particles: one
    Cholesky of each layer's Kuu (and Cvv) per ELBO evaluation, not one per particle or per model/guide pass."""
    X, y = torch.randn(30, 3), torch.randn(30)
    dgp = ps.deep.build_deep_gp(X, [2, 2], ps.Gaussian(0.2), num_inducing=5, num_orthogonal=orthogonal)
    elbo = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=2)
    assert _cholesky_sizes(elbo, dgp.model, dgp.guide, X, y) == sorted([5] * 3 + [3] * (3 if orthogonal else 0))


def test_deep_conv_gp_factorises_each_layer_once():
    """A deep conv GP (a hidden ConvLayer with 2 channels over 4 inducing patches, a TICK output layer with 5):
    one Cholesky per layer per ELBO evaluation."""
    from pyro_sparsegp import ConvLayer, DeepConvGP

    H = W = 5
    hidden = ConvLayer(RBF(9, lengthscale=torch.tensor(3.0)), (H, W, 1), 3, 1, 2, torch.randn(4, 9), name="h")
    k = ps.TICK(RBF(8, lengthscale=torch.tensor(2.0)), hidden.output_image_shape, 2, 1)
    out = ps.SVGP(k, ps.IndexedInducingPatches(torch.randn(5, k.patch_dim), grid=k.grid), ps.RobustMax(3),
                  num_outputs=3, integrate_f=True, name="out")
    gp = DeepConvGP([hidden], out)
    X, y = torch.randn(6, H * W), torch.randint(0, 3, (6,)).to(torch.get_default_dtype())
    elbo = TraceMeanField_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=2)
    assert _cholesky_sizes(elbo, gp.model, gp.guide, X, y) == [4, 5]
