"""Properties of ``kernel_matrix`` / ``kernel_diag`` (:mod:`pyro_sparsegp.kernels.batched`) checked against Pyro's
own kernels (the oracle) one member at a time: hyperparameters drawn under vectorised particles (``[P, 1]``, ARD
``[P, 1, D]``) give one matrix per particle and are refused when drawn inside the data plate; feature selection by
``active_dims``; the generic fallback (any other Pyro kernel) over batched inputs, and its refusal of a user kernel
whose block has the wrong shape; inside :func:`~pyro_sparsegp.context.deferred.deferred_checks` the exactness test is
not read but recorded (the product form is kept, or the differences once ``exact_kernels`` is set)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp import kernels as pk
from pyro.nn import PyroSample

from pyro_sparsegp.context import deferred
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



# -- feature selection, hyperparameter layouts, the generic fallback, errors ------------------------------------------

def test_default_active_dims_read_the_first_input_dim_features():
    """Pyro's kernels act on ``active_dims`` (default the first ``input_dim`` features, a permutation when given so):
    wider inputs, inputs with as many rows as features, batched inputs and a permutation of all the features give
    Pyro's own kernel on the selected columns."""
    torch.manual_seed(0)
    for make in (lambda: pk.RBF(2, lengthscale=torch.tensor([0.5, 2.0])),
                 lambda: pk.Matern32(2, lengthscale=torch.tensor([0.5, 2.0]))):
        k = make()
        for X in (torch.randn(2, 3), torch.randn(5, 3), torch.randn(4, 2, 3)):
            want = torch.stack([k(x) for x in X.reshape(-1, *X.shape[-2:])]).reshape(X.shape[:-1] + X.shape[-2:-1])
            torch.testing.assert_close(kernel_matrix(k, X), want)
        kp = make()
        kp.active_dims = [1, 0]  # all the features, permuted
        X, Z = torch.randn(5, 2), torch.randn(3, 2)
        torch.testing.assert_close(kernel_matrix(kp, X, Z), k(X[:, [1, 0]], Z[:, [1, 0]]))
    assert required_features(torch.nn.Module()) == 0  # a kernel that names no features needs none


@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern32])
def test_slices_as_active_dims_select_what_pyro_selects(cls):
    """``active_dims`` given as a slice (Pyro's kernels index inputs with it as it is): ``slice(0, 2)`` and
    ``slice(1, 3)`` two of three features, ``slice(None)`` every feature, however many; each against Pyro's own
    kernel. Inputs without the features a slice names are refused."""
    X, Z = torch.randn(5, 3), torch.randn(4, 3)
    for ad in (slice(0, 2), slice(1, 3), slice(None)):
        k = cls(2, lengthscale=torch.tensor([0.8, 1.9]) if ad.stop else torch.tensor(0.8))
        k.active_dims = ad
        torch.testing.assert_close(kernel_matrix(k, X, Z), k(X, Z))
    k.active_dims = slice(1, 3)
    assert required_features(k) == 3
    with pytest.raises(ValueError, match=r"acts on features \[1, 2\]"):
        kernel_matrix(k, X[:, :2])


def test_particles_left_of_two_plates_keep_their_singleton():
    """A hyperparameter drawn under vectorised particles at dim -3 (a model with two plates): ``[P, 1, 1]``; the
    data plate's singleton is dropped and the other kept: one ``[1, N, M]`` matrix per particle."""
    k = pk.Matern52(2)
    k.variance = PyroSample(dist.LogNormal(0.0, 0.3))
    X, Z = torch.randn(5, 2), torch.randn(4, 2)
    with pyro.plate("particles", 3, dim=-3), k._pyro_context:
        var = k.variance  # [3, 1, 1]
        K = kernel_matrix(k, X, Z)
    assert var.shape == (3, 1, 1) and K.shape == (3, 1, 5, 4)
    for p in range(3):
        torch.testing.assert_close(K[p, 0], pk.Matern52(2, variance=var[p, 0, 0])(X, Z))


@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern52])
def test_hyperparameters_with_callable_priors_drawn_per_particle(cls):
    """``PyroSample(lambda self: prior)`` has no event shape to read: the variance is taken as a scalar event and the
    lengthscale as a ``[D]`` one; one matrix per particle, as with a distribution."""
    X, Z = torch.randn(5, 2), torch.randn(4, 2)
    k = cls(2)
    k.variance = PyroSample(lambda self: dist.LogNormal(0.0, 0.3))
    k.lengthscale = PyroSample(lambda self: dist.LogNormal(torch.zeros(2), 0.3).to_event(1))
    with pyro.plate("particles", 3, dim=-2), k._pyro_context:
        var, ls = k.variance, k.lengthscale  # [3, 1], [3, 1, 2]
        K, d = kernel_matrix(k, X, Z), kernel_diag(k, X)
    assert K.shape == (3, 5, 4) and d.shape == (3, 5)
    for p in range(3):
        ref = cls(2, variance=var[p, 0], lengthscale=ls[p, 0])
        torch.testing.assert_close(K[p], ref(X, Z))
        torch.testing.assert_close(d[p], ref(X, diag=True))


