"""The one input-conversion path of the package: every public entry point (``fit``, ``predict``, ``model``/``guide``,
``analytic_elbo``, ``fit_ep``, the deep and convolutional modules, the inducing inputs of a constructor) turns what
the user gave into tensors here, so the same inputs work everywhere and fail with the same words.

Accepted: ``torch.Tensor``, numpy arrays, (nested) lists and tuples of numbers, and anything with ``to_numpy()``
(a pandas ``DataFrame`` or ``Series``). Floating (and boolean) data are cast to the module's dtype and device;
integer labels keep their integer dtype. Errors name the sizes as the user knows them: ``N`` rows of ``X``, ``D``
features, ``M`` inducing inputs, ``L`` outputs, ``K`` classes.

A cast to a lower precision (float64 data into a float32 model) warns with
:class:`InputPrecisionWarning` when it keeps less than half of the significant digits
that the data carried relative to their spread: float32 Unix seconds (offset 1.7e9, spacing 128 s) lose everything
within a day, while standardised data lose nothing that float32 could hold.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..context import deferred
from ..context.reporting import _warn_once

__all__ = ["as_tensor", "as_targets", "digits_kept", "precision_lost", "InputPrecisionWarning", "fill_missing",
           "check_missing"]


class InputPrecisionWarning(UserWarning):
    """The inputs' offset dwarfs their spread in the working dtype: their information is lost to rounding
    (:func:`precision_lost`); ``ps.checks.InputPrecisionWarning``."""


def _type_name(x) -> str:
    """What a wrong argument is, for an error message: ``module.Class`` (``"Tensor"`` for a tensor)."""
    return f"{type(x).__module__}.{type(x).__name__}" if not isinstance(x, torch.Tensor) else "Tensor"


def digits_kept(x: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """Significant digits of ``x`` ``[..., N, D]`` relative to each column's spread, ``(before, after)`` a cast to
    ``dtype`` (the worst column): ``log10(spread / (eps * |x|max))`` with the source and the target ``eps``; the
    ``before`` value is capped at what ``dtype`` can hold at all (``-log10(eps_target)``). Columns of constants (or
    with an infinite value) do not count; ``(inf, inf)`` when no column varies. Input checking: implements no paper
    equation."""
    if x.numel() == 0 or not x.is_floating_point():
        return math.inf, math.inf
    flat = x.detach().reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.detach().reshape(-1, 1)
    lo, hi = torch.aminmax(flat.double(), dim=0)
    spread, mag = hi - lo, torch.maximum(lo.abs(), hi.abs())
    keep = (spread > 0) & spread.isfinite()  # a column with an infinite value has no spread to compare with
    if not bool(keep.any()):
        return math.inf, math.inf
    ratio = float((mag[keep] / spread[keep]).max())  # the column whose offset dwarfs its spread most
    eps_src, eps_dst = torch.finfo(x.dtype).eps, torch.finfo(dtype).eps
    cap = -math.log10(eps_dst)
    before = min(cap, -math.log10(eps_src * max(ratio, 1e-300)))
    after = -math.log10(eps_dst * max(ratio, 1e-300))
    return before, after


def precision_lost(x: torch.Tensor, dtype: torch.dtype, min_digits: float | None = None) -> bool:
    """Whether ``x`` ``[..., N, D]`` in ``dtype`` keeps too few significant digits relative to the spread of its worst
    column (:func:`digits_kept`: its offset dwarfs its spread): fewer than ``min_digits`` (a fixed threshold, e.g.
    ``3``: the spacing of ``dtype``'s numbers at the column's magnitude is more than ``1e-3`` of its range), or, with
    ``min_digits=None``, fewer than half of those that ``x`` carries in its own dtype (the test of a cast). Columns of
    constants do not count. The one precision test of the package: :func:`as_tensor`'s cast warning and
    :func:`pyro_sparsegp.checks.validation.check_precision` both use it. Input checking: implements no paper
    equation."""
    before, after = digits_kept(x, dtype)
    return after < (before / 2 if min_digits is None else min_digits)


def _warn_cast(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """Warn once per (name, dtypes) when casting ``t`` to ``dtype`` keeps less than half its significant digits."""
    if torch.finfo(dtype).eps <= torch.finfo(t.dtype).eps:
        return
    if precision_lost(t, dtype):
        before, after = digits_kept(t, dtype)
        _warn_once(
            ("cast", name, t.dtype, dtype),
            f"{name} ({t.dtype}) is cast to the module's {dtype}, which keeps {max(after, 0):.1f} of its "
            f"{before:.1f} significant digits (relative to its spread): its offset dwarfs its spread. Standardise "
            f"{name} in {t.dtype} first (subtract the mean, divide by the standard deviation) or build the module in "
            f"{t.dtype}.",
            InputPrecisionWarning,
            stacklevel=4,
        )


def as_tensor(x, name: str, dtype: torch.dtype | None = None, device=None, floating: bool = True) -> torch.Tensor:
    """``x`` as a tensor on ``device`` (default: where a tensor is; numpy data and lists on the default device, as
    ``torch.tensor`` puts them, so that under ``torch.set_default_device`` they meet the modules built there):
    floating and boolean data in ``dtype`` (default: the default dtype); integer data too if ``floating``, else kept
    as integers (labels). Same shape as ``x``. Raises ``TypeError`` naming what was given and how to convert it.
    Input conversion: implements no paper equation."""
    if not isinstance(x, torch.Tensor):
        if hasattr(x, "to_numpy") and not isinstance(x, np.ndarray):  # pandas DataFrame / Series
            x = x.to_numpy()
        if isinstance(x, (np.ndarray, list, tuple, int, float, np.number)):
            arr = np.asarray(x)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"{name} must hold numbers; got a {type(x).__name__} of dtype {arr.dtype}")
            arr = np.ascontiguousarray(arr)
            if not arr.flags.writeable:  # pandas' copy-on-write views: torch cannot share read-only memory
                arr = arr.copy()
            x = torch.from_numpy(arr)
            if device is None:
                device = torch.get_default_device()
        else:
            raise TypeError(
                f"{name} must be a torch.Tensor, a numpy array, a list of numbers or a pandas DataFrame/Series, got "
                f"{_type_name(x)} (data on disk: fit(module, MemmapDataset(...)))"
            )
    if x.is_complex():
        raise TypeError(f"{name} must be real, got dtype {x.dtype}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    target = dtype if (x.is_floating_point() or x.dtype == torch.bool or floating) else x.dtype
    if x.is_floating_point() and target != x.dtype:
        _warn_cast(x, name, target)
    if target == x.dtype and (device is None or x.device == torch.device(device)):
        return x
    return x.to(device=device if device is not None else x.device, dtype=target)


def as_targets(y: torch.Tensor, N: int, num_outputs: int | None, per_output: bool, likelihood=None) -> torch.Tensor:
    """``y`` in the layout a layer takes: ``[..., N]`` for one output or one observation per row read by several
    latent functions (``per_output`` False), ``[..., N, L]`` for ``L = num_outputs`` element-wise outputs. A single
    output given as ``[N, 1]`` (the GPflow and scikit-learn column habit) becomes ``[N]``. Raises ``ValueError``
    naming ``N`` and ``L``, and for a ``likelihood`` of several latent functions what its ``y`` is (class labels
    for a multi-class one, one value per row otherwise). Input checking: implements no paper equation."""
    want_cols = num_outputs if per_output else None
    if want_cols is None and y.dim() >= 2 and y.shape[-2:] == (N, 1):
        y = y[..., 0]
    if want_cols is None:
        if y.dim() >= 1 and y.shape[-1] == N:
            return y
        name = type(likelihood).__name__
        classes = getattr(likelihood, "num_classes", None) is not None
        what = ("one class label per row of X" if classes else
                f"one value per row of X, which the {num_outputs} latent functions of {name} read together"
                if num_outputs and not per_output else "one value per row of X")
        hint = ""
        if y.dim() == 2 and y.shape[0] == N and y.shape[1] > 1:  # L columns for a layer of one output (or labels)
            hint = ("; give the labels 0..K-1, not one-hot rows" if classes else
                    f"; {name}'s {num_outputs} latent functions are not outputs: give one y per row, or "
                    f"model {y.shape[1]} outputs with num_outputs={y.shape[1]} and a one-latent likelihood"
                    if num_outputs and not per_output else
                    f"; for {y.shape[1]} outputs build the layer with num_outputs={y.shape[1]}")
        raise ValueError(f"y must be [N] = [{N}] ({what}; [N, 1] is accepted too), got shape {tuple(y.shape)}{hint}")
    if y.dim() >= 2 and y.shape[-2:] == (N, want_cols):
        return y
    raise ValueError(f"y must be [N, L] = [{N}, {want_cols}] (N rows of X, L = num_outputs = {want_cols} outputs), "
                     f"got shape {tuple(y.shape)}")


def fill_missing(y: torch.Tensor):
    """Missing outputs: ``y`` ``[..., L, B]`` (or ``[..., N, L]``, any layout) with ``NaN`` where an output is not
    observed, as ``(filled, mask)``: ``mask`` is ``True`` where ``y`` is observed, and ``filled`` holds an observed
    value of ``y`` (the lower median of the observed entries, hence in the likelihood's support) in place of each
    ``NaN``, so that a masked term and its gradient stay finite. ``(y, None)`` when nothing is missing (integer
    labels never are); inside :func:`~pyro_sparsegp.context.deferred.deferred_checks` (``fit`` on a GPU) the mask is
    always formed, so that nothing is read back. Same shapes as ``y``. Input handling: the masked terms drop out of the
    bound, implementing no equation of their own."""
    if not y.is_floating_point():
        return y, None
    missing = torch.isnan(y)
    if not deferred.skip_reads() and not bool(missing.any()):
        return y, None
    return torch.where(missing, y.nanmedian(), y), ~missing


def check_missing(y: torch.Tensor) -> torch.Tensor:
    """``y`` ``[..., N, L]`` of ``L`` outputs, with ``NaN`` marking an output that is not observed: raise
    ``ValueError`` naming the first row with no observed output (nothing of it enters the bound), else return ``y``
    filled as :func:`fill_missing` fills it (for the likelihood's support check). Input checking: implements no
    paper equation."""
    if not y.is_floating_point():
        return y
    empty = torch.isnan(y).all(-1)  # [..., N]
    if not deferred.skip_reads() and bool(empty.any()):
        row = int(empty.reshape(-1, empty.shape[-1]).any(0).nonzero()[0])
        raise ValueError(f"y row {row} has no observed output (all {y.shape[-1]} of its outputs are NaN): NaN marks a "
                         "missing output, and a row must observe at least one; drop the rows with nothing observed "
                         "(e.g. keep = ~y.isnan().all(-1); X, y = X[keep], y[keep])")
    return fill_missing(y)[0]
