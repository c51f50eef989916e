"""Properties of the one-shot factor cache (``pyro_sparsegp.variational.cache``): keys of inputs are equal for the
same tensor at the same version, for equal values, and for two minibatches tagged by ``take`` from the same
``(X, idx)``, and differ otherwise (another version, other values, shape, dtype); ``FactorCache.once`` computes and
keeps for a producer, pops a matching entry for a consumer (so no entry is read twice), computes for a consumer that
finds nothing and keeps nothing unless told to leave it, and ``reset`` keeps one entry only."""

import copy
import pickle

import torch

from pyro_sparsegp.variational.cache import FactorCache, XKey, take


def test_xkey_equality():
    X = torch.randn(5, 2)
    k = XKey(X)
    assert k == XKey(X) and hash(k) == hash(XKey(X))
    assert k == XKey(X.clone())  # equal values, another tensor
    assert k != XKey(X + 1.0)
    assert k != XKey(X.to(torch.float32 if X.dtype == torch.float64 else torch.float64))
    assert k.__eq__(object()) is NotImplemented
    before = XKey(X)
    X.add_(0.0)  # an in-place write bumps the version: the same tensor is then another input
    assert before != XKey(X)


def test_take_tags_minibatches_of_the_same_selection():
    X, idx = torch.randn(10, 2), torch.tensor([1, 4, 7])
    a, b = take(X, idx), take(X, idx)
    torch.testing.assert_close(a, X[idx])
    assert a is not b and XKey(a) == XKey(b)
    b.add_(1.0)  # the tag says "same selection": equal even though b's values changed (documented shortcut)
    assert XKey(a) == XKey(b)
    other = take(X, torch.tensor([1, 4, 8]))
    assert XKey(a) != XKey(other)
    assert XKey(a) != XKey(torch.randn(3, 2))


def test_once_producer_and_consumer():
    c, calls = FactorCache(), []

    def compute(v):
        def f():
            calls.append(v)
            return v
        return f

    assert c.once("a", False, compute(1)) == 1 and "a" in c and len(c) == 1
    assert c.once("b", False, compute(2)) == 2 and len(c) == 2  # no reset: both kept
    assert c.once("a", True, compute(99)) == 1  # the consumer takes the producer's entry ...
    assert "a" not in c and calls == [1, 2]  # ... out, without computing
    assert c.once("a", True, compute(3)) == 3 and "a" not in c  # nothing there: computed, not kept
    assert c.once("c", True, compute(4), leave=True) == 4 and "c" in c  # left for the next consumer
    assert c.once("c", True, compute(5)) == 4
    assert c.once("d", False, compute(6), reset=True) == 6 and len(c) == 1 and "d" in c and "b" not in c


def test_put_clear_and_copies_hold_nothing():
    c = FactorCache()
    c.put({"x": 1, "y": 2})
    assert len(c) == 2 and "x" in c
    assert len(copy.deepcopy(c)) == 0 and len(pickle.loads(pickle.dumps(c))) == 0
    assert len(c) == 2
    c.clear()
    assert len(c) == 0
