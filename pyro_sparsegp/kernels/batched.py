"""Kernel evaluation with leading batch dimensions.

We reuse :mod:`pyro.contrib.gp.kernels` (their hyperparameters are ``PyroParam`` s, so SVI trains them), but Pyro's
kernels accept only 2-D inputs. Deep GP layers receive sample-batched inputs ``[..., N, D]`` and per-output inducing
points ``[L, M, D]``, so this module evaluates the stationary kernels (``RBF``, ``Matern32``, ``Matern52``,
``Exponential``, ``RationalQuadratic``) directly from their hyperparameters with full broadcasting, and falls back to
the Pyro kernel itself (by flattening ``X``) for any other kernel.

Shapes: ``X`` ``[..., N, D]``, ``Z`` ``[..., M, D]`` (leading dimensions broadcast) ->  ``K`` ``[..., N, M]``.

**Accuracy of the distances.** The scaled squared distance is formed as ``|x|^2 + |z|^2 - 2 x.z`` (one matrix
product, the speed of the GEMM form), whose rounding error is about ``eps (|x|^2 + |z|^2)`` in units of the
lengthscale squared. Two things keep it exact enough in both dtypes:

* both inputs are **centred** on a common reference (the detached mean of the first argument's rows) before scaling,
  so an offset common to ``X`` and ``Z`` (years, Unix seconds) cancels exactly instead of entering ``|x|^2``;
* when the bound ``4 eps (max |x|^2 + max |z|^2)`` of that error still exceeds ``1e-8`` (float64) or ``1e-3``
  (float32) -- lengthscales tiny against the spread of the inputs -- the distances are computed from the
  **differences** ``(x - z) / l`` instead (exact to a relative rounding error, ``O(N M D)`` work in row chunks). The
  exponential kernel, which is not smooth in ``r^2`` at 0 (a rounding error ``d`` of ``r^2`` is an error
  ``sqrt(d)`` of ``r``), always takes this path.

The diagonal of ``k(X, X)`` (``Z`` omitted) is exactly the variance; squared distances that round below zero are
clamped (the RBF's bias form leaves them, within the bound above: a value at most ``e^{tol/2}`` times the variance).

**Feature selection.** A kernel acts on the features in its ``active_dims``; inputs may have more features than
that (``RBF(1, active_dims=[2])`` on ``[N, 3]`` inputs), but not fewer.
"""

from __future__ import annotations

import math

import torch
from pyro.contrib.gp import kernels as pk

from ..context import deferred

__all__ = ["kernel_matrix", "kernel_diag", "expected_input_dim", "required_features", "matern32"]


def _active(kernel):
    """The feature indices a kernel acts on (a list of ints), or ``None`` for a kernel without ``active_dims`` (or
    with a slice without an end: every feature). A slice selects input columns, as Pyro's kernels index with it."""
    ad = getattr(kernel, "active_dims", None)
    if ad is None:
        return None
    if isinstance(ad, slice):
        return list(range(ad.stop))[ad] if ad.stop is not None else None
    return [int(i) for i in ad]


def expected_input_dim(kernel) -> int | None:
    """Number of input features a kernel takes when it acts on all of them (its ``active_dims`` are Pyro's default
    ``0..input_dim-1``), or ``None`` when it selects other features with ``active_dims``."""
    ad = _active(kernel)
    if ad is None or ad == list(range(kernel.input_dim)):
        return kernel.input_dim
    return None


def required_features(kernel) -> int:
    """The fewest input features a kernel can take: one more than the largest index in its ``active_dims``
    (the least ``D`` of inputs ``X`` ``[..., N, D]``); an ``int``."""
    ad = _active(kernel)
    if not ad:
        return getattr(kernel, "input_dim", 0)
    return max(ad) + 1


def _slice(kernel, X):
    ad = _active(kernel)
    if ad is None or (ad == list(range(len(ad))) and (deferred.tracing() or X.shape[-1] == len(ad))):
        return X
    return X[..., ad]