@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern32, pk.Exponential, pk.RationalQuadratic])
def test_the_diagonal_is_the_matrix_diagonal_for_every_variance_layout(cls):
    """``kernel_diag(k, X)`` is the diagonal of ``kernel_matrix(k, X)`` with a scalar variance, a variance with a
    batch dimension of one (``[1, 1]``) and a lengthscale with one (``[1, D]``); the exponential kernel (always the
    differences) and the others (the product form) alike."""
    X = torch.randn(6, 2)
    for kw in ({}, {"variance": torch.tensor([[0.7]])}, {"lengthscale": torch.tensor([[0.6, 1.7]])}):
        k = cls(2, **kw)
        K, d = kernel_matrix(k, X), kernel_diag(k, X)
        assert d.shape == K.shape[:-1]
        torch.testing.assert_close(d, K.diagonal(dim1=-2, dim2=-1))
        kw1 = {n: v.reshape(-1) if v.numel() > 1 else v.reshape(()) for n, v in kw.items()}
        ref = cls(2, **kw1)(X)  # the [1, D] / [1, 1] layouts are Pyro's [D] / scalar
        off = ~torch.eye(6, dtype=torch.bool)  # Pyro's exponential kernel has sqrt(r2 + 1e-12) on the diagonal
        torch.testing.assert_close(K[..., off], ref[..., off])


def test_the_generic_fallback_flattens_batched_inputs_into_one_call():
    """Module docstring: other kernels see ``X`` flattened, one call of the Pyro kernel per 2-D ``Z``."""
    calls = []

    class Counted(_Poly):
        def forward(self, X, Z=None, diag=False):
            calls.append(tuple(X.shape))
            return super().forward(X, Z, diag)

    k = Counted(2)
    X, Z = torch.randn(3, 5, 2), torch.randn(4, 2)
    K = kernel_matrix(k, X, Z)
    assert calls == [(15, 2)] and K.shape == (3, 5, 4)
    for b in range(3):
        torch.testing.assert_close(K[b], _Poly(2)(X[b], Z))


def test_a_user_kernel_diagonal_of_the_wrong_shape_is_refused_by_name():
    class Wide(_Poly):
        def forward(self, X, Z=None, diag=False):
            return super().forward(X, Z, False) if diag else super().forward(X, Z, diag)

    with pytest.raises(ValueError, match=r"Wide: k\(X, diag=True\) must have shape \[5\]"):
        kernel_diag(Wide(2), torch.randn(5, 2))


def test_the_diagonal_refuses_inputs_narrower_than_the_kernel():
    with pytest.raises(ValueError, match="acts on features"):
        kernel_diag(pk.RBF(3), torch.randn(4, 2))
    with pytest.raises(ValueError, match="acts on features"):
        kernel_diag(pk.Matern32(1, active_dims=[2]), torch.randn(4, 2))


# -- the differences: chunks, lengthscale layouts; the switch --------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 6, 8, 12, 10**6])
def test_the_differences_in_any_number_of_chunks_are_one_computation(chunk, monkeypatch):
    """The exponential kernel (always the differences) in chunks of rows (1, 2, 3 or all rows of ``X`` at once for
    ``M D = 4``), batched or not, with an ARD lengthscale ``[D]`` or ``[1, D]``: Pyro's kernel on each member."""
    monkeypatch.setattr(kern, "_CHUNK", chunk)
    X, Z = torch.randn(3, 2), torch.randn(2, 2)
    for ls in (torch.tensor([0.6, 1.7]), torch.tensor([[0.6, 1.7]])):
        k = pk.Exponential(2, lengthscale=ls)
        ref = pk.Exponential(2, lengthscale=ls.reshape(-1))
        torch.testing.assert_close(kernel_matrix(k, X, Z), ref(X, Z))
        Xb = torch.randn(2, 3, 2)
        Kb = kernel_matrix(k, Xb, Z)
        torch.testing.assert_close(Kb, torch.stack([ref(x, Z) for x in Xb]))


def _tie(dtype):
    """Inputs whose product-form bound ``4 eps (max x^2 + max z^2)`` equals the dtype's tolerance exactly (one row of
    X at the origin, so x^2 = 0 after centring; z = (p, q) with p^2 + q^2 rounding to tol / (4 eps))."""
    eps, tol = torch.finfo(dtype).eps, (1e-8 if dtype == torch.float64 else 1e-3)
    s = torch.tensor(tol, dtype=dtype).item() / (4 * eps)  # 4 eps is a power of two: exact
    for i in range(1, 2000):
        p = math.sqrt(s) * i / 2000
        q = torch.tensor(math.sqrt(s - p * p), dtype=dtype)
        for k in range(-4, 5):
            z = torch.stack([torch.tensor(p, dtype=dtype), q + k * torch.finfo(dtype).eps * q])
            if (4 * eps * (z * z).sum() == torch.tensor(tol, dtype=dtype)).item():
                return torch.zeros(1, 2, dtype=dtype), z.unsqueeze(0)
    raise AssertionError("no tie found")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_bound_equal_to_the_tolerance_keeps_the_product(dtype, differences):
    """The differences are taken when the bound *exceeds* the tolerance (module docstring): at equality the product
    form stays, one step above it does not."""
    X, Z = _tie(dtype)
    k = pk.Matern32(2, lengthscale=torch.tensor(1.0, dtype=dtype), variance=torch.tensor(1.0, dtype=dtype))
    kernel_matrix(k, X, Z)
    assert not differences
    kernel_matrix(k, X, Z * (1 + 4 * torch.finfo(dtype).eps))
    assert len(differences) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls", [pk.RBF, pk.Matern32])
