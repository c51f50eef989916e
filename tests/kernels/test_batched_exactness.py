"""Values and paths of the stationary kernels of :mod:`pyro_sparsegp.kernels.batched` against an oracle written
here: each kernel's formula evaluated in float64 on the explicit differences ``x - z`` (Pyro's own kernels for the
ARD/broadcast cases). Covered: every kernel (RBF, Matérn-3/2 and 5/2, exponential, rational quadratic), isotropic and
ARD, square and cross, batched and broadcast inputs, empty inputs, and inputs whose product form is not exact (the
differences, in row chunks). The switch between the product form and the differences follows the documented test,
``4 eps (max |x|^2 + max |z|^2) > 1e-8`` (float64) / ``1e-3`` (float32) on centred, scaled inputs (checked a few
per cent either side of it), and for the RBF the weighted bound of ``_rbf_gemm_is_exact`` (a far outlier keeps the
product, a moderately far point does not); a common offset never sends a kernel to the differences."""

import math

import pytest
import torch
from pyro.contrib.gp import kernels as pk

from pyro_sparsegp.kernels import batched as kern
from pyro_sparsegp.kernels import kernel_diag, kernel_matrix

F64 = torch.float64


def _ref(name, diff, ls, var=1.5, alpha=0.7):
    """The kernel's formula on float64 differences ``[..., N, M, D]`` (lengthscale ``[D]`` or scalar)."""
    r2 = (diff / ls).pow(2).sum(-1)
    r = r2.sqrt()
    if name == "RBF":
        return var * torch.exp(-0.5 * r2)
    if name == "Matern32":
        return var * (1 + math.sqrt(3) * r) * torch.exp(-math.sqrt(3) * r)
    if name == "Matern52":
        return var * (1 + math.sqrt(5) * r + 5 / 3 * r2) * torch.exp(-math.sqrt(5) * r)
    if name == "Exponential":
        return var * torch.exp(-r)
    return var * (1 + 0.5 * r2 / alpha).pow(-alpha)  # RationalQuadratic


def _kernel(name, ls, dtype, D=2):
    k = getattr(pk, name)(D, lengthscale=torch.as_tensor(ls, dtype=dtype), variance=torch.tensor(1.5, dtype=dtype))
    if name == "RationalQuadratic":
        k.scale_mixture = torch.tensor(0.7, dtype=dtype)
    return k


NAMES = ["RBF", "Matern32", "Matern52", "Exponential", "RationalQuadratic"]


@pytest.mark.float64
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("regime", ["plain", "far", "chunked"])
def test_every_entry_is_the_formula_on_the_differences(name, ard, regime, monkeypatch):
    """Broadcast batches (``X [2, 1, N, D]``, ``Z [3, M, D]``), near-duplicate pairs; ``far``: lengthscale 1e-3
    against inputs spread over 1e3 (the differences); ``chunked``: the same with differences formed a few rows at a
    time (a ragged last chunk)."""
    if regime == "chunked":
        monkeypatch.setattr(kern, "_CHUNK", 40)  # 40 // (3 * 4 * 2) = 1 row a chunk
    torch.manual_seed(0)
    scale = 1e-3 if regime != "plain" else 1.0
    ls = torch.tensor([0.7, 1.3], dtype=F64) * scale if ard else torch.tensor(0.9 * scale, dtype=F64)
    X = torch.randn(2, 1, 5, 2, dtype=F64) * (1e3 * scale if regime != "plain" else 1.5) * 10
    Z = torch.cat([X[0, 0, :2] + 1e-4 * scale * torch.randn(2, 2, dtype=F64), torch.randn(2, 2, dtype=F64)])
    Z = Z.expand(3, 4, 2) + torch.arange(3, dtype=F64).reshape(3, 1, 1) * 1e-3 * scale
    k = _kernel(name, ls, F64)
    K = kernel_matrix(k, X, Z)
    assert K.shape == (2, 3, 5, 4)
    torch.testing.assert_close(K, _ref(name, X[..., :, None, :] - Z[..., None, :, :], ls), rtol=1e-9, atol=1e-12)
    Kxx = kernel_matrix(k, X)
    torch.testing.assert_close(Kxx, _ref(name, X[..., :, None, :] - X[..., None, :, :], ls), rtol=1e-9, atol=1e-12)
    assert torch.equal(Kxx.diagonal(dim1=-2, dim2=-1), torch.full((2, 1, 5), 1.5, dtype=F64))
    torch.testing.assert_close(kernel_diag(k, X), torch.full((2, 1, 5), 1.5, dtype=F64))