def _check(kernel, X, Z):
    if deferred.tracing():  # the shapes of a traced graph are checked where it is built (context/deferred.py)
        return
    need = required_features(kernel)
    if X.shape[-1] < need:
        raise ValueError(
            f"kernel {type(kernel).__name__} acts on features {_active(kernel)} (input_dim={kernel.input_dim}), "
            f"but X has only {X.shape[-1]} (shape {tuple(X.shape)}); build the kernel with input_dim equal to the "
            "number of features, or select features with active_dims"
        )
    if Z is not None and Z.shape[-1] != X.shape[-1]:
        raise ValueError(
            f"inputs have different numbers of features: {X.shape[-1]} and {Z.shape[-1]} "
            f"(shapes {tuple(X.shape)} and {tuple(Z.shape)})"
        )


# the largest rounding error of a squared scaled distance the GEMM form may make, by dtype (a relative error of
# about half of it in the kernel's values)
_R2_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}
_CHUNK = 1 << 22  # elements of the [rows, M, D] differences formed at once on the exact path


def _hyper(kernel, name: str, event_dim: int = 0) -> torch.Tensor:
    """A hyperparameter laid out for ``[..., N, M]`` matrices (``event_dim=0``: ``[..., 1, 1]``) or for ``[..., N, D]``
    inputs (``event_dim=1``, a lengthscale: ``[..., 1, D]``).

    A ``PyroParam`` is used as it is. A ``PyroSample`` drawn under vectorised particles carries batch dimensions laid
    out like any Pyro site outside the data plate: ``[P, 1, ..., 1]`` ending with the data plate's singleton. Kernel
    matrices of a layer have the batch dimensions of ``f`` left of the data plate, so that singleton is dropped and
    matrix dimensions added. The prior's event shape tells the batch from the event (an isotropic lengthscale has
    event shape ``()``, an ARD one ``[D]``)."""
    v = getattr(kernel, name)
    samples = kernel.__dict__.get("_pyro_samples", {})
    if name not in samples or not torch.is_tensor(v) or v.dim() == 0:
        return v
    prior = getattr(kernel, "_priors", {}).get(name, samples[name])
    ev = len(getattr(prior, "event_shape", ())) if hasattr(prior, "event_shape") else min(v.dim(), event_dim)
    batch, event = v.shape[: v.dim() - ev], v.shape[v.dim() - ev :]
    if not batch:
        return v
    if batch[-1] != 1:
        raise ValueError(
            f"{name} has batch shape {tuple(batch)}: a kernel hyperparameter must be drawn outside the data plate "
            "(the layer draws it in sample_u; read it there first in a hand-written program)"
        )
    v = v.reshape(batch[:-1] + event)
    if event_dim == 1:
        return v.unsqueeze(-2) if ev == 1 else v[..., None, None]
    return v[..., None, None]


def _diag_var(var):
    """The variance of :func:`_hyper` (``[..., 1, 1]`` or scalar) for a diagonal ``[..., N]``."""
    return var[..., 0] if var.dim() >= 2 else var


def _centred(X, Z):
    """``(X - c, Z - c)`` with ``c`` the detached mean of the rows of ``X``: an offset common to both cancels."""
    c = X.detach().reshape(-1, X.shape[-1]).mean(0)  # [D]
    return X - c, Z - c


def _decide(exact: torch.Tensor) -> bool:
    """Read the exactness test ``exact`` (a boolean scalar tensor) back, or, inside
    :func:`~pyro_sparsegp.context.deferred.deferred_checks`, take the product form (unless the run switched to the exact
    differences) and flag a failed test on the device without reading it."""
    if deferred.tracing():  # a compiler traces: no read back (context/deferred.py)
        return True
    checks = deferred.active()
    if checks is None:
        return bool(exact)
    if checks.exact_kernels:
        return False
    checks.record(checks.INEXACT, ~exact)
    return True


def _gemm_is_exact(x2, z2, read=True):
    """Whether ``x2 + z2 - 2 x.z`` (scaled) errs by less than ``_R2_TOL``: the bound ``4 eps (max x2 + max z2)``.
    ``read=False``: the test as a boolean tensor, not read back."""
    if x2.numel() == 0 or z2.numel() == 0:
        return True if read else torch.ones((), dtype=torch.bool, device=x2.device)
    tol = _R2_TOL.get(x2.dtype, 1e-3)
    exact = 4 * torch.finfo(x2.dtype).eps * (x2.detach().max() + z2.detach().max()) <= tol
    return _decide(exact) if read else exact


