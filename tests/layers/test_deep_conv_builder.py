"""``pyro_sparsegp.conv.build_deep_conv_gp``, the deep convolutional GP of Shi, Titsias, Mnih 2020 (table 5) in one
call, against the 25 lines of ``benchmarks/convgp_mnist.py::build_deep`` that it replaced (kept below as they were
at commit dea3a0c, the reference): the same modules, parameters of the same shapes and, from the same seed, the same
initial values; and table 5's architecture read off the built model."""

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp import ConvLayer, DeepConvGP
from pyro_sparsegp.conv import build_deep_conv_gp
from pyro_sparsegp.inducing import init_patches
from pyro_sparsegp.linalg import cholesky
from pyro_sparsegp.saving import describe

IMG = (28, 28, 1)
DEEP = {"deep2": (1, False), "deep2_solve": (1, True), "deep3": (2, False), "deep3_solve": (2, True)}


# -- the reference: benchmarks/convgp_mnist.py at dea3a0c (patch_kernel, _provisional, _reinit, build_deep) ----------
def patch_kernel(d, args):
    return RBF(d, variance=torch.tensor(args.variance), lengthscale=torch.tensor(args.lengthscale))


def _provisional(layer, X, n=500):
    with torch.no_grad():
        return layer.mean_function(X[:n]).reshape(len(X[:n]), -1)


def _reinit(layer_gp, before, Xtr, shape, patch, stride, M, solve, args):
    with torch.no_grad(), pyro.poutine.block():
        H = Xtr[torch.randperm(len(Xtr))[:500]]
        for layer in before:
            H = layer.sample(H)
        P = init_patches(H, shape, patch, 2 * M if solve else M, stride=stride, per_centre=args.per_centre)
        layer_gp.inducing.Z = P[:M]
        base = getattr(layer_gp.kernel, "base_kernel", layer_gp.kernel)  # TICK: its patch kernel
        base.lengthscale = torch.cdist(P, P).median()
        if solve:
            layer_gp.orthogonal.Z = P[M:]
            Luu, Lc, _ = layer_gp.strategy.joint_factors()
            layer_gp.q_v.set(torch.zeros_like(layer_gp.q_v.u_loc), Lc.expand_as(layer_gp.q_v.u_scale_tril))
        else:
            Luu = cholesky(ps.covariances.Kuu(layer_gp.inducing, layer_gp.kernel), symmetrize=True)
        layer_gp.q_u.set(torch.zeros_like(layer_gp.q_u.u_loc), Luu.expand_as(layer_gp.q_u.u_scale_tril))


def build_deep(model, Xtr, M, lik, args):
    (M0, M1), (depth, solve) = M, DEEP[model]
    P0 = init_patches(Xtr, IMG, 5, 2 * M0 if solve else M0, per_centre=args.per_centre)
    hidden = [ConvLayer(patch_kernel(25, args), IMG, 5, 1, 10, P0[:M0], P0[M0:] if solve else None, name="conv0")]
    if depth == 2:  # provisional patches from the first layer's mean maps; re-initialised from samples below
        shape0 = hidden[0].output_image_shape
        P = init_patches(_provisional(hidden[0], Xtr), shape0, 4, 2 * M0 if solve else M0, stride=2, per_centre=10)
        hidden.append(ConvLayer(patch_kernel(160, args), shape0, 4, 2, 10, P[:M0], P[M0:] if solve else None,
                                name="conv1"))
    shape = hidden[-1].output_image_shape
    patch, stride = (4, 2) if depth == 1 else (5, 1)
    d = patch * patch * shape[2]
    H0 = _provisional(hidden[0], Xtr) if depth == 1 else None
    P1 = (init_patches(H0, shape, patch, 2 * M1 if solve else M1, stride=stride, per_centre=10) if H0 is not None
          else torch.randn(2 * M1 if solve else M1, d))
    k = ps.TICK(patch_kernel(d, args), shape, patch, stride, location_lengthscale=args.location_lengthscale)
    Z = ps.IndexedInducingPatches(P1[:M1], grid=k.grid)
    if solve:
        O = ps.IndexedInducingPatches(P1[M1:], grid=k.grid)  # noqa: E741
        out = ps.SOLVEGP(k, Z, O, lik, num_outputs=10, whiten=False, integrate_f=True, name="out")
    else:
        out = ps.SVGP(k, Z, lik, num_outputs=10, whiten=False, integrate_f=True, name="out")
    gp = DeepConvGP(hidden, out, num_samples=args.particles)
    if depth == 2:
        _reinit(gp.hidden[1].gp, gp.hidden[:1], Xtr, hidden[0].output_image_shape, 4, 2, M0, solve, args)
    _reinit(out, gp.hidden, Xtr, shape, patch, stride, M1, solve, args)
    return gp


# -- the tests -----------------------------------------------------------------------------------------------------
def _unnamed(config):
    """The layout with every ``name`` left out (the reference's names are fixed, the builder's unique)."""
    if isinstance(config, dict):
        return {k: _unnamed(v) for k, v in config.items() if k != "name"}
    if isinstance(config, (list, tuple)):
        return [_unnamed(v) for v in config]
    return config


