"""``ps.inducing.select`` and ``greedy_variance`` (Burt, Rasmussen, van der Wilk 2020, algorithm 1) against dense
linear algebra: at every pick the chosen row maximises the residual variance ``k(x, x) - Q(x, x)`` computed from
scratch with a dense solve, the dense trace ``tr(Kff - Qff)`` falls at every pick, ``M = N`` recovers every row,
repeated inputs are never picked twice while another row has residual variance, k-means finds separated clusters'
means; errors name the argument."""

import numpy as np
import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Linear, Sum

from pyro_sparsegp.inducing import greedy_variance, select


@torch.no_grad()
def _dense_residual(kernel, X, idx):
    """``k(x, x) - k(x, Z) K(Z, Z)^{-1} k(Z, x)`` ``[N]`` for ``Z = X[idx]``, by a dense float64 solve."""
    X = X.double()
    kd = kernel(X, diag=True).double()
    if len(idx) == 0:
        return kd
    Z = X[idx]
    Kzz, Kzx = kernel(Z).double(), kernel(Z, X).double()
    return kd - (Kzx * torch.linalg.solve(Kzz, Kzx)).sum(0)


def _kernel(D):
    # a non-constant diagonal (the linear part), so that the first pick is not a tie
    return Sum(RBF(D, variance=torch.tensor(1.0), lengthscale=torch.full((D,), 0.6)),
               Linear(D, variance=torch.tensor(0.3)))


def test_each_pick_maximises_the_dense_residual_variance_and_the_trace_falls():
    X = torch.randn(60, 2)
    kernel = _kernel(2)
    M = 20
    idx, residual = greedy_variance(X, M, kernel)
    tol = 1e-9 if X.dtype == torch.float64 else 2e-4
    traces = []
    for m in range(M):
        r = _dense_residual(kernel, X, idx[:m])  # [N] from scratch, given the first m picks
        traces.append(float(r.sum()))
        assert float(r[idx[m]]) >= float(r.max()) - tol, f"pick {m} is not the row of largest residual variance"
        assert abs(float(residual[m]) - float(r[idx[m]])) <= tol * 10
    traces.append(float(_dense_residual(kernel, X, idx).sum()))
    assert all(b < a for a, b in zip(traces, traces[1:], strict=False)), traces
    assert len(set(idx.tolist())) == M
    assert all(b <= a + tol for a, b in zip(residual.tolist(), residual.tolist()[1:], strict=False))


def test_select_returns_the_greedy_rows_and_keeps_dtype():
    X = torch.randn(50, 3)
    kernel = _kernel(3)
    idx, _ = greedy_variance(X, 7, kernel)
    Z = select(X, 7, kernel, candidates=None)
    assert Z.dtype == X.dtype and torch.equal(Z, X[idx])
    Z32 = select(X.float(), 7, kernel)
    assert Z32.dtype == torch.float32
    Znp = select(X.cpu().numpy(), 7, kernel, candidates=None)  # numpy: the default dtype
    assert Znp.dtype == torch.get_default_dtype() and torch.equal(Znp, Z)


def test_m_equal_n_recovers_every_row():
    X = torch.arange(12.0).reshape(12, 1) * 3.0  # far apart for lengthscale 1: Kff is the identity to rounding
    idx, residual = greedy_variance(X, 12, RBF(1, lengthscale=torch.ones(1)))
    assert sorted(idx.tolist()) == list(range(12))
    torch.testing.assert_close(residual, torch.ones(12), atol=1e-3, rtol=0)
    # a rank-2 kernel: two greedy picks explain everything, the other ten are distinct random rows, with a warning
    Y = torch.randn(12, 2)
    with pytest.warns(UserWarning, match="only 2 of M = 12"):
        idx, _ = greedy_variance(Y, 12, Linear(2))
    assert sorted(idx.tolist()) == list(range(12))
    assert float(_dense_residual(Linear(2), Y, idx[:2]).abs().max()) < 1e-3


def test_repeated_inputs_are_never_picked_twice():
    base = torch.randn(8, 2) * 2
    X = base.repeat(4, 1)[torch.randperm(32)]  # each input four times, shuffled
    idx, _ = greedy_variance(X, 8, RBF(2, lengthscale=torch.ones(2)))
    assert torch.unique(X[idx], dim=0).shape[0] == 8
    with pytest.warns(UserWarning, match="only 8 of M = 9"):
        greedy_variance(X, 9, RBF(2, lengthscale=torch.ones(2)))


