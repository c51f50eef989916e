"""Checks of user input at the public entry points, each failing with an error that names the problem and the fix.

The modules call these with one line each (:class:`~pyro_sparsegp.SVGP` and :class:`~pyro_sparsegp.SOLVEGP`
constructors, ``check_inputs`` of their ``model``/``guide``/``predict``), so the rules live in one place:

* data (``X``, ``y``) go through :mod:`pyro_sparsegp.checks.inputs` (tensors, numpy, lists, pandas; cast to the module's
  dtype and device) and must be finite; inducing inputs ``Z`` are converted the same way at construction, and a
  tensor ``Z`` must be in the default dtype (a mismatch gets a ``TypeError`` naming ``.to(dtype)``);
* inducing inputs are non-empty (``M >= 1``, ``D >= 1``); ``num_outputs`` is ``None`` or a positive integer;
  ``jitter`` is ``None`` or a finite number ``>= 0``;
* a kernel whose ``active_dims`` select features needs at least as many features as its largest index; a kernel on
  Pyro's default dims ``0..input_dim-1`` given more features warns once that the others are ignored;
* data sets have at least one row; ``subsample_size`` and ``num_data`` are positive integers with
  ``subsample_size <= N <= num_data``;
* inputs whose offset dwarfs their spread in the working dtype (float32 Unix seconds: spacing 128 at 1.7e9) lose
  their information in the cast, so :class:`InputPrecisionWarning` says to standardise them (once per cause); so does
  a column that rounding merged into one number (constant at a magnitude where the dtype's numbers are 2 or more
  apart), which the spread test cannot see: its spread is 0.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..context import deferred
from ..context.reporting import _RESET_HOOKS, _warn_once
from ..kernels import expected_input_dim, required_features
from .inputs import InputPrecisionWarning, _type_name, as_tensor, precision_lost

__all__ = ["check_tensor", "check_module_args", "check_orthogonal_inputs", "check_data",
           "check_positive_int"]

# warn when the spacing of floats at the inputs' magnitude exceeds this fraction of their spread: fewer than
# -log10(_RESOLUTION) = 3 significant digits relative to it (checks.inputs.precision_lost)
_RESOLUTION = 1e-3
_MIN_DIGITS = -math.log10(_RESOLUTION)


def check_tensor(x, name: str, dtype: torch.dtype | None = None, floating: bool = True) -> None:
    """``x`` is a tensor, floating point (if ``floating``) and of ``dtype`` (if given); else ``TypeError``.
    ``x`` may have any shape; it is not checked."""
    if not isinstance(x, torch.Tensor):
        fix = f"torch.as_tensor({name}, dtype={dtype or torch.get_default_dtype()})"
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(x)}; convert it with {fix}")
    if floating and not x.is_floating_point():
        target = dtype or torch.get_default_dtype()
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}; pass {name}.to({target})")
    if floating and dtype is not None and x.dtype != dtype:
        hint = _precision_hint(x, dtype)
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {dtype}; pass {name}.to({dtype}){hint}"
        )


def _collapsed(x: torch.Tensor) -> tuple[int, float] | None:
    """``(column, value)`` of the first column of ``x`` ``[..., N, D]`` (``N >= 2``) that is constant at a magnitude
    where its dtype's numbers are 2 or more apart (``|x| >= 2 / eps``: ``2^24`` in float32), or ``None``: a column
    whose values rounding merged into one (float32 Unix seconds within two minutes of each other are one number), as
    a constant column of such a size rarely is by design."""
    if x.numel() == 0 or x.dim() < 2 or x.shape[-2] < 2:
        return None
    with torch.no_grad():
        flat = x.detach().reshape(-1, x.shape[-1])
        lo, hi = torch.aminmax(flat, dim=0)
        hit = (lo == hi) & (lo.abs() >= 2 / torch.finfo(x.dtype).eps)
        if not bool(hit.any()):
            return None
        d = int(hit.nonzero()[0, 0])
        return d, float(lo[d])


def _precision_hint(x, dtype) -> str:
    if x.dim() >= 2 and precision_lost(x, dtype, _MIN_DIGITS):  # [..., N, D] only
        return (
            f" -- but standardise it first (subtract the mean, divide by the standard deviation, in {x.dtype}): "
            f"its offset dwarfs its spread and the cast to {dtype} would round the information away"
        )
    return ""


_LAST_CHECKED: dict = {}  # name -> key of the tensor last checked (the full X is passed at every step)
_RESET_HOOKS.append(_LAST_CHECKED.clear)


def check_precision(x: torch.Tensor, name: str) -> None:
    """Warn (:class:`InputPrecisionWarning`, once per name and dtype) when the offset of ``x`` dwarfs its spread in
    its own dtype. A tensor checked last time (same object, version, shape) is not scanned again."""
    if deferred.skip_reads():  # fit checked the data once, or a compiler traces (context/deferred.py)
        return
    key = (id(x), x._version, tuple(x.shape), x.dtype)
    if _LAST_CHECKED.get(name) == key:
        return
    _LAST_CHECKED[name] = key
    if x.is_floating_point() and x.dim() >= 2 and precision_lost(x, x.dtype, _MIN_DIGITS):
        _warn_once(
            ("precision", name, x.dtype),
            f"{name} ({x.dtype}) has an offset that dwarfs its spread: the spacing of {x.dtype} numbers at its "
            f"magnitude is more than {_RESOLUTION:g} of its range, so rounding has destroyed part of the data "
            "(e.g. Unix seconds in float32 are multiples of 128). Standardise the inputs in float64 before "
            "converting them (subtract the mean, divide by the standard deviation), or work in float64.",
            InputPrecisionWarning,
            stacklevel=4,
        )
    if x.is_floating_point() and (hit := _collapsed(x)) is not None:
        d, value = hit
        spacing = torch.finfo(x.dtype).eps * 2.0 ** math.floor(math.log2(abs(value)))
        _warn_once(
            ("collapsed", name, x.dtype),
            f"{name} ({x.dtype}): column {d} is the same number, {value:.7g}, in all {x.shape[-2]} rows, at a "
            f"magnitude where {x.dtype} numbers are {spacing:g} apart, so values closer than that were rounded into "
            "one (e.g. Unix seconds in float32) and the column carries no information. Subtract the offset or "
            "standardise the column in float64 before converting it, or work in float64; if the column is constant "
            "by design, drop it.",
            InputPrecisionWarning,
            stacklevel=4,
        )


def check_positive_int(value, name: str, allow_none: bool = True) -> None:
    """A ``ValueError`` unless ``value`` is an integer >= 1 (or ``None`` where allowed); no tensors, so shapes do not
    apply."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")