@pytest.mark.parametrize("name", NAMES)
def test_empty_inputs_give_empty_matrices(name):
    k = _kernel(name, 0.9, torch.get_default_dtype())
    X, Z = torch.randn(2, 0, 2), torch.randn(3, 2)
    assert kernel_matrix(k, X, Z).shape == (2, 0, 3)
    assert kernel_matrix(k, Z, X).shape == (2, 3, 0)
    assert kernel_matrix(k, X).shape == (2, 0, 0)
    assert kernel_matrix(k, torch.randn(0, 2)).shape == (0, 0)



def _bound_case(dtype, ratio):
    """1-D inputs, already centred (the rows of X have mean 0), unit lengthscale, whose product-form error bound
    ``4 eps (max x^2 + max z^2)`` is ``ratio`` times the dtype's tolerance; X has three rows (max and min differ),
    Z two."""
    tol = 1e-8 if dtype == F64 else 1e-3
    s2 = ratio * tol / (4 * torch.finfo(dtype).eps)  # max x^2 + max z^2
    a = math.sqrt(s2 / 2)
    X = torch.tensor([[-a], [0.0], [a]], dtype=dtype)
    Z = torch.tensor([[a], [0.5 * a]], dtype=dtype)
    return X, Z


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
@pytest.mark.parametrize("ratio", [0.95, 1.05])
@pytest.mark.parametrize("name", ["Matern32", "Matern52", "RationalQuadratic"])
def test_the_switch_to_the_differences_is_the_documented_bound(name, ratio, dtype, differences):
    X, Z = _bound_case(dtype, ratio)
    k = _kernel(name, 1.0, dtype, D=1)
    kernel_matrix(k, X, Z)
    b = math.sqrt(ratio * (1e-8 if dtype == F64 else 1e-3) / (4 * torch.finfo(dtype).eps))
    one, far = torch.zeros(1, 1, dtype=dtype), torch.tensor([[b]], dtype=dtype)
    kernel_matrix(k, one, far)  # one row each: x^2 = 0 after centring, z^2 = b^2
    kernel_matrix(k, one.expand(2, 1), far)  # x^2 = 0 on two rows, z^2 on one
    assert len(differences) == (0 if ratio < 1 else 3)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
def test_a_common_offset_cancels_instead_of_forcing_the_differences(dtype, differences):
    """Inputs at 1e4 (float64: 1e6) with unit spread: centred on the rows of X, the product form is exact."""
    off = 1e6 if dtype == F64 else 1e4
    torch.manual_seed(0)
    X, Z = torch.randn(40, 2, dtype=F64) + off, torch.randn(9, 2, dtype=F64) + off
    for name in ("RBF", "Matern32"):
        K = kernel_matrix(_kernel(name, 1.0, dtype), X.to(dtype), Z.to(dtype))
        torch.testing.assert_close(K.double(), _ref(name, X[:, None] - Z[None], 1.0),
                                   atol=1e-10 if dtype == F64 else 1e-3, rtol=0)
    assert not differences


def _rbf_case(a, d, others):
    """Rows of X at +-a (centred), an inducing input of norm a - d (every row is d away in norm), and with
    ``others`` two more whose norms are farther from a, one on each side (the nearest norm is a sorted search)."""
    X = torch.tensor([[-a], [a]], dtype=F64)
    Z = torch.tensor([[a - d]] + ([[0.1 * a], [-3 * a]] if others else []), dtype=F64)
    return X, Z


@pytest.mark.float64
@pytest.mark.parametrize("a, d, exact", [
    (1e5, 1e3, True),  # a far outlier: its entries are exp(-d^2/2)-small, the product form stays
    (9110.0, 2.0, False),  # bound 4 eps (a^2 + (a + d)^2) exp(-d^2/2) ~ 2e-8 > 1e-8: the differences
    (9110.0, 1.5, False),  # d just past sqrt(2): the decay still counts (bound ~ 4e-8)
    (3180.0, 1.6, True),  # bound ~ 5e-9 with the decay, ~ 1.8e-8 without it
    (3300.0, 0.5, False),  # d < sqrt(2): no decay, 4 eps (a^2 + (a + sqrt 2)^2) ~ 1.9e-8
])
@pytest.mark.parametrize("others", [False, True], ids=["one_z", "three_z"])
def test_the_rbf_keeps_the_product_where_its_weighted_bound_allows(a, d, exact, others, differences):
    X, Z = _rbf_case(a, d, others)
    k = _kernel("RBF", 1.0, F64, D=1)
    K = kernel_matrix(k, X, Z)
    torch.testing.assert_close(K, _ref("RBF", X[:, None] - Z[None], 1.0), rtol=1e-9, atol=1e-12)
    assert len(differences) == (0 if exact else 1)