def test_half_precision_takes_float32s_tolerance(cls, dtype, differences):
    """Dtypes without a tolerance of their own take float32's, 1e-3: inputs of unit spread (bound ~4 eps * 8 >
    1e-3, and no RBF decay: the inducing inputs are near the data) go to the differences, and the result is within a
    few of the dtype's eps of the float64 formula."""
    torch.manual_seed(0)
    X = torch.randn(6, 2)
    Z = X[:4] + 0.3 * torch.randn(4, 2)
    k = cls(2, lengthscale=torch.tensor(1.0), variance=torch.tensor(1.0))
    K = kernel_matrix(k.to(dtype), X.to(dtype), Z.to(dtype))
    assert len(differences) == 1 and K.dtype == dtype
    torch.testing.assert_close(K.double(), k(X.to(dtype).double(), Z.to(dtype).double()), rtol=0,
                               atol=8 * torch.finfo(dtype).eps)


def _rbf_bound_case(d, ratio):
    """Rows of X at +-a and +-10 a (centred), an inducing input of norm a - d (or a + d), with a chosen so that the
    documented weighted bound ``4 eps (a^2 + (a + max(d, sqrt 2))^2) [exp(-d^2/2) if d >= sqrt 2]`` is ``ratio``
    times 1e-8 (float64); with a second inducing input of small norm (the nearest norm is then the largest)."""
    eps = torch.finfo(torch.float64).eps
    m = max(d, math.sqrt(2))
    c = ratio * 1e-8 / (4 * eps) / (math.exp(-0.5 * d * d) if d >= math.sqrt(2) else 1.0)  # a^2 + (a + m)^2 = c
    a = (-2 * m + math.sqrt(4 * m * m - 8 * (m * m - c))) / 4
    X = torch.tensor([[-a], [a], [-10 * a], [10 * a]])  # rows at +-10a: the plain bound fails, the decay hides them
    return X, torch.tensor([[0.1 * a], [a - d]]), torch.tensor([[a + d], [0.1 * a]])


@pytest.mark.float64
@pytest.mark.parametrize("d", [0.5, 1.0, 1.6, 3.0])
def test_the_rbf_switch_is_its_documented_weighted_bound(d, differences):
    """A millionth either side of the weighted bound of ``_rbf_gemm_is_exact`` (docstring): the product below, the
    differences above, whether the nearest inducing norm lies below ``a`` (and is the largest) or above it; values
    within the tolerance either way."""
    k = pk.RBF(1, lengthscale=torch.tensor(1.0), variance=torch.tensor(1.0))
    for ratio, diff in ((1 - 1e-6, 0), (1 + 1e-6, 1)):
        X, Z_below, Z_above = _rbf_bound_case(d, ratio)
        for Z in (Z_below, Z_above):
            K = kernel_matrix(k, X, Z)
            assert len(differences) == diff, (d, ratio, Z)
            differences.clear()
            # within the tolerance relative to the variance (docstring of _rbf_gemm_is_exact)
            torch.testing.assert_close(K, torch.exp(-0.5 * (X - Z.mT) ** 2), rtol=0, atol=2e-8)


# -- inside deferred checks ----------------------------------------------------------------------------------------

def test_deferred_rbf_records_only_what_its_weighted_test_fails(differences):
    """Inside ``deferred_checks`` the RBF's own weighted test decides: a far outlier (the plain bound fails, the
    weighted one passes) keeps the product with no flag; ``exact_kernels`` sends even exact inputs to the
    differences; empty inputs give empty matrices."""
    k = pk.RBF(1, lengthscale=torch.tensor(1.0))
    X, Z = torch.tensor([[1e5]]), torch.tensor([[-1e5], [1e5 - 1e3]])
    checks = deferred.DeferredChecks(X.device)
    with deferred.deferred_checks(checks):
        kernel_matrix(k, X, Z)
        assert checks.flags[checks.INEXACT] == 0 and not differences
        assert kernel_matrix(k, torch.randn(0, 1), Z).shape == (0, 2)
        assert kernel_matrix(k, X, torch.randn(0, 1)).shape == (1, 0)
        checks.exact_kernels = True
        small = torch.randn(4, 1)
        torch.testing.assert_close(kernel_matrix(k, small), torch.exp(-0.5 * (small - small.mT) ** 2))
        assert len(differences) == 1
    assert checks.flags[checks.INEXACT] == 0
