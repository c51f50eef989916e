"""Properties of :mod:`pyro_sparsegp.kernels.conv` besides the loops over patch pairs of ``test_conv_kernels.py``:
the documented defaults (stride 1, channels together, TICK's location lengthscale 3 after Shi et al. 2020, appendix
G.2, chunks of ``2^25`` entries), images given unflattened, the grid's refusals; the diagonal ``Kdiag`` equal to the
diagonal of ``Kff`` for every base kernel (the RBF through its fused function, others through ``kernel_matrix``),
batched images in ``Kff``, and the fused function's gradients for weights alone, two patches and a one-element
variance; the documented chunking (at most ``chunk_elements`` entries a chunk, recomputed in the backward pass only
when chunked and differentiated)."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32, Matern52

import pyro_sparsegp.kernels.conv as conv
from pyro_sparsegp.kernels import TICK, ConvKernel, output_shape, patch_locations, patches


def _loop(img, h, w, s):
    """Patches of one image ``[H, W, C]`` by slicing, row-major over the grid: ``[P, h*w*C]``."""
    return torch.stack([img[r : r + h, c : c + w].reshape(-1) for r in range(0, img.shape[0] - h + 1, s)
                        for c in range(0, img.shape[1] - w + 1, s)])


def test_the_documented_defaults():
    """Stride 1 and channels kept together in a patch by default; TICK's location lengthscale starts at 3 (Shi et al.
    2020, appendix G.2); a chunk holds 2^25 entries by default (128 MiB of float32)."""
    assert output_shape((5, 6), 2) == output_shape((5, 6), 2, 1) == (4, 5)
    X = torch.randn(3, 5 * 6 * 2)
    P = patches(X, (5, 6, 2), 2)
    assert P.shape == (3, 20, 8)
    for b in range(3):
        torch.testing.assert_close(P[b], _loop(X[b].reshape(5, 6, 2), 2, 2, 1))
    t = patch_locations((5, 6), 2)
    assert t.dtype == torch.get_default_dtype() and t.shape == (20, 2)
    torch.testing.assert_close(t, torch.tensor([[r, c] for r in range(4) for c in range(5)], dtype=t.dtype))
    tick = TICK(RBF(4), (5, 6), 2)
    assert float(tick.location_lengthscale.detach()) == pytest.approx(3.0) and tick.stride == (1, 1)
    assert conv.CHUNK_ELEMENTS * 4 == 128 * 2**20 and tick.chunk_elements == conv.CHUNK_ELEMENTS


def test_unflattened_images_give_the_same_patches():
    X = torch.randn(2, 3, 5, 4, 2)  # [..., H, W, C]
    for s in (1, 2):
        torch.testing.assert_close(patches(X, (5, 4, 2), 2, s), patches(X.reshape(2, 3, -1), (5, 4, 2), 2, s))
        torch.testing.assert_close(patches(X, (5, 4, 2), (3, 2), s, channels_as_patches=True),
                                   patches(X.reshape(2, 3, -1), (5, 4, 2), (3, 2), s, channels_as_patches=True))


@pytest.mark.parametrize("patch", [(6, 2), (2, 5), (6, 5)])
def test_a_patch_larger_than_the_image_in_either_direction_is_refused(patch):
    with pytest.raises(ValueError, match="larger than the image"):
        output_shape((5, 4), patch)


def test_tick_needs_locations_on_both_sides():
    k = TICK(RBF(4), (5, 5), 2)
    t = k.locations()
    for T1, T2 in ((None, t), (t, None), (None, None)):
        with pytest.raises(ValueError, match="TICK needs patch locations"):
            k.location_factor(T1, T2)


def _weighted(k):
    with torch.no_grad():
        k.weights.copy_(torch.linspace(0.5, 1.5, k.num_patches))
    return k


@pytest.mark.parametrize("base", [RBF, Matern32, Matern52])
@pytest.mark.parametrize("tick", [False, True], ids=["conv", "tick"])
def test_the_diagonal_is_the_diagonal_of_kff(base, tick, monkeypatch):
    """``Kdiag(X)`` = ``diag Kff(X)`` (each term of van der Wilk et al. 2017, eq. 10), ``X`` batched; the RBF goes
    through the fused function and only the RBF; ``Kff`` of batched images is ``Kff`` of each batch member."""
    fused = []
    real = conv._RBFPatchGramDiag.apply
    monkeypatch.setattr(conv._RBFPatchGramDiag, "apply", lambda *a: fused.append(1) or real(*a))
    b = base(4, variance=torch.tensor(1.3), lengthscale=torch.tensor([0.6, 0.9, 1.2, 1.5]))
    k = _weighted(TICK(b, (4, 5), 2, location_lengthscale=1.5) if tick else ConvKernel(b, (4, 5), 2))
    X = torch.randn(2, 3, 20)
    d, K = k.Kdiag(X), k.Kff(X)
    assert d.shape == (2, 3) and K.shape == (2, 3, 3)
    torch.testing.assert_close(d, K.diagonal(dim1=-2, dim2=-1))
    for i in range(2):
        torch.testing.assert_close(K[i], k.Kff(X[i]))
        torch.testing.assert_close(k(X[i], diag=True), d[i])
    assert (len(fused) > 0) == (base is RBF)


def _reference_diag(k, X):
    """``c^2 sum_{p,p'} w_p w_p' k_g(x[p], x[p']) [k_t]`` by Pyro's own base kernel on each image."""
    w, t = k.effective_weights(), k.locations(X.dtype)
    kt = k.location_factor(t, t)
    out = []
    for x in X:
        G = k.base_kernel(k.extract(x))
        out.append(w @ (G if kt is None else G * kt) @ w)
    return torch.stack(out)


@pytest.mark.float64
@pytest.mark.parametrize("case", ["weights_only", "two_patches", "one_element_variance"])
def test_fused_rbf_gradients_against_pyro(case):
    """The fused RBF diagonal's gradients against autograd through Pyro's RBF: of the weights alone (variance and
    lengthscale frozen), with two patches (``[2]`` weights), and with a one-element variance ``[1]`` (a layout Pyro
    accepts)."""
    var = torch.tensor([1.3]) if case == "one_element_variance" else torch.tensor(1.3)
    base = RBF(4, variance=var, lengthscale=torch.tensor(0.8))
    image = (3, 2) if case == "two_patches" else (3, 3)
    k = _weighted(TICK(base, image, 2, location_lengthscale=1.7))
    if case == "weights_only":
        for p in base.parameters():
            p.requires_grad_(False)
    X = torch.randn(4, image[0] * image[1])
    params = [p for p in k.parameters() if p.requires_grad]
    g = torch.linspace(-1.0, 1.0, 4)
    got, want = k.Kdiag(X), _reference_diag(k, X)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("base", [RBF, Matern32])
def test_images_go_in_chunks_recomputed_only_when_chunked_and_differentiated(base, monkeypatch):
    """``Kdiag`` holds at most ``chunk_elements`` entries a chunk (at least one image), recomputing each chunk in the
    backward pass (checkpointing) only when there are several chunks and gradients are on; the values do not depend
    on the chunks."""
    calls = []
    real = conv.checkpoint
    monkeypatch.setattr(conv, "checkpoint", lambda fn, *a, **kw: calls.append(a[0].shape[0]) or real(fn, *a, **kw))
    b = base(4, lengthscale=torch.tensor(0.9))
    k = _weighted(ConvKernel(b, (3, 3), 2))  # P = 4 patches: P^2 = 16 entries an image
    X = torch.randn(5, 9)
    want = _reference_diag(k, X)
    for chunk, sizes in ((1, [1] * 5), (16, [1] * 5), (32, [2, 2, 1]), (79, [4, 1]), (80, []), (10**6, [])):
        k.chunk_elements = chunk
        torch.testing.assert_close(k.Kdiag(X), want)
        assert calls == sizes, (chunk, calls)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(k.Kdiag(X), want)
        assert calls == []