def _rbf_gemm_is_exact(x2, z2):
    """:func:`_gemm_is_exact` weighted by what the RBF kernel makes of the error. At a pair ``(x, z)`` the GEMM form
    errs by at most ``4 eps (|x|^2 + |z|^2)`` in ``r^2``, which changes ``k = var exp(-r^2 / 2)`` by that much
    relative to ``k``; with ``a = |x|``, ``t = ||x| - |z|| <= r`` and ``d`` the distance from ``a`` to the nearest
    ``|z|`` (a sorted search), ``(a^2 + |z|^2) exp(-r^2 / 2) <= (a^2 + (a + t)^2) exp(-t^2 / 2)``, whose maximum over
    ``t >= d`` is at most ``(a^2 + (a + max(d, sqrt 2))^2)`` times ``exp(-d^2 / 2)`` when ``d >= sqrt 2`` (the factor
    decreases there) and times 1 otherwise. The largest such bound over the rows of ``x`` must be within the same
    tolerance as :func:`_gemm_is_exact`'s (now relative to ``var``). A far outlier (heavy-tailed inputs in float32)
    then no longer sends the whole batch to the differences: its kernel values are ``exp(-d^2 / 2)``-small."""
    if deferred.tracing() or x2.numel() == 0 or z2.numel() == 0:
        return True
    simple = _gemm_is_exact(x2, z2, read=False)
    if deferred.active() is None and bool(simple):  # the common case, without the search below
        return True
    a = x2.detach().reshape(-1).sqrt()
    b = z2.detach().reshape(-1).sqrt().sort().values
    i = torch.searchsorted(b, a).clamp(max=b.numel() - 1)
    d = torch.minimum((a - b[i]).abs(), (a - b[(i - 1).clamp(min=0)]).abs())
    far = d >= math.sqrt(2)
    decay = torch.where(far, torch.exp(-0.5 * d * d), torch.ones_like(d))
    bound = 4 * torch.finfo(x2.dtype).eps * (a * a + (a + d.clamp(min=math.sqrt(2))).pow(2)) * decay
    return _decide(simple | (bound.max() <= _R2_TOL.get(x2.dtype, 1e-3)))