def _param_dtypes(module):
    return {p.dtype for p in module.parameters()} if module is not None else set()


def check_module_args(kernel, Z, likelihood=None, num_outputs=None, jitter=None) -> None:
    """Arguments of the :class:`~pyro_sparsegp.SVGP` constructor (see the module docstring): ``Z`` a floating tensor,
    ``[M, D]`` or ``[L, M, D]`` with ``M >= 1`` and ``D >= 1``; ``likelihood`` ``None`` or a
    :class:`~pyro_sparsegp.likelihoods.Likelihood` that defines ``distribution`` (the caller checks it first with
    :func:`~pyro_sparsegp.likelihoods.base.check_likelihood`: ``checks`` imports no likelihood, since the likelihoods'
    quadrature comes from ``linalg``, whose Cholesky is checked here)."""
    dtype = torch.get_default_dtype()
    check_tensor(Z, "Z", floating=True)
    if Z.dim() in (2, 3) and (Z.shape[-2] == 0 or Z.shape[-1] == 0):
        raise ValueError(f"Z must hold at least one inducing input of at least one feature, got shape {tuple(Z.shape)}")
    check_positive_int(num_outputs, "num_outputs")
    if jitter is not None and not (isinstance(jitter, numbers.Real) and 0 <= float(jitter) < float("inf")):
        raise ValueError(f"jitter must be None or a finite number >= 0, got {jitter!r}")
    for what, mod in (("kernel", kernel), ("likelihood", likelihood)):
        for d in _param_dtypes(mod):
            if d != Z.dtype:
                raise TypeError(
                    f"Z has dtype {Z.dtype} but the {what}'s parameters are {d}; build the kernel, the likelihood "
                    "and Z in one dtype (torch.set_default_dtype before building them) or pass Z.to(...)"
                )
        devices = {p.device for p in mod.parameters()} if mod is not None else set()
        if devices - {Z.device}:
            raise ValueError(
                f"Z is on {Z.device} but the {what}'s parameters are on {', '.join(map(str, devices))}: build the "
                "module from tensors on one device (Z.to(device)), or build it on the CPU and move it whole with "
                "module.to(device)"
            )
    if Z.dtype != dtype:
        raise TypeError(
            f"Z has dtype {Z.dtype} but the default dtype, in which the variational parameters are created, is "
            f"{dtype}; call torch.set_default_dtype({Z.dtype}) before building the kernel, likelihood and module, or "
            f"pass Z.to({dtype})"
        )
    if Z.dim() in (2, 3):
        D = Z.shape[-1]
        need = required_features(kernel)
        if need > D:
            raise ValueError(
                f"Z has {D} features but the kernel expects input_dim={kernel.input_dim} (it acts on features up to "
                f"index {need - 1}); build the kernel with input_dim={D} or select features with active_dims"
            )
        if expected_input_dim(kernel) is not None and kernel.input_dim < D:
            _warn_once(
                ("features", id(kernel), D),
                f"the kernel has input_dim={kernel.input_dim} and acts on features 0..{kernel.input_dim - 1} of the "
                f"{D} in Z; the others are ignored. If it should see every feature, build it with input_dim={D}.",
                UserWarning,
                stacklevel=4,
            )
        check_precision(Z, "Z")


