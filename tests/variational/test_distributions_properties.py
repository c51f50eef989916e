"""Properties of the variational families (``pyro_sparsegp.variational.distributions``): the natural parameters of
``N(m, L L^T)`` against a dense inverse (``theta1 = S^{-1} m``, ``theta2 = -S^{-1} / 2``), ``from_natural`` as
their inverse (a round trip to the same mean and Cholesky factor, batched), ``GaussianQ``'s layout for one and
several outputs, ``set`` and the registry of live families."""

import copy

import torch

from pyro_sparsegp.variational.distributions import GaussianQ, from_natural, live_gaussian_families, to_natural


def _gaussian(batch=(), M=4):
    torch.manual_seed(0)
    A = torch.randn(batch + (M, M))
    L = torch.linalg.cholesky(A @ A.mT + M * torch.eye(M))  # a well-conditioned lower factor
    return torch.randn(batch + (M,)), L


def test_natural_parameters_against_a_dense_inverse():
    m, L = _gaussian((3,))
    theta1, theta2 = to_natural(m, L)
    S_inv = torch.linalg.inv(L @ L.mT)
    torch.testing.assert_close(theta1, (S_inv @ m.unsqueeze(-1)).squeeze(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theta2, -0.5 * S_inv, rtol=1e-4, atol=1e-6)


def test_natural_parameters_of_one_unbatched_gaussian():
    m, L = _gaussian()
    theta1, theta2 = to_natural(m, L)
    S_inv = torch.linalg.inv(L @ L.mT)
    torch.testing.assert_close(theta1, S_inv @ m, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theta2, -0.5 * S_inv, rtol=1e-4, atol=1e-6)


def test_from_natural_inverts_to_natural():
    m, L = _gaussian((2,))
    m2, L2 = from_natural(*to_natural(m, L))
    torch.testing.assert_close(m2, m, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(L2, L, rtol=1e-3, atol=1e-4)


def test_from_natural_of_dense_natural_parameters():
    """From ``(S^{-1} m, -S^{-1}/2)`` formed densely: the mean ``m`` and the lower Cholesky factor of ``S`` (the
    symmetric part of ``theta2`` counts: an antisymmetric addition changes nothing)."""
    m, L = _gaussian()
    S = L @ L.mT
    P = torch.linalg.inv(S)
    skew = torch.randn(4, 4)
    m2, L2 = from_natural(P @ m, -0.5 * P + 0.1 * (skew - skew.mT))
    torch.testing.assert_close(m2, m, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(L2 @ L2.mT, S, rtol=1e-3, atol=1e-4)
    assert torch.equal(L2, L2.tril()) and bool((L2.diagonal() > 0).all())


def test_gaussian_q_layouts():
    q = GaussianQ(5)
    d = q()
    assert d.batch_shape == () and d.event_shape == (5,)
    torch.testing.assert_close(d.covariance_matrix, torch.eye(5))
    tril = torch.eye(5) * 2.0
    qL = GaussianQ(5, num_outputs=3, scale_tril=tril)
    d = qL()
    assert d.batch_shape == (3, 1) and d.event_shape == (5,)
    torch.testing.assert_close(d.covariance_matrix, 4.0 * torch.eye(5).expand(3, 1, 5, 5))
    assert qL.u_scale_tril.shape == (3, 5, 5) and qL.u_loc.shape == (3, 5)


def test_mean_only_family_takes_its_scale_and_broadcasts_it_over_outputs():
    q = GaussianQ(4, num_outputs=2, learn_scale=False)
    assert not hasattr(q, "u_scale_tril") or "u_scale_tril" not in dict(q.named_parameters())
    L = torch.eye(4) * 3.0
    d = q(L)
    assert d.batch_shape == (2, 1)
    torch.testing.assert_close(d.covariance_matrix, 9.0 * torch.eye(4).expand(2, 1, 4, 4))
    assert q not in live_gaussian_families()


def test_set_overwrites_and_copies_register():
    q = GaussianQ(3)
    m, L = _gaussian(M=3)
    q.set(m, L)
    torch.testing.assert_close(q.u_loc, m)
    torch.testing.assert_close(q.u_scale_tril, L)
    m.add_(1.0)  # set keeps a copy
    assert not torch.allclose(q.u_loc, m)
    q.set(m)  # the scale stays
    torch.testing.assert_close(q.u_scale_tril, L)
    q2 = copy.deepcopy(q)
    live = live_gaussian_families()
    assert any(x is q for x in live) and any(x is q2 for x in live)