def _images(N=40):
    X = torch.rand(N, 784)
    X[:, :100] = 0.0  # a blank border, as in MNIST: repeated all-zero patches
    return X


@pytest.mark.parametrize("model", list(DEEP))
def test_builder_reproduces_the_benchmarks_model(model):
    """Same layout (every module's class and constructor arguments, tensors by shape), same state_dict entries and,
    from the same global seed, the same initial values; ``seed=0`` gives the same model as the global seed 0 does,
    and leaves the global random state as it found it."""
    from types import SimpleNamespace

    depth, solve = DEEP[model]
    args = SimpleNamespace(variance=5.0, lengthscale=1.0, location_lengthscale=3.0, per_centre=5, particles=1)
    X = _images()
    pyro.set_rng_seed(0)
    ref = build_deep(model, X, (3, 4), ps.RobustMax(10), args)
    pyro.set_rng_seed(0)
    new = build_deep_conv_gp(X, IMG, 10, num_layers=depth + 1, solve=solve, num_inducing=(3, 4), per_centre=5)
    assert _unnamed(describe(new)) == _unnamed(describe(ref))
    a, b = ref.state_dict(), new.state_dict()
    assert list(a) == list(b)
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, unequal
    pyro.set_rng_seed(123)
    state = torch.get_rng_state()
    seeded = build_deep_conv_gp(X, IMG, 10, num_layers=depth + 1, solve=solve, num_inducing=(3, 4), per_centre=5,
                                seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(v, seeded.state_dict()[k]) for k, v in a.items())


def test_builder_follows_table_5():
    """Table 5 read off the model: 28x28x1 -> 5x5/1 conv with 10 channels -> 24x24x10; 2 layers: TICK 4x4/2 on it
    (11x11 locations, 160-dimensional patches); 3 layers: a 4x4/2 conv with 10 channels (11x11x10), then TICK 5x5/1
    (7x7 locations, 250-dimensional patches). Robust-max over K classes, no whitening, M + M patches for SOLVE-GP
    layers, every later layer's q(u) at the prior (its scale the Cholesky factor of its Kuu)."""
    X = _images()
    two = build_deep_conv_gp(X, IMG, 10, num_inducing=(3, 4), per_centre=5, seed=0)
    assert [h.output_image_shape for h in two.hidden] == [(24, 24, 10)]
    assert two.output.kernel.patch_size == (4, 4) and two.output.kernel.stride == (2, 2)
    assert two.output.kernel.grid == (11, 11) and two.output.kernel.patch_dim == 160
    assert isinstance(two.likelihood, ps.RobustMax) and two.likelihood.num_classes == 10
    assert not two.output.whiten and not two.hidden[0].gp.whiten and two.output.integrate_f
    three = build_deep_conv_gp(X, IMG, 10, num_layers=3, solve=True, num_inducing=(3, 4), per_centre=5, seed=0)
    assert [h.output_image_shape for h in three.hidden] == [(24, 24, 10), (11, 11, 10)]
    assert three.hidden[1].patch_size == (4, 4) and three.hidden[1].stride == (2, 2)
    assert three.output.kernel.grid == (7, 7) and three.output.kernel.patch_dim == 250
    assert [h.gp.Z.shape[-2] for h in three.hidden] == [3, 3] and [h.gp.O.shape[-2] for h in three.hidden] == [3, 3]
    assert three.output.Z.shape[-2] == 4 and three.output.O.shape[-2] == 4
    for gp in (three.hidden[1].gp, three.output):
        Luu = cholesky(ps.covariances.Kuu(gp.inducing, gp.kernel), symmetrize=True)
        torch.testing.assert_close(gp.q_u.u_scale_tril, Luu.expand_as(gp.q_u.u_scale_tril))
        assert (gp.q_u.u_loc == 0).all() and (gp.q_v.u_loc == 0).all()


def test_builder_takes_other_architectures_and_names_bad_inputs():
    """``hidden=``/``output=`` replace table 5's layers (here 10x10x2 images: 3x3/1 conv with 4 channels, TICK 2x2/2;
    the prediction is [N, K] class probabilities); images of the wrong width and an unknown depth raise, naming the
    argument."""
    X = torch.rand(30, 200)
    gp = build_deep_conv_gp(X, (10, 10, 2), 3, hidden=[(3, 1, 4)], output=(2, 2), num_inducing=5, per_centre=3, seed=1)
    assert gp.hidden[0].output_image_shape == (8, 8, 4) and gp.output.kernel.grid == (4, 4)
    p = gp.predict_proba(X[:6], num_samples=3)
    assert p.shape == (6, 3)
    torch.testing.assert_close(p.sum(-1), torch.ones(6))
    with pytest.raises(ValueError, match=r"images must be \[N, H\*W\*C\] = \[N, 784\]"):
        build_deep_conv_gp(X, IMG, 10)
    with pytest.raises(ValueError, match="num_layers must be one of"):
        build_deep_conv_gp(X, (10, 10, 2), 3, num_layers=4)