def test_deterministic_and_seeded():
    X = torch.randn(200, 2)
    for method in ("greedy_variance", "kmeans", "random"):
        a, b = select(X, 10, method=method, seed=3), select(X, 10, method=method, seed=3)
        assert torch.equal(a, b), method
    assert not torch.equal(select(X, 10, method="random", seed=3), select(X, 10, method="random", seed=4))
    # a random subset of candidates: every pick is still a row of X, and the greedy picks are those of the subset
    Z = select(X, 10, candidates=50, seed=1)
    assert all(bool((X == z).all(-1).any()) for z in Z)
    assert not torch.equal(Z, select(X, 10, candidates=None))


def test_default_greedy_pool_is_four_m_random_rows():
    """``candidates="auto"``: the greedy selection runs on ``4 M`` random rows (drawn with ``seed``), k-means on all of
    a small ``X``."""
    X = torch.randn(500, 2)
    k = RBF(2, lengthscale=torch.full((2,), 0.5))
    pool = X[torch.randperm(500, generator=torch.Generator().manual_seed(2), device="cpu")[:40].to(X.device)]
    idx, _ = greedy_variance(pool, 10, k)
    assert torch.equal(select(X, 10, k, seed=2), pool[idx])
    assert torch.equal(select(X, 10, k, seed=2, candidates=40), pool[idx])
    assert not torch.equal(select(X, 10, k, seed=2, candidates=None), pool[idx])
    assert torch.equal(select(X, 10, method="kmeans", seed=2), select(X, 10, method="kmeans", seed=2, candidates=None))


def test_kmeans_centres_are_the_means_of_their_points():
    """Lloyd's fixed point, checked directly: each centre is the mean of the rows nearest to it."""
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    X = centres.repeat_interleave(30, 0) + torch.randn(120, 2)
    Z = select(X, 6, method="kmeans")
    nearest = torch.cdist(X, Z).argmin(-1)
    means = torch.stack([X[nearest == j].mean(0) for j in range(6)])
    torch.testing.assert_close(Z, means)


def test_greedy_variance_spreads_over_a_line():
    """On a dense grid of a line with a short lengthscale, greedy picks cover it as farthest-point sampling does:
    no point farther from a pick than twice the best covering radius 10 / 50 (random rows leave gaps of about 0.6)."""
    X = torch.linspace(0, 10, 1001).unsqueeze(-1)
    Z = select(X, 25, RBF(1, lengthscale=torch.tensor([0.3])))
    assert float(torch.cdist(X, Z).min(-1).values.max()) <= 0.4


def test_errors_name_the_argument():
    X = torch.randn(10, 2)
    with pytest.raises(ValueError, match=r"M = 11 .* N = 10"):
        select(X, 11)
    with pytest.raises(ValueError, match="method must be one of"):
        select(X, 3, method="kmeans++")
    with pytest.raises(ValueError, match="M must be a positive integer"):
        select(X, 0)
    with pytest.raises(ValueError, match=r"reshape\(-1, 1\)"):
        select(X[:, 0], 3)
    with pytest.raises(ValueError, match="candidates must be an integer >= M"):
        select(X, 5, candidates=4)
    with pytest.raises(TypeError, match="kernel must be a kernel"):
        select(X, 3, kernel="rbf")
    with pytest.raises(ValueError, match="select per output"):
        select(X, 3, lambda A, B=None, diag=False: torch.ones(A.shape[0]) if diag else torch.ones(2, A.shape[0], 1))
    assert select(np.asarray(X.cpu()), 3, method="random").shape == (3, 2)


def test_builders_take_the_greedy_start():
    """``ps.deep.init_inducing`` and ``build_deep_gp(init="greedy_variance")`` give the greedy rows under the kernel
    the first layer starts with; k-means and random rows are unchanged by the routing through ``select``."""
    from pyro_sparsegp.deep import build_deep_gp, init_inducing
    from pyro_sparsegp.inducing import kmeans
    from pyro_sparsegp.likelihoods import Gaussian

    X = torch.randn(80, 3)  # N = 4 M: the default pool is all of X
    k = RBF(3, lengthscale=torch.full((3,), 0.7), variance=torch.tensor(2.0))
    idx, _ = greedy_variance(X, 20, k)
    assert torch.equal(init_inducing(X, 20, "greedy_variance", kernel=k), X[idx])
    dgp = build_deep_gp(X, [2], Gaussian(0.1), num_inducing=20, init="greedy_variance", lengthscale=0.7, variance=2.0)
    assert torch.equal(dgp.layers[0].Z, X[idx])
    expected = kmeans(X, 9, iters=50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(init_inducing(X, 9), expected)
    with pytest.raises(ValueError, match="method must be one of"):
        init_inducing(X, 9, "grid")
