"""The chunked patch sum of ``Kuf`` for inducing patches (``pyro_sparsegp.covariances.patches``) keeps its memory
contract (module docstring): each evaluation of the patch kernel holds at most ``kernel.chunk_elements`` entries,
every patch is evaluated exactly once per pass, the fewest passes the budget allows are made (one when everything
fits), and a pass is recomputed in the backward pass exactly when the sum is chunked (activation checkpointing), not
under ``torch.no_grad``. Checked by recording the blocks of the patch kernel; the values against the unchunked sum.
Also the width check of indexed patches under TICK."""

import math

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp import covariances as cov
from pyro_sparsegp.covariances import patches as patches_module

H, W = 5, 4  # 2x2 patches, stride 1: P = 4 * 3 = 12 patches of d = 4
P = 12


@pytest.fixture
def blocks(monkeypatch):
    """The sizes (entries) of the patch-kernel blocks evaluated by the patch sum, in call order."""
    sizes = []
    inner = patches_module.kernel_matrix

    def recording(kernel, X, Z=None):
        K = inner(kernel, X, Z)
        sizes.append(K.numel())
        return K

    monkeypatch.setattr(patches_module, "kernel_matrix", recording)
    return sizes


def _setup(chunk, L=2, S=2, M=3, B=4):
    torch.manual_seed(0)
    k = ps.ConvKernel(RBF(4, lengthscale=torch.tensor(0.9)), (H, W), 2, chunk_elements=chunk)
    Z = torch.randn(L, M, 4) if L else torch.randn(M, 4)
    X = torch.randn(S, 1, B, H * W) if S else torch.randn(B, H * W)
    return k, ps.InducingPatches(Z), X


@pytest.mark.parametrize("per_patch_budget", [1, 5, 12], ids=["one_patch", "five_patches", "all"])
@pytest.mark.parametrize("extra", [0, 7], ids=["exact", "slack"])
def test_each_block_fits_the_budget_and_covers_each_patch_once(blocks, per_patch_budget, extra):
    """Z [L=2, M=3, d], X [S=2, 1, B=4, D]: ``Kuf`` [2, 2, 3, 4], so one patch costs 2*2*3*4 = 48 entries."""
    per_patch = 48
    budget = per_patch * per_patch_budget + extra
    k, u, X = _setup(budget)
    with torch.no_grad():
        Kuf = cov.Kuf(u, k, X)
        ref = cov.Kuf(u, _setup(10**9)[0], X)
    assert Kuf.shape == (2, 2, 3, 4)
    torch.testing.assert_close(Kuf, ref)
    first = blocks[: len(blocks) - 1]  # the reference's single block is the last one
    assert sum(first) == per_patch * P  # every patch once
    assert max(first) <= budget
    assert len(first) == math.ceil(P / per_patch_budget)  # the fewest passes within the budget


def test_one_pass_when_a_single_patch_product_fits(blocks):
    """M = B = 1 and no batch: the whole ``[1, 1, P]`` sum fits a budget of ``P`` entries: one pass."""
    k, u, X = _setup(P, L=None, S=None, M=1, B=1)
    with torch.no_grad():
        assert cov.Kuf(u, k, X).shape == (1, 1)
    assert blocks == [P]


@pytest.mark.parametrize("chunked", [False, True])
def test_recomputed_in_the_backward_pass_only_when_chunked(blocks, chunked):
    k, u, X = _setup(48 * 5 if chunked else 10**9)
    k.weights = torch.linspace(0.5, 1.5, P).requires_grad_(True)
    out = cov.Kuf(u, k, X)
    forward = len(blocks)
    assert forward == (3 if chunked else 1)
    (g,) = torch.autograd.grad(out.sin().sum(), k.weights)
    assert len(blocks) == forward * (2 if chunked else 1)  # checkpointed passes run again
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    blocks.clear()
    with torch.no_grad():  # nothing to recompute: no checkpoint
        cov.Kuf(u, k, X)
    assert len(blocks) == forward


def test_indexed_patches_of_the_wrong_width_are_refused_under_tick():
    tick = ps.TICK(RBF(4), (H, W), 2)
    with pytest.raises(ValueError, match="features"):
        cov.check(ps.IndexedInducingPatches(torch.randn(3, 5), 3 * torch.rand(3, 2)), tick)
    cov.check(ps.IndexedInducingPatches(torch.randn(3, 4), 3 * torch.rand(3, 2)), tick)
