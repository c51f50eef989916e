"""Properties of :class:`~pyro_sparsegp.kernels.Separate` (one kernel per latent GP; Álvarez, Rosasco, Lawrence 2012,
section 4.2), each part checked against its own Pyro kernel: the Pyro-kernel interface (``k(X)``, ``k(X, Z)``,
``k(X, diag=True)``) gives the batch over the parts, the input width is the widest part's, and what is not a
non-empty list of kernels is refused by name."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32, Matern52

from pyro_sparsegp.kernels import Separate, expected_input_dim, required_features


def _parts():
    return [RBF(2, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.9)),
            Matern32(2, variance=torch.tensor(0.6), lengthscale=torch.tensor([1.4, 0.7])),
            Matern52(2, variance=torch.tensor(2.0), lengthscale=torch.tensor(1.1))]


def test_the_pyro_kernel_interface_is_the_batch_of_the_parts():
    parts = _parts()
    k = Separate(parts)
    X, Z = torch.randn(5, 2), torch.randn(4, 2)
    Kxx, Kxz, d = k(X), k(X, Z), k(X, diag=True)
    assert Kxx.shape == (3, 5, 5) and Kxz.shape == (3, 5, 4) and d.shape == (3, 5)
    for q, p in enumerate(parts):
        torch.testing.assert_close(Kxx[q], p(X))
        torch.testing.assert_close(Kxz[q], p(X, Z))
        torch.testing.assert_close(d[q], p(X, diag=True))
    torch.testing.assert_close(k.forward(X, Z, False), Kxz)


def test_the_input_width_is_the_widest_parts():
    """A part reading feature 4 (``active_dims=[4]``) beside parts on features 0-1: inputs need 5 features."""
    k = Separate([RBF(2), RBF(1, active_dims=[4]), Matern32(2)])
    assert len(k) == 3 and k.input_dim == required_features(k) == 5 and expected_input_dim(k) == 5
    X = torch.randn(6, 5)
    torch.testing.assert_close(k(X, diag=True)[1], torch.ones(6))
    torch.testing.assert_close(k(X)[1], RBF(1)(X[:, 4:]))


def test_inputs_shared_by_the_parts_or_one_set_each():
    """``X`` ``[..., K, N, D]`` with ``K = 1`` (every part reads the same inputs) or ``K = Q`` (part ``q`` reads set
    ``q``), batched or not; any other ``K`` is refused by name."""
    parts = _parts()
    k = Separate(parts)
    X1, XQ, Z = torch.randn(1, 5, 2), torch.randn(3, 5, 2), torch.randn(4, 2)
    for X, pick in ((X1, lambda q: X1[0]), (XQ, lambda q: XQ[q])):
        K, d = k(X, Z), k(X, diag=True)
        assert K.shape == (3, 5, 4) and d.shape == (3, 5)
        for q, p in enumerate(parts):
            torch.testing.assert_close(K[q], p(pick(q), Z))
            torch.testing.assert_close(d[q], p(pick(q), diag=True))
    Xb = torch.randn(2, 1, 5, 2)  # a batch of shared inputs: [2, Q, N, M]
    Kb = k(Xb, Z)
    assert Kb.shape == (2, 3, 5, 4)
    for b in range(2):
        for q, p in enumerate(parts):
            torch.testing.assert_close(Kb[b, q], p(Xb[b, 0], Z))
    with pytest.raises(ValueError, match=r"must be 1 \(shared\) or 3"):
        k(torch.randn(2, 5, 2), Z)


@pytest.mark.parametrize("bad, what", [
    (RBF(2), "a list of kernels"),  # one kernel, not a list
    (torch.nn.ModuleList([RBF(2), RBF(2)]), "a list of kernels"),  # a module (Separate wraps the list itself)
    ([], "non-empty list"),
    ([RBF(2), "RBF"], "non-empty list"),
])
def test_what_is_not_a_list_of_kernels_is_refused(bad, what):
    with pytest.raises(TypeError, match=what):
        Separate(bad)