def _sqdist_by_differences(Xc, Zc, ls):
    """``sum_d ((x_d - z_d) / l_d)^2`` ``[..., N, M]`` from the differences of the unscaled, uncentred inputs (exact
    to a relative rounding error: ``x - z`` rounds to nothing for close points), in chunks of rows of ``Xc``."""
    batch = torch.broadcast_shapes(Xc.shape[:-2], Zc.shape[:-2])
    Zc = Zc.expand(batch + Zc.shape[-2:])
    rows = max(1, _CHUNK // max(1, Zc.numel()))
    parts = [
        ((Xc[..., i : i + rows, None, :] - Zc[..., None, :, :]) / (ls.unsqueeze(-2) if ls.dim() >= 2 else ls))
        .pow(2)
        .sum(-1)
        for i in range(0, Xc.shape[-2], rows)
    ]
    if not parts:
        return Xc.new_zeros(batch + Xc.shape[-2:-1] + Zc.shape[-2:-1])  # no rows: [..., 0, M]
    return torch.cat(parts, -2) if len(parts) > 1 else parts[0]


def _set_diagonal_(T, value):
    """Overwrite the diagonal of a freshly computed ``T`` ``[..., M, M]`` in place, outside autograd (``O(M)``, no
    copy of ``T``). Used where the diagonal is ``value`` analytically and the computation left a rounding error
    there: the gradient autograd records for those entries is that of the unrounded expression, whose parts cancel
    (``d(-|x|^2 + x.x)/dx = 0``), so only the rounding is removed."""
    with torch.no_grad():
        T.diagonal(dim1=-2, dim2=-1).copy_(value)
    return T


def _scaled_sqdist(kernel, X, Z, square=False, exact=False):
    """Squared distances ``|x - z|^2 / l^2`` ``[..., N, M]``, clamped at zero; ``square``: ``Z`` is ``X`` (the
    diagonal is then exactly zero); ``exact``: always from the differences."""
    ls = _hyper(kernel, "lengthscale", 1)
    Xc, Zc = _centred(X, Z)
    Xs, Zs = Xc / ls, Zc / ls
    x2 = (Xs * Xs).sum(-1, keepdim=True)  # [..., N, 1]
    z2 = (Zs * Zs).sum(-1, keepdim=True)  # [..., M, 1]
    if not exact and _gemm_is_exact(x2, z2):
        r2 = (x2 - 2.0 * (Xs @ Zs.mT) + z2.mT).clamp(min=0)  # [..., N, M]
        return _set_diagonal_(r2, 0.0) if square else r2
    return _sqdist_by_differences(X, Z, ls)  # the raw inputs: x - z is exact for close points (0 for x = z)


def _distance(r2: torch.Tensor) -> torch.Tensor:
    """``r = sqrt(r2)`` ``[..., N, M]`` with a zero gradient at ``r = 0`` (where ``sqrt`` has none)."""
    return (r2 + torch.finfo(r2.dtype).tiny).sqrt() * (r2 > 0)


def matern32(r2: torch.Tensor) -> torch.Tensor:
    """The unit-variance Matérn-3/2 ``(1 + sqrt(3) r) exp(-sqrt(3) r)`` of scaled squared distances
    ``r2 = |x - x'|^2 / l^2`` ``[..., N, M]`` -> ``[..., N, M]`` (zero gradient of ``r`` at ``r = 0``). The package's
    one Matérn-3/2: Pyro's ``Matern32`` here (times its variance) and TICK's location kernel
    (:class:`~pyro_sparsegp.kernels.conv.TICK`; Dutordoir et al. 2020, sec. 3)."""
    s = math.sqrt(3) * _distance(r2)
    return (1 + s) * torch.exp(-s)


def _isotropic(kernel, r2):
    var = _hyper(kernel, "variance")
    if isinstance(kernel, pk.RBF):
        return var * torch.exp(-0.5 * r2)
    if isinstance(kernel, pk.RationalQuadratic):
        alpha = _hyper(kernel, "scale_mixture")
        return var * (1 + 0.5 / alpha * r2).pow(-alpha)
    if isinstance(kernel, pk.Matern32):
        return var * matern32(r2)
    r = _distance(r2)
    if isinstance(kernel, pk.Matern52):
        s = math.sqrt(5) * r
        return var * (1 + s + s * s / 3) * torch.exp(-s)
    if isinstance(kernel, pk.Exponential):
        return var * torch.exp(-r)
    return None


_ISOTROPIC = (pk.RBF, pk.RationalQuadratic, pk.Matern32, pk.Matern52, pk.Exponential)


def _rbf(kernel, X, Z, square=False):
    """``var * exp(-|x - z|^2 / (2 l^2))`` as one matrix product and one ``exp``: the biases ``log var - |x|^2/2``
    and ``-|z|^2/2`` ride in two extra columns of the product (``[x, b_x, 1] . [z, 1, b_z]``), so no ``[N, M]``
    bias matrix is formed and the backward pass reaches ``|x|^2`` and ``|z|^2`` through the same two products,
    not through reductions over ``[N, M]``: one ``[N, M]`` pass each way besides the products and the ``exp``.
    Inputs are centred first; where the GEMM form would not be exact enough the distances come from the
    differences (module docstring). ``square``: ``Z`` is ``X``, and the diagonal is set to the variance exactly."""
    ls = _hyper(kernel, "lengthscale", 1)
    Xc, Zc = _centred(X, Z)
    Xs, Zs = Xc / ls, Zc / ls
    x2 = (Xs * Xs).sum(-1, keepdim=True)  # [..., N, 1]
    z2 = (Zs * Zs).sum(-1, keepdim=True)  # [..., M, 1]
    var = _hyper(kernel, "variance")
    if not _rbf_gemm_is_exact(x2, z2):
        r2 = _sqdist_by_differences(X, Z, ls)  # the raw inputs: x - z is exact for close points (0 for x = z)
        return var * torch.exp(-0.5 * r2)
    bx = var.log() - 0.5 * x2  # [..., N, 1]
    lead = torch.broadcast_shapes(Xs.shape[:-1], bx.shape[:-1])
    Xa = torch.cat([Xs.expand(lead + Xs.shape[-1:]), bx.expand(lead + (1,)), x2.new_ones(()).expand(lead + (1,))], -1)
    Za = torch.cat([Zs, z2.new_ones(()).expand_as(z2), -0.5 * z2], -1)
    S = Xa @ Za.mT  # [..., N, M]: log var - |x - z|^2 / 2
    if square:  # log var exactly on the diagonal (rounding may leave ~eps |x|^2 there)
        _set_diagonal_(S, _diag_var(var).detach().log())
    return S.exp()


def kernel_matrix(kernel, X: torch.Tensor, Z: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-covariance ``k(X, Z)`` with broadcasting leading dimensions.

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel`.
    :param X: ``[..., N, D]``.
    :param Z: ``[..., M, D]`` or ``None`` (then ``Z = X``).
    :returns: ``[..., N, M]`` (a kernel batched over parts, :class:`~pyro_sparsegp.kernels.Separate`, gives
        ``[..., Q, N, M]`` through its ``batched_matrix``).
    """
    batched = getattr(type(kernel), "batched_matrix", None)
    if batched is not None:
        return batched(kernel, X, Z)
    _check(kernel, X, Z)
    Zi = X if Z is None else Z
    square = Z is None or Z is X
    if type(kernel) is pk.RBF:
        return _rbf(kernel, _slice(kernel, X), _slice(kernel, Zi), square)
    if type(kernel) in _ISOTROPIC:
        # the exponential kernel is not smooth in r^2 at 0 (r = sqrt(r2) turns a rounding error d of r2 into sqrt(d)):
        # its distances always come from the differences
        r2 = _scaled_sqdist(kernel, _slice(kernel, X), _slice(kernel, Zi), square, type(kernel) is pk.Exponential)
        return _isotropic(kernel, r2)
    # generic fallback: Pyro kernels take 2-D inputs only
    if Zi.dim() > 2:
        batch = torch.broadcast_shapes(X.shape[:-2], Zi.shape[:-2])
        Xb = X.expand(batch + X.shape[-2:]).reshape(-1, *X.shape[-2:])
        Zb = Zi.expand(batch + Zi.shape[-2:]).reshape(-1, *Zi.shape[-2:])
        K = torch.stack([_checked(kernel, kernel(x, z), (x.shape[0], z.shape[0])) for x, z in zip(Xb, Zb, strict=True)])
        return K.reshape(batch + K.shape[-2:])
    X2 = X.reshape(-1, X.shape[-1])
    K = _checked(kernel, kernel(X2, Zi), (X2.shape[0], Zi.shape[-2]))
    return K.reshape(X.shape[:-1] + Zi.shape[-2:-1])


def _checked(kernel, K: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``K`` if its shape is ``shape`` (a user kernel's ``forward(X [N, D], Z [M, D])`` must give ``[N, M]``, and
    ``forward(X, diag=True)`` ``[N]``), else ``ValueError``: a reshape would read a transposed block silently."""
    if tuple(K.shape) != tuple(shape):
        what = "k(X, diag=True)" if len(shape) == 1 else "k(X, Z)"
        hint = " (transposed: cdist(Z, X) instead of cdist(X, Z)?)" if tuple(K.shape) == tuple(shape)[::-1] else ""
        raise ValueError(f"{type(kernel).__name__}: {what} must have shape {list(shape)} for X [N, D] and Z [M, D], "
                         f"got {list(K.shape)}{hint}")
    return K


def kernel_diag(kernel, X: torch.Tensor) -> torch.Tensor:
    """Diagonal ``k(x_n, x_n)``: ``X`` ``[..., N, D]`` -> ``[..., N]`` (``[..., Q, N]`` for a kernel batched over
    parts, through its ``batched_diag``)."""
    batched = getattr(type(kernel), "batched_diag", None)
    if batched is not None:
        return batched(kernel, X)
    _check(kernel, X, None)
    if type(kernel) in _ISOTROPIC:
        var = _diag_var(_hyper(kernel, "variance"))
        return var.expand(torch.broadcast_shapes(var.shape, X.shape[:-1]))
    X2 = X.reshape(-1, X.shape[-1])
    return _checked(kernel, kernel(X2, diag=True), (X2.shape[0],)).reshape(X.shape[:-1])
