"""Properties of the convolutional layers (``pyro_sparsegp.layers.conv``; van der Wilk et al. 2017, Shi, Titsias,
Mnih 2020, appendix G.2): patches of sample-batched images are each image's patches, the zero mean has the
identity mean's shape ``[..., B, P_out, C_out]``, prediction keeps no factors, and ``DeepConvGP`` refuses an output
layer without indexed inducing patches."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp import ConvLayer, DeepConvGP

H, W, C = 6, 5, 2


def _hidden(mean="identity", C_out=3):
    d = 3 * 3 * C
    return ConvLayer(RBF(d, lengthscale=torch.tensor(2.0)), (H, W, C), 3, 1, C_out, torch.randn(4, d), mean=mean,
                     name="h")


def test_patches_of_sample_batched_images_are_each_image_s():
    layer = _hidden()
    X = torch.randn(2, 3, H * W * C)  # [S, B, H*W*C]
    P = (H - 2) * (W - 2)
    p = layer.extract(X)
    assert p.shape == (2, 3 * P, 3 * 3 * C)
    for s in range(2):
        torch.testing.assert_close(p[s], layer.extract(X[s]))
    img = X[1, 2].reshape(H, W, C)
    torch.testing.assert_close(p[1, 2 * P], img[:3, :3].reshape(-1))  # the first patch of image 2: the corner


def test_the_zero_mean_is_shaped_like_the_identity_mean():
    X = torch.randn(3, H * W * C)
    ident, zero = _hidden("identity").mean_function(X), _hidden("zero").mean_function(X)
    assert zero.shape == ident.shape == (3, (H - 2) * (W - 2), 3)
    assert bool((zero == 0).all())


def test_prediction_keeps_no_factors():
    layer = _hidden()
    out = layer.sample_marginal(torch.randn(3, H * W * C), 2)
    assert out.shape == (2, 1, 3, (H - 2) * (W - 2) * 3)  # [S, 1, B, P_out*C_out]
    assert len(layer.gp.strategy.cache) == 0


def test_an_output_layer_without_indexed_inducing_patches_is_refused():
    """A TICK output layer on plain inducing points (a valid layer: points in the flattened feature map) is not the
    deep convolutional GP's output layer."""
    hidden = _hidden()
    k = ps.TICK(RBF(2 * 2 * 3), hidden.output_image_shape, 2, 2)
    out = ps.SVGP(k, torch.randn(5, k.input_dim), ps.RobustMax(3), num_outputs=3, whiten=False, integrate_f=True,
                  name="out")
    with pytest.raises(ValueError, match="TICK kernel and IndexedInducingPatches"):
        DeepConvGP([hidden], out)
