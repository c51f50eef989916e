"""Properties of ``kernel_matvec`` (:mod:`pyro_sparsegp.kernels.matvec`) besides its values (those are in
``test_kernel_matvec.py``): which inputs take the blocked path (plain RBF / Matérn kernels on 2-D inputs, under the
same exactness test as ``kernel_matrix``) and which the dense product (every other shape, batched hyperparameters);
the documented block sizes (cache-sized on the CPU, at most ``block_elements`` entries a block, as many rows as fit)
on both paths; the gradient of ``a`` alone for every kernel; the RBF's backward reusing its one product (``P = G``)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32, Matern52
from pyro.nn import PyroSample

import pyro_sparsegp.kernels.matvec as mv
from pyro_sparsegp.kernels import kernel_matrix, kernel_matvec

KERNELS = [RBF, Matern32, Matern52]


def _oracle(cls, X, Z, var, ls, a):
    """``k(X, Z) @ a`` in float64 from the differences ``(x - z) / l`` (no product form anywhere)."""
    r2 = (((X[:, None, :] - Z[None, :, :]).double() / ls.double()) ** 2).sum(-1)
    if cls is RBF:
        g = torch.exp(-0.5 * r2)
    elif cls is Matern32:
        s = (3 * r2).sqrt()
        g = (1 + s) * torch.exp(-s)
    else:
        s = (5 * r2).sqrt()
        g = (1 + s + s * s / 3) * torch.exp(-s)
    return float(var) * g @ a.double()


@pytest.fixture
def blocked(monkeypatch):
    """Counts the calls of the blocked path (``_StationaryMatvec``)."""
    calls = []
    real = mv._StationaryMatvec.apply
    monkeypatch.setattr(mv._StationaryMatvec, "apply", lambda *args: calls.append(1) or real(*args))
    return calls



def test_blocks_fit_the_documented_memory():
    """A CPU block is cache-sized, 1 MiB of float64 (a few of them stay in a 2 MiB cache); a device block at most
    128 MiB of float64 (module constants' comments)."""
    f64 = torch.finfo(torch.float64).bits // 8
    assert mv.block_elements(torch.device("cpu")) * f64 == 2**20
    assert mv.block_elements(torch.device("meta")) * f64 == 128 * 2**20


@pytest.mark.parametrize("ard", [True, False], ids=["ard", "iso"])
@pytest.mark.parametrize("cls", KERNELS)
def test_plain_kernels_on_2d_inputs_take_the_blocked_path(cls, ard, blocked):
    D = 3
    k = cls(D, variance=torch.tensor(1.3), lengthscale=torch.linspace(0.8, 1.2, D) if ard else torch.tensor(0.9))
    X, Z, a = torch.randn(7, D), torch.randn(5, D), torch.randn(5)
    torch.testing.assert_close(kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a)
    assert len(blocked) == 1


@pytest.mark.parametrize("cls", KERNELS)
def test_other_shapes_take_the_dense_product(cls, blocked, monkeypatch):
    """``a`` ``[M, K]`` or ``[B, M, K]``, batched ``Z`` or ``X``: ``kernel_matrix(k, X, Z) @ a`` with its
    broadcasting, also when the dense product goes in blocks of rows (tiny blocks)."""
    k = cls(2, variance=torch.tensor(0.7), lengthscale=torch.tensor([0.9, 1.4]))
    X, Z = torch.randn(6, 2), torch.randn(4, 2)
    cases = [
        (X, Z, torch.randn(4, 3)),  # a matrix: [N, 3]
        (X, Z, torch.randn(2, 4, 3)),  # a batch of matrices: [2, N, 3]
        (X, torch.randn(3, 4, 2), torch.randn(4)),  # batched Z: [3, N]
        (torch.randn(3, 6, 2), torch.randn(3, 4, 2), torch.randn(4)),  # batched X and Z: [3, N]
        (torch.randn(5, 6, 2), torch.randn(5, 4, 2), torch.randn(4)),
    ]
    for block in (4, 10**6):
        monkeypatch.setattr(mv, "block_elements", lambda device, block=block: block)
        for X_, Z_, a in cases:
            want = kernel_matrix(k, X_, Z_) @ a
            got = kernel_matvec(k, X_, Z_, a)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
    assert not blocked


@pytest.mark.parametrize("form", ["distribution", "callable"])
@pytest.mark.parametrize("site", ["variance", "lengthscale"])
@pytest.mark.parametrize("cls", KERNELS)
def test_hyperparameters_drawn_per_particle_take_the_dense_product(cls, site, form, blocked):
    """A hyperparameter with batch dimensions (a ``PyroSample`` under vectorised particles, its prior a distribution
    or a callable) gives one product per particle, ``[P, N]``, each the one of a kernel with that particle's
    value."""
    X, Z, a = torch.randn(6, 2), torch.randn(4, 2), torch.randn(4)
    k = cls(2, variance=torch.tensor(0.8), lengthscale=torch.tensor([0.9, 1.3]))
    prior = dist.LogNormal(0.0, 0.3) if site == "variance" else dist.LogNormal(torch.zeros(2), 0.3).to_event(1)
    setattr(k, site, PyroSample(prior if form == "distribution" else lambda self: prior))
    with pyro.plate("particles", 3, dim=-2), k._pyro_context:
        v = getattr(k, site)  # [3, 1] or [3, 1, 2]
        got = kernel_matvec(k, X, Z, a)
    assert got.shape == (3, 6) and not blocked
    for p in range(3):
        kw = {"variance": torch.tensor(0.8), "lengthscale": torch.tensor([0.9, 1.3])}
        kw[site] = v[p, 0]
        torch.testing.assert_close(got[p], cls(2, **kw)(X, Z) @ a)


@pytest.mark.parametrize("cls", KERNELS)
def test_hyperparameters_with_a_batch_of_one_take_the_dense_product(cls, blocked):
    """A lengthscale ``[1, D]`` or a variance ``[1, 1]`` (batch dimensions of size one) are batched hyperparameters
    (module docstring): the dense product."""
    X, Z, a = torch.randn(6, 2), torch.randn(4, 2), torch.randn(4)
    for kw in ({"lengthscale": torch.tensor([[0.9, 1.3]])}, {"lengthscale": torch.tensor([[1.1]])},
               {"variance": torch.tensor([[0.7]])}):
        k = cls(2, **kw)
        got, want = kernel_matvec(k, X, Z, a), kernel_matrix(k, X, Z) @ a
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    assert not blocked


@pytest.mark.float64
@pytest.mark.parametrize("cls", KERNELS)
def test_the_blocked_path_is_taken_exactly_where_kernel_matrix_keeps_the_product(cls, blocked, differences):
    """Same exactness test as ``kernel_matrix`` (module docstring): over lengthscales from where the product form is
    exact to where it is not (4 features, inducing inputs near some data, and inputs with a far outlier, where the
    RBF's weighted test keeps the product), ``kernel_matvec`` takes the blocked path exactly when ``kernel_matrix`` does
    not go to the differences, and its values are the ones from the differences either way."""
    torch.manual_seed(1)
    X0 = torch.randn(8, 4) * 3.0 + 0.5
    Z0 = torch.cat([X0[:3] + 1e-6 * torch.randn(3, 4), torch.randn(2, 4) * 3.0])  # near pairs: no RBF decay
    outlier = (torch.tensor([[1e5]]), torch.tensor([[-1e5], [1e5 - 1e3]]))  # the RBF keeps the product here
    cases = [(X0, Z0, s) for s in torch.logspace(-7.0, -2.0, 41).tolist()] + [(*outlier, 1.0)]
    took = set()
    for X, Z, ls in cases:
        k = cls(X.shape[1], variance=torch.tensor(1.1), lengthscale=torch.full((X.shape[1],), ls))
        a = torch.linspace(-1.0, 1.0, Z.shape[0])
        got = kernel_matvec(k, X, Z, a)
        kernel_matrix(k, X, Z)
        product = len(differences) == 0
        assert len(blocked) == int(product), (ls, product)
        took.add(product)
        torch.testing.assert_close(got, _oracle(cls, X, Z, 1.1, k.lengthscale, a), rtol=1e-9, atol=1e-12)
        blocked.clear()
        differences.clear()
    assert took == {True, False}  # the sweep crosses the switch


@pytest.mark.float64
def test_offset_inputs_far_apart_are_exact_through_the_differences():
    """Two clusters 2e3 apart at lengthscale 1e-3: pairs within a cluster have norms ~1e12 in lengthscale units,
    where the product form would err by ~1e-3 in r^2; the result matches the differences to 1e-9."""
    X = torch.tensor([[-1e3], [1e3 + 5e-4]])
    Z = torch.tensor([[1e3], [1e3 + 1e-3], [-1e3 - 3e-4]])
    a = torch.tensor([0.7, -1.2, 0.4])
    for cls in KERNELS:
        k = cls(1, variance=torch.tensor(1.0), lengthscale=torch.tensor(1e-3))
        torch.testing.assert_close(kernel_matvec(k, X, Z, a), _oracle(cls, X, Z, 1.0, k.lengthscale, a),
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", KERNELS)
def test_the_gradient_of_a_alone(cls):
    """Only ``a`` requires a gradient (data, inducing inputs and hyperparameters fixed): ``var G^T c`` = the dense
    product's."""
    k = cls(2, variance=torch.tensor(1.4), lengthscale=torch.tensor([0.8, 1.2]))
    for p in k.parameters():
        p.requires_grad_(False)
    X, Z = torch.randn(7, 2), torch.randn(5, 2)
    a = torch.randn(5, requires_grad=True)
    c = torch.linspace(-1.0, 2.0, 7)
    got = torch.autograd.grad((kernel_matvec(k, X, Z, a) * c).sum(), a)[0]
    torch.testing.assert_close(got, kernel_matrix(k, X, Z).mT @ c)


@pytest.mark.parametrize("M", [1, 3, 5, 11])
@pytest.mark.parametrize("cls", KERNELS)
def test_every_block_is_as_many_rows_as_fit(cls, M, monkeypatch):
    """Forward and backward: each block of rows (and each scratch block) holds at most ``block_elements`` entries,
    and holds as many rows as fit (at least one row, and no more than ``N``): ragged only at the end."""
    block, N = 10, 13
    monkeypatch.setattr(mv, "block_elements", lambda device: block)
    rows_seen, scratch = [], []
    real_blocks, real_buffers = mv._blocks, mv._buffers
    monkeypatch.setattr(mv, "_blocks", lambda kind, Xa, Za, bufs: rows_seen.append(Xa.shape[0])
                        or real_blocks(kind, Xa, Za, bufs))
    monkeypatch.setattr(mv, "_buffers", lambda kind, rows, Za: scratch.append(rows) or real_buffers(kind, rows, Za))
    fit = max(1, block // M)
    for n in (N, 2):
        k = cls(2, lengthscale=torch.tensor(1.1))
        X, Z = torch.randn(n, 2, requires_grad=True), torch.randn(M, 2, requires_grad=True)
        a = torch.randn(M, requires_grad=True)
        out = kernel_matvec(k, X, Z, a)
        torch.autograd.grad(out.sum(), [X, Z, a])
        want = [min(fit, n - i) for i in range(0, n, fit)]
        assert rows_seen == want + want  # the forward's blocks, then the backward's
        assert scratch == [min(fit, n)] * 2
        rows_seen.clear()
        scratch.clear()


@pytest.mark.parametrize("M", [1, 3, 11])
def test_the_dense_product_goes_in_blocks_of_as_many_rows_as_fit(M, monkeypatch):
    """Other kernels: each ``kernel_matrix`` call of a 2-D ``X`` and a vector ``a`` forms at most ``block_elements``
    entries (or one row), as many rows as fit; a product that fits is one call."""
    from pyro.contrib.gp.kernels import Exponential

    block = 10
    monkeypatch.setattr(mv, "block_elements", lambda device: block)
    rows_seen = []
    real = mv.kernel_matrix
    monkeypatch.setattr(mv, "kernel_matrix", lambda k, X, Z: rows_seen.append(X.shape[0]) or real(k, X, Z))
    k = Exponential(2, lengthscale=torch.tensor(0.9))
    fit = max(1, block // M)
    for N in (13, 1, block // M or 1):
        X, Z, a = torch.randn(N, 2), torch.randn(M, 2), torch.randn(M)
        torch.testing.assert_close(kernel_matvec(k, X, Z, a), real(k, X, Z) @ a)
        assert rows_seen == ([N] if N * M <= block else [min(fit, N - i) for i in range(0, N, fit)])
        rows_seen.clear()


def test_the_rbf_backward_reuses_its_one_product():
    """For the RBF ``dg/dq = -g``: the slope block is the kernel block (``P = G``), so the gradient of ``a`` is read
    off the product that also gives the gradient of ``z``; no separate ``G^T c`` pass (a matrix-vector product) is
    made, while the Matérn kernels need one."""
    X, Z = torch.randn(9, 2), torch.randn(6, 2, requires_grad=True)
    a = torch.randn(6, requires_grad=True)
    for cls in KERNELS:
        out = kernel_matvec(cls(2, lengthscale=torch.tensor(1.2)), X, Z, a)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(out.sum(), [Z, a])
        mvs = sum(e.name in ("aten::addmv_", "aten::addmv", "aten::mv") for e in prof.events())
        assert (mvs == 0) == (cls is RBF), (cls, mvs)

