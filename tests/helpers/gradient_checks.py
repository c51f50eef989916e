"""Gradients checked against the round-off floor of the backward pass, never against exactly zero.

A gradient that is zero in exact arithmetic (a parameter the objective is invariant to) comes out of a backward pass
through matrix products as round-off whose size depends on the BLAS, the thread count and the machine: ``-5e-14`` on
one, ``0.0`` on another. So a test names every parameter whose true gradient is zero, with the reason, and checks it
below a floor; every other parameter's gradient must rise above the same floor. The floor is relative: ``rel`` times
the largest gradient entry of the set (the size of the terms whose cancellation leaves the round-off), with ``rel`` a
few thousand machine epsilons of the dtype (``1e3 * eps``: ``2e-13`` in float64, ``1e-4`` in float32)."""

import torch


def round_off_floor(grads, dtype=None, rel=None) -> float:
    """``rel * max |g|`` over every entry of ``grads`` (tensors), ``rel = 1e3 * eps(dtype)`` by default."""
    dtype = dtype or next(iter(grads)).dtype
    rel = 1e3 * torch.finfo(dtype).eps if rel is None else rel
    return rel * max(float(g.abs().max()) for g in grads)


def assert_gradients(named_grads, zero=None, rel=None):
    """Every gradient in ``named_grads`` (``{name: grad}`` or pairs) is present and finite; those named in ``zero``
    (``{name: why its true gradient is zero}``) lie below :func:`round_off_floor`, every other one rises above it.
    Returns the floor."""
    grads = dict(named_grads)
    zero = dict(zero or {})
    unknown = set(zero) - set(grads)
    assert not unknown, f"named as zero-gradient but not among the parameters: {sorted(unknown)}"
    missing = sorted(n for n, g in grads.items() if g is None)
    assert not missing, f"no gradient reaches {missing}"
    bad = sorted(n for n, g in grads.items() if not torch.isfinite(g).all())
    assert not bad, f"non-finite gradients: {bad}"
    floor = round_off_floor(grads.values(), rel=rel)
    sizes = {n: float(g.abs().max()) for n, g in grads.items()}
    not_zero = {n: (sizes[n], why) for n, why in zero.items() if not sizes[n] <= floor}
    assert not not_zero, f"true gradient zero, but above the round-off floor {floor:.3g}: {not_zero}"
    vanished = {n: s for n, s in sizes.items() if n not in zero and not s > floor}
    assert not vanished, f"gradients at or below the round-off floor {floor:.3g}: {vanished}"
    return floor


def parameter_gradients(module):
    """``{name: p.grad}`` of a module's named parameters (``None`` where no gradient reached one)."""
    return {n: p.grad for n, p in module.named_parameters()}
