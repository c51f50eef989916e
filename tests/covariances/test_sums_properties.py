"""Properties of the covariances of sums of independent GPs (``pyro_sparsegp.covariances.sums``): the batched
block-diagonal of non-square blocks equals ``torch.block_diag`` of each batch member (one block: the block itself),
a cross-covariance or ``Kuf`` whose parts do not pair up with the kernels is refused instead of truncated, and the
error for an inducing sum under another kernel names ``SumKernel``."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp import covariances as cov
from pyro_sparsegp.covariances.sums import block_diagonal


def test_batched_block_diagonal_of_non_square_blocks_is_block_diag_per_member():
    torch.manual_seed(0)
    blocks = [torch.randn(3, 2, 4), torch.randn(1, 3, 1), torch.randn(3, 1, 2)]  # [L, M_k, M'_k], L broadcast
    K = block_diagonal(blocks)
    assert K.shape == (3, 6, 7)
    for i in range(3):
        torch.testing.assert_close(K[i], torch.block_diag(*(b[min(i, b.shape[0] - 1)] for b in blocks)))


def test_block_diagonal_of_one_block_is_the_block():
    A = torch.randn(2, 3, 5)
    torch.testing.assert_close(block_diagonal([A]), A)


def _sum(parts=2):
    k = ps.SumKernel(*[RBF(2, lengthscale=torch.tensor(0.5 + i)) for i in range(parts)])
    u = ps.InducingSum(*[torch.randn(3, 2) for _ in range(parts)])
    return k, u


def test_parts_that_do_not_pair_up_are_refused():
    k, u = _sum(2)
    k3, u3 = _sum(3)
    X = torch.randn(4, 2)
    assert cov.Kuu(u, k, _sum(2)[1]).shape == (6, 6)
    with pytest.raises(ValueError):  # a second set with one part more: no silent truncation
        cov.Kuu(u, k, u3)
    with pytest.raises(ValueError):  # three parts under two kernels
        cov.Kuf(u3, k, X)
    with pytest.raises(ValueError, match="3 parts"):
        cov.check(u3, k)


def test_an_inducing_sum_under_another_kernel_is_told_to_use_a_sum_kernel():
    _, u = _sum(2)
    with pytest.raises(cov.NoRuleError, match="needs a SumKernel"):
        cov.check(u, RBF(2))