def check_orthogonal_inputs(O, Z) -> None:
    """``O`` of :class:`~pyro_sparsegp.SOLVEGP`: a non-empty floating tensor in ``Z``'s dtype, ``[M2, D]`` or
    ``[L, M2, D]`` (``M2 >= 1``)."""
    check_tensor(O, "O", Z.dtype)
    if O.device != Z.device:
        raise ValueError(f"O is on {O.device} but Z on {Z.device}: pass both on one device (O.to(Z.device))")
    if O.dim() in (2, 3) and (O.shape[-2] == 0 or O.shape[-1] == 0):
        raise ValueError(f"O must hold at least one orthogonal inducing input, got shape {tuple(O.shape)}")


def check_data(module, X, y, subsample_size=None, num_data=None, purpose="model"):
    """Data given to ``model``/``guide`` (``purpose="model"``), ``analytic_elbo`` (``"elbo"``: ``y`` required) or
    ``predict`` (``"predict"``: no rows is fine), converted by :func:`~pyro_sparsegp.checks.inputs.as_tensor` (tensors,
    numpy, lists, pandas; floating data to the module's dtype and device, labels kept integer) and checked: rows,
    minibatch arguments. ``X`` ``[..., N, D]``, ``y`` ``[..., N]`` (or ``[..., N, L]``); returns ``(X, y)``. The layer
    checks the exact shapes against its ``D`` and ``L``."""
    dtype, device = module.inducing.dtype, module.inducing.device
    X = as_tensor(X, "X", dtype, device)
    if y is None and purpose == "elbo":
        raise ValueError("the bound needs the observations: pass y (analytic_elbo(X, y))")
    if y is not None:
        y = as_tensor(y, "y", dtype, device, floating=False)
    if purpose != "predict" and X.dim() >= 2 and X.shape[-2] == 0:
        raise ValueError(f"X has no rows (shape {tuple(X.shape)}); give at least one data point")
    N = X.shape[-2] if X.dim() >= 2 else None
    if subsample_size is not None:
        check_positive_int(subsample_size, "subsample_size", allow_none=False)
        if N is not None and subsample_size > N:
            raise ValueError(f"subsample_size={subsample_size} exceeds the {N} data points; use at most {N}")
    if num_data is not None:
        check_positive_int(num_data, "num_data", allow_none=False)
        if N is not None and num_data < N:
            raise ValueError(f"num_data={num_data} is smaller than the {N} points given; num_data is the data set size")
    check_precision(X, "X")
    return X, y


def check_predict(module, full: bool, batch_size, full_output_cov: bool = False) -> int | None:
    """``predict``'s options; returns the number of rows per chunk (default: ``[L, M, rows]`` within 2^24
    elements; ``None``, all rows in one chunk, while a compiler traces)."""
    if full_output_cov and module.num_outputs is None:
        raise ValueError("predict(X, full_output_cov=True) gives the [N, L, L] covariance of L outputs, and this "
                         "module has a single output; call predict(X) for its variance, or build it with "
                         "num_outputs=L")
    if full and getattr(module, "likelihood", None) is None:
        raise ValueError(
            "predict(X, full=True) needs a likelihood for the predictive distribution of y*, and this module has "
            "none; call predict(X) for the moments of q(f*), or build the module with a likelihood"
        )
    check_positive_int(batch_size, "batch_size")
    if batch_size is None and deferred.tracing():
        return None  # one chunk: a traced graph has no Python loop over the rows (context/deferred.py)
    if batch_size is None:
        M = module.inducing.num_inducing + (module.orthogonal.num_inducing if hasattr(module, "orthogonal") else 0)
        batch_size = max(1, (1 << 24) // (M * (getattr(module, "num_latent_gps", module.num_outputs) or 1)))
    return int(batch_size)
