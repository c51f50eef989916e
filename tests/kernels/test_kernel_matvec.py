"""``kernel_matvec``: ``k(X, Z) @ a`` in cache-sized blocks with closed-form gradients, against the dense
``kernel_matrix(k, X, Z) @ a`` differentiated by autograd (values and the gradients of every input and
hyperparameter), by ``gradcheck``, across block boundaries, at coincident points, and on the fallbacks."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Exponential, Matern32, Matern52, RationalQuadratic

import pyro_sparsegp.kernels.matvec as mv
from pyro_sparsegp.kernels import kernel_matrix, kernel_matvec

KERNELS = [RBF, Matern32, Matern52]


def _kernel(cls, D, ard=True):
    ls = torch.linspace(0.7, 1.4, D) if ard else torch.tensor(1.1)
    return cls(D, variance=torch.tensor(1.7), lengthscale=ls)


def _grads(k, X, Z, a, fn):
    c = torch.linspace(-1.0, 2.0, X.shape[0])
    out = fn(k, X, Z, a)
    params = [X, Z, a] + [p for p in k.parameters()]
    return (out,) + torch.autograd.grad((out * c).sum(), params)


def _dense(k, X, Z, a):
    return kernel_matrix(k, X, Z) @ a


@pytest.mark.parametrize("ard", [True, False])
@pytest.mark.parametrize("cls", KERNELS)
def test_values_and_every_gradient_match_the_dense_product(cls, ard, monkeypatch):
    monkeypatch.setattr(mv, "block_elements", lambda device: 64)  # 64 // 30 = 2 rows a block, a ragged last one
    D = 3
    k = _kernel(cls, D, ard)
    X = torch.randn(9, D, requires_grad=True)
    Z = torch.randn(30, D)
    Z[:4] = X.detach()[:4]  # coincident points: r = 0, where sqrt has no derivative
    Z.requires_grad_(True)
    a = torch.randn(30, requires_grad=True)
    tol = 1e-10 if X.dtype == torch.float64 else 2e-4
    for got, want in zip(_grads(k, X, Z, a, kernel_matvec), _grads(k, X, Z, a, _dense), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.float64
@pytest.mark.parametrize("cls", KERNELS)
def test_gradcheck(cls, monkeypatch):
    monkeypatch.setattr(mv, "block_elements", lambda device: 16)
    X = torch.randn(5, 2, requires_grad=True)
    Z = torch.randn(7, 2, requires_grad=True)
    a = torch.randn(7, requires_grad=True)
    var = torch.tensor(1.3, requires_grad=True)
    Xq, Zq = X * 1.1, Z * 1.1

    def f(Xq, Zq, var, a):
        return mv._StationaryMatvec.apply(Xq, Zq, var, a, mv._KINDS[cls])

    assert torch.autograd.gradcheck(f, (Xq.detach().requires_grad_(), Zq.detach().requires_grad_(), var, a))


def test_only_what_is_asked_for_is_differentiated():
    """Inputs without ``requires_grad`` (fixed inducing inputs, data) get no gradient; the others still match."""
    k = _kernel(Matern32, 2)
    X, Z = torch.randn(6, 2), torch.randn(8, 2)
    a = torch.randn(8, requires_grad=True)
    got = torch.autograd.grad(kernel_matvec(k, X, Z, a).sum(), a)[0]
    torch.testing.assert_close(got, kernel_matrix(k, X, Z).sum(0))


@pytest.mark.parametrize("make", [
    lambda: Exponential(2, lengthscale=torch.tensor(0.9)),  # not smooth at r = 0: always the dense product
    lambda: RationalQuadratic(2, lengthscale=torch.tensor(0.9)),
])
def test_other_kernels_take_the_dense_product(make, monkeypatch):
    monkeypatch.setattr(mv, "block_elements", lambda device: 8)  # the dense product in blocks of rows too
    k = make()
    X, Z, a = torch.randn(7, 2, requires_grad=True), torch.randn(5, 2), torch.randn(5)
    got, want = kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), X)[0], torch.autograd.grad(want.sum(), X)[0])


def test_blocks_are_cache_sized_on_the_cpu_and_large_elsewhere():
    """The CPU takes cache-sized blocks; another device few large ones (each block costs kernel launches there)."""
    assert mv.block_elements(torch.device("cpu")) == mv.BLOCK_ELEMENTS < mv.DEVICE_BLOCK_ELEMENTS
    assert mv.block_elements(torch.device("meta")) == mv.DEVICE_BLOCK_ELEMENTS


def test_batched_inputs_take_the_dense_product():
    k = _kernel(RBF, 2)
    X, Z, a = torch.randn(3, 4, 2), torch.randn(5, 2), torch.randn(5)
    torch.testing.assert_close(kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a)


def test_inexact_products_fall_back_to_the_differences():
    """Lengthscales tiny against the spread of the inputs fail the product form's exactness test (as in
    ``kernel_matrix``): the result is then the one from the differences, exact for close points."""
    k = Matern32(1, lengthscale=torch.tensor(1e-3 if torch.get_default_dtype() == torch.float64 else 1e-1))
    X = torch.tensor([[1e3], [1e3 + 1e-4]])
    Z = torch.tensor([[1e3 + 2e-4], [-1e3]])
    a = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a)


def test_feature_checks_are_the_kernel_matrix_ones():
    with pytest.raises(ValueError, match="different numbers of features"):
        kernel_matvec(_kernel(RBF, 2), torch.randn(3, 2), torch.randn(4, 3), torch.randn(4))


@pytest.mark.parametrize("cls", KERNELS)
def test_active_dims_select_the_same_features(cls):
    """A kernel on some of the features (``active_dims``) sees the same features in both paths, and the unused
    features get no gradient."""
    k = cls(2, variance=torch.tensor(0.9), lengthscale=torch.tensor([0.8, 1.3]), active_dims=[2, 0])
    X = torch.randn(6, 3, requires_grad=True)
    Z, a = torch.randn(5, 3), torch.randn(5)
    got, want = kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a
    torch.testing.assert_close(got, want)
    gX = torch.autograd.grad(got.sum(), X)[0]
    torch.testing.assert_close(gX, torch.autograd.grad(want.sum(), X)[0])
    # feature 1 is not among the active dims: its true gradient is zero (round-off floor of the used features)
    assert gX[:, 1].abs().max() <= 1e3 * torch.finfo(gX.dtype).eps * gX.abs().max()
