"""Properties of the covariance rule of inducing points under a :class:`~pyro_sparsegp.kernels.Separate` kernel
(:mod:`pyro_sparsegp.covariances.separate`; per part the ``K_mm``, ``K_mn`` of Hensman, Matthews, Ghahramani 2015,
eq. 19): ``Kuu``, ``Kuf`` and the diagonal are each part's own Pyro kernel, with shared or per-part inducing inputs;
the rule's check refuses a number of sets other than the parts', and inducing inputs too narrow for any one part."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF, Matern32

import pyro_sparsegp.covariances as cov
from pyro_sparsegp.covariances.dispatch import lookup
from pyro_sparsegp.inducing import InducingPoints
from pyro_sparsegp.kernels import Separate


def _kernel():
    return Separate([RBF(2, variance=torch.tensor(1.3), lengthscale=torch.tensor(0.9)),
                     Matern32(2, variance=torch.tensor(0.6), lengthscale=torch.tensor([1.4, 0.7]))])


@pytest.mark.parametrize("per_part", [False, True], ids=["shared", "per_part"])
def test_covariances_are_each_parts_own(per_part):
    k = _kernel()
    Z = torch.randn(2, 4, 2) if per_part else torch.randn(4, 2)
    X = torch.randn(6, 2)
    ind = InducingPoints(Z)
    lookup(InducingPoints, Separate).check(ind, k)  # accepted
    Kuu, Kuf, d = cov.Kuu(ind, k, jitter=0.0), cov.Kuf(ind, k, X), cov.Kdiag(k, X)
    assert Kuu.shape == (2, 4, 4) and Kuf.shape == (2, 4, 6) and d.shape == (2, 6)
    for q, p in enumerate(k.kernels):
        Zq = Z[q] if per_part else Z
        torch.testing.assert_close(Kuu[q], p(Zq))
        torch.testing.assert_close(Kuf[q], p(Zq, X))
        torch.testing.assert_close(d[q], p(X, diag=True))


@pytest.mark.parametrize("sets", [1, 3])
def test_a_number_of_inducing_sets_other_than_the_parts_is_refused(sets):
    """``Z`` ``[K, M, D]`` for two parts: ``K = 2`` only (``K = 1`` is refused too: a shared set is ``[M, D]``)."""
    with pytest.raises(ValueError, match=rf"Z has {sets} sets of inducing inputs but the Separate kernel has 2 parts"):
        lookup(InducingPoints, Separate).check(InducingPoints(torch.randn(sets, 4, 2)), _kernel())


def test_inducing_inputs_too_narrow_for_one_part_are_refused():
    """One part reads feature 2 (``active_dims=[2]``): each part's own rule checks the width, so 2 features fail."""
    k = Separate([RBF(2), RBF(1, active_dims=[2])])
    rule = lookup(InducingPoints, Separate)
    rule.check(InducingPoints(torch.randn(4, 3)), k)  # 3 features: accepted
    with pytest.raises(ValueError, match="Z has 2 features but the kernel reads features up to index 2"):
        rule.check(InducingPoints(torch.randn(4, 2)), k)
