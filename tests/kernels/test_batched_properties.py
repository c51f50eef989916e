"""Properties of ``kernel_matrix`` / ``kernel_diag`` (:mod:`pyro_sparsegp.kernels.batched`) checked against Pyro's
own kernels (the oracle) one member at a time: hyperparameters drawn under vectorised particles (``[P, 1]``, ARD
``[P, 1, D]``) give one matrix per particle and are refused when drawn inside the data plate; feature selection by
``active_dims``; the generic fallback (any other Pyro kernel) over batched inputs, and its refusal of a user kernel
whose block has the wrong shape; inside :func:`~pyro_sparsegp.deferred.deferred_checks` the exactness test is not
read but recorded (the product form is kept, or the differences once ``exact_kernels`` is set)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp import kernels as pk
from pyro.nn import PyroSample

from pyro_sparsegp import deferred
from pyro_sparsegp.kernels import batched as kern
from pyro_sparsegp.kernels import expected_input_dim, kernel_diag, kernel_matrix, required_features


@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern52, pk.RationalQuadratic])
def test_hyperparameters_drawn_per_particle_give_one_matrix_per_particle(cls, ard):
    torch.manual_seed(0)
    X, Z = torch.randn(5, 2), torch.randn(4, 2)
    k = cls(2)
    k.lengthscale = PyroSample(dist.LogNormal(torch.zeros(2), 0.3).to_event(1) if ard else dist.LogNormal(0.0, 0.3))
    k.variance = PyroSample(dist.LogNormal(0.0, 0.3))
    with pyro.plate("particles", 3, dim=-2), k._pyro_context:
        ls, var = k.lengthscale, k.variance  # [3, 1] (ARD: [3, 1, 2]): the data plate's singleton on the right
        K, Kxx, d = kernel_matrix(k, X, Z), kernel_matrix(k, X), kernel_diag(k, X)
        K2 = kernel_matrix(k, X.expand(3, 5, 2), Z)  # inputs batched like the particles
    assert K.shape == K2.shape == (3, 5, 4) and Kxx.shape == (3, 5, 5) and d.shape == (3, 5)
    for p in range(3):
        ref = cls(2, lengthscale=ls[p, 0], variance=var[p, 0])
        if cls is pk.RationalQuadratic:
            ref.scale_mixture = k.scale_mixture
        torch.testing.assert_close(K[p], ref(X, Z))
        torch.testing.assert_close(K2[p], ref(X, Z))
        torch.testing.assert_close(Kxx[p], ref(X))
        torch.testing.assert_close(d[p], ref(X, diag=True))


def test_a_hyperparameter_drawn_inside_the_data_plate_is_refused():
    k = pk.RBF(2)
    k.lengthscale = PyroSample(dist.LogNormal(0.0, 0.3))
    X = torch.randn(5, 2)
    with pyro.plate("data", 5, dim=-1), k._pyro_context:
        with pytest.raises(ValueError, match="outside the data plate"):
            kernel_matrix(k, X)


def test_active_dims_select_features_and_set_the_required_width():
    torch.manual_seed(0)
    X, Z = torch.randn(6, 4), torch.randn(3, 4)
    k = pk.Matern32(2, active_dims=[3, 1], lengthscale=torch.tensor(0.8))
    torch.testing.assert_close(kernel_matrix(k, X, Z), pk.Matern32(2, lengthscale=torch.tensor(0.8))(X[:, [3, 1]],
                                                                                                      Z[:, [3, 1]]))
    assert required_features(k) == 4 and expected_input_dim(k) is None
    k0 = pk.RBF(3)
    assert required_features(k0) == 3 and expected_input_dim(k0) == 3
    with pytest.raises(ValueError, match="only 3"):
        kernel_matrix(k, X[:, :3])
    with pytest.raises(ValueError, match="different numbers of features"):
        kernel_matrix(k0, X[:, :3], Z)


class _Poly(pk.Kernel):
    """``(1 + x.z)^2``: a Pyro kernel with no closed form here (the generic fallback)."""

    def forward(self, X, Z=None, diag=False):
        if diag:
            return (1 + (X * X).sum(-1)) ** 2
        return (1 + X @ (X if Z is None else Z).T) ** 2


def test_the_generic_fallback_broadcasts_batches_member_by_member():
    torch.manual_seed(0)
    k = _Poly(2)
    X, Z = torch.randn(2, 1, 5, 2), torch.randn(3, 4, 2)  # batches [2, 1] and [3] broadcast to [2, 3]
    K = kernel_matrix(k, X, Z)
    assert K.shape == (2, 3, 5, 4)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(K[i, j], k(X[i, 0], Z[j]))
    torch.testing.assert_close(kernel_matrix(k, X[0, 0], Z[1]), k(X[0, 0], Z[1]))  # 2-D Z: one call
    torch.testing.assert_close(kernel_matrix(k, X), torch.stack([k(x[0]) for x in X]).unsqueeze(1))
    torch.testing.assert_close(kernel_diag(k, X), torch.stack([k(x[0], diag=True) for x in X]).unsqueeze(1))


class _Transposed(pk.Kernel):
    def forward(self, X, Z=None, diag=False):
        Z = X if Z is None else Z
        return (X * X).sum(-1) if diag else torch.exp(-torch.cdist(Z, X))  # [M, N]: the bug


def test_a_user_kernel_block_of_the_wrong_shape_is_refused_in_batches_too():
    k = _Transposed(2)
    X, Z = torch.randn(5, 2), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"must have shape \[5, 3\].*\(transposed"):
        kernel_matrix(k, X, Z)
    with pytest.raises(ValueError, match=r"must have shape \[5, 3\].*\(transposed"):
        kernel_matrix(k, X.expand(2, 5, 2), Z.expand(2, 3, 2))
    kernel_matrix(k, X[:3], Z)  # square: no way to tell, accepted


def _far(dtype=torch.float64):
    """Inputs whose product form is not exact (lengthscale tiny against their spread), close pairs included."""
    X = torch.linspace(0, 1, 7, dtype=dtype).unsqueeze(-1) * torch.ones(2, dtype=dtype)
    return X * 1e6, X * 1e6 + 1e-3


@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern32])
def test_deferred_checks_record_an_inexact_product_instead_of_reading_it(cls):
    k = cls(2, lengthscale=torch.tensor(1e-3))
    X, Z = _far()
    exact = kernel_matrix(k, X, Z)  # immediate: the differences
    diff = (X[:, None] - Z[None]).pow(2).sum(-1) / 1e-6
    ref = torch.exp(-0.5 * diff) if cls is pk.RBF else (1 + (3 * diff).sqrt()) * torch.exp(-(3 * diff).sqrt())
    torch.testing.assert_close(exact, ref)
    checks = deferred.DeferredChecks(X.device)
    with deferred.deferred_checks(checks):
        kernel_matrix(k, 1e-3 * torch.randn(4, 2))  # within a few lengthscales: exact, no flag
        clean = checks.flags.clone()
        kernel_matrix(k, X, Z)  # the product form, flagged
        flagged = checks.flags.clone()
        checks.exact_kernels = True
        torch.testing.assert_close(kernel_matrix(k, X, Z), exact)  # the differences again
    assert clean[checks.INEXACT] == 0 and flagged[checks.INEXACT] == 1


def test_deferred_exactness_test_is_a_device_flag_not_a_read(monkeypatch):
    reads = []
    real = kern._decide
    monkeypatch.setattr(kern, "_decide", lambda exact: reads.append(exact) or real(exact))
    X, Z = _far()
    checks = deferred.DeferredChecks(X.device)
    with deferred.deferred_checks(checks):
        assert kern._gemm_is_exact(X.pow(2).sum(-1, keepdim=True), Z.pow(2).sum(-1, keepdim=True)) is True
    assert len(reads) == 1 and torch.is_tensor(reads[0]) and not bool(reads[0])
    assert checks.flags[checks.INEXACT] == 1
