"""Properties of the covariance registry (``pyro_sparsegp.covariances.dispatch``) and of its front functions that
the dense checks of ``test_covariances.py`` do not reach: a rule registered again takes effect even after the pair
was looked up (the lookup cache is cleared), refused pairs are not listed as usable, :func:`check` also requires a
diagonal for the kernel, and ``Kuu``'s ``jitter`` adds ``jitter * I`` to every square ``Kuu`` of a batch (and nothing
to a cross-covariance). Oracles: dense ``k(Z, Z)`` and identity matrices."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp import covariances as cov
from pyro_sparsegp.inducing import InducingVariables


class Plain(InducingVariables):
    """A user's inducing variable with no built-in rule."""


class BareKernel:
    """A kernel type outside Pyro's hierarchy: no diagonal is registered for it (or for any parent)."""


def _rule(scale):
    class Scaled(cov.Rule):
        @staticmethod
        def Kuu(inducing, kernel, other=None):
            return scale * torch.eye(inducing.Z.shape[-2])

    return Scaled


def test_registering_a_pair_again_replaces_its_rule_after_a_lookup(registry):
    first, second = _rule(1.0), _rule(2.0)
    cov.register(Plain, RBF)(first)
    assert cov.lookup(Plain, RBF) is first  # now cached
    cov.register(Plain, RBF)(second)
    assert cov.lookup(Plain, RBF) is second
    torch.testing.assert_close(cov.Kuu(Plain(torch.randn(3, 2)), RBF(2)), 2.0 * torch.eye(3))


def test_refused_pairs_are_not_listed_as_usable():
    listed = cov.pairs()
    assert (ps.IndexedInducingPatches, ps.TICK) in listed and (ps.InducingPatches, ps.ConvKernel) in listed
    # refused: patches without locations under TICK, indexed patches under the plain convolutional kernel
    assert (ps.InducingPatches, ps.TICK) not in listed
    assert (ps.IndexedInducingPatches, ps.ConvKernel) not in listed
    with pytest.raises(ValueError, match="IndexedInducingPatches"):
        cov.lookup(ps.InducingPatches, ps.TICK).Kuu(None, None)


def test_check_requires_a_diagonal_for_the_kernel(registry):
    cov.register(Plain, BareKernel)(_rule(1.0))
    u = Plain(torch.randn(3, 2))
    cov.Kuu(u, BareKernel())  # the pair has a rule ...
    with pytest.raises(cov.NoRuleError, match="no diagonal"):  # ... but Kdiag could not be formed
        cov.check(u, BareKernel())


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "hyper_batch"])
def test_jitter_adds_to_the_diagonal_of_each_square_kuu_only(batched):
    """``Kuu(u, k, jitter=j) = Kuu(u, k) + j I`` for every matrix of the batch, including a batch of hyperparameter
    samples on the left (``[P, L, M, M]``); a cross-covariance ``Kuu(u, k, v)`` gets no jitter."""
    torch.manual_seed(0)
    k = RBF(2, lengthscale=torch.tensor(0.8))
    if batched:
        k.lengthscale = torch.tensor([0.5, 1.0]).reshape(2, 1, 1, 1)
    u, v = ps.InducingPoints(torch.randn(3, 4, 2)), ps.InducingPoints(torch.randn(3, 4, 2))
    K = cov.Kuu(u, k)
    assert K.shape == ((2, 3, 4, 4) if batched else (3, 4, 4))
    torch.testing.assert_close(cov.Kuu(u, k, jitter=0.25) - K, 0.25 * torch.eye(4).expand_as(K))
    torch.testing.assert_close(cov.Kuu(u, k, v, jitter=0.25), cov.Kuu(u, k, v))
    torch.testing.assert_close(cov.Kuu(u, k, jitter=0.0), K)
