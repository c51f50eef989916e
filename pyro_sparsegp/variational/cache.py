"""The value-keyed cache that lets a layer's guide and model share one factorisation per ELBO evaluation.

Pyro runs the guide, then replays the model with the guide's values and the same parameters. A strategy
(:mod:`pyro_sparsegp.variational.strategy`) computes its factors (``Kuu``, its Cholesky factor, the projections of
the inputs) in the guide and leaves them here; the model takes them out if the key matches (inputs, parameter
storage and versions, the identity of every sampled hyperparameter:
:func:`~pyro_sparsegp.context.composition.values_key`), and computes its own otherwise. An entry is read at most once,
so nothing stale is ever read twice. No paper equation: bookkeeping.
"""

from __future__ import annotations

import torch

from ..context import deferred

__all__ = ["XKey", "FactorCache", "take"]


class XKey:
    """Cache key of an input tensor, equal for the same inputs in the guide and in the model. A minibatch ``X[idx]``
    is a new tensor in each program (in the modules' own ``model``/``guide`` it carries the tag of ``(X, idx)``
    given by :func:`take`; in a hand-written program it does not), so two keys are equal when they hold the same
    tensor at the same version, carry the same tag, or hold equal values (``torch.equal``: ``O(B D)``, nothing
    beside the ``O(M^2 B)`` that a cache hit saves). Only the entries of one input live in the cache at a time, so
    this is never ambiguous. ``X`` any shape ``[..., B, D]``. Bookkeeping: implements no paper equation."""

    __slots__ = ("x", "version", "tag", "_hash")

    def __init__(self, X):
        self.x, self.version, self.tag = X, X._version, getattr(X, "_psgp_key", None)
        # a traced X has symbolic sizes, which do not hash (and a traced cache never hits: values_key)
        self._hash = id(X) if deferred.tracing() else hash((tuple(X.shape), X.dtype, X.device))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if not isinstance(other, XKey):
            return NotImplemented
        if self.x is other.x:
            return self.version == other.version
        if self.tag is not None and self.tag == other.tag:
            return True
        a, b = self.x, other.x
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def take(X: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The minibatch ``X[..., idx, :]`` ``[..., B, D]``, tagged with ``(X, idx)`` so that the guide's and the model's
    minibatches have equal :class:`XKey` s without comparing values. Bookkeeping: implements no paper equation."""
    Xb = X[..., idx, :]
    Xb._psgp_key = (id(X), X._version, tuple(X.shape), id(idx))
    return Xb


class FactorCache:
    """A one-shot dictionary: :meth:`once` computes an entry and keeps it (the guide, ``consume=False``) or takes a
    matching entry out (the model, ``consume=True``). Holds tensors of any shape. Bookkeeping: it spares the model
    a second factorisation of what the guide computed, and implements no paper equation."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries = {}

    def once(self, key, consume: bool, compute, reset: bool = False, leave: bool = False):
        """The entry for ``key``: popped if ``consume`` and present, else ``compute()``; kept when not ``consume``
        (``reset=True``: the cache then holds this entry only, as for the factors of ``Kuu``, which every later
        entry of the same evaluation shares). ``leave=True``: a consumer that computed the entry itself leaves it
        for the next consumer of the same program (the model's prior, computed before the model's factors).
        Returns what ``compute`` returns, of any shape: the cache neither reads nor changes shapes."""
        if consume and key in self.entries:
            return self.entries.pop(key)
        out = compute()
        if consume and leave:
            self.entries[key] = out
        elif not consume:
            if reset:
                self.entries = {key: out}
            else:
                self.entries[key] = out
        return out

    def put(self, entries: dict) -> None:
        """Replace the cache by ``entries`` (factors computed together, left for several consumers), kept as given:
        the cache neither reads nor changes their shapes."""
        self.entries = dict(entries)

    def clear(self) -> None:
        """Drop every entry (after a closed-form bound or a prediction, so no factor outlives its evaluation). No
        tensors, so shapes do not apply."""
        self.entries = {}

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getstate__(self):
        return {}  # factors are never saved with a module

    def __setstate__(self, state):
        self.entries = {}

    def __deepcopy__(self, memo):
        return FactorCache()
