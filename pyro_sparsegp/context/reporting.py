"""Where a warning comes from: the layer and the training step it was raised in, and the user's line.

A warning raised deep inside a run ("cholesky: matrix of size 30 was not numerically positive definite ...") is
useful only if it says *which* layer (a deep GP has several of the same size) and *when* (``fit``'s step), and
points at the user's code, not at the library line that noticed. So every warning of the package goes through
:func:`warn`, which

* appends ``[layer 'NAME', fit step K]`` from two context variables: the innermost layer whose method is running
  (set by :func:`~pyro_sparsegp.context.composition.layer_method` for every layer method, and by ``fit`` for its module
  as a whole) and ``fit``'s current step (:func:`at_step`);
* sets ``stacklevel`` to the first frame outside ``pyro_sparsegp``, ``pyro`` and ``torch``: the user's ``fit(...)``
  or ``svi.step(...)`` call, or the user's own model function that called a layer method.

No tensors, no paper equation: plumbing for messages (every function here takes and returns strings and ints, so shapes
do not apply).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings

import pyro
import torch

__all__ = ["warn", "in_layer", "at_step", "location", "current_layer", "current_step", "user_stacklevel",
           "family_layer"]

_REPORTED: set = set()  # the causes reported by :func:`_warn_once` (``linalg.reset_warnings`` forgets them)
_RESET_HOOKS: list = []  # other modules' memories of what they checked or reported (cleared with _REPORTED)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("pyro_sparsegp_layer", default=None)
_STEP: contextvars.ContextVar = contextvars.ContextVar("pyro_sparsegp_step", default=None)
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (sys.modules[__name__.partition(".")[0]], pyro, torch))


@contextlib.contextmanager
def in_layer(name: str | None):
    """Warnings raised inside name the layer ``name`` (``None``: leave the current one). No tensors, so shapes do not
    apply."""
    if name is None:
        yield
        return
    token = _LAYER.set(name)
    try:
        yield
    finally:
        _LAYER.reset(token)


@contextlib.contextmanager
def at_step(step: int | None, what: str = "fit step"):
    """Warnings raised inside name the step (``what`` and ``step``; ``None``: no step). No tensors, so shapes do not
    apply."""
    token = _STEP.set(None if step is None else f"{what} {step}")
    try:
        yield
    finally:
        _STEP.reset(token)


def current_layer() -> str | None:
    """The name of the innermost layer whose method is running, or ``None``. No tensors, so shapes do not apply."""
    return _LAYER.get()


def current_step() -> str | None:
    """``"fit step K"`` inside ``fit``'s step ``K``, or ``None``. No tensors, so shapes do not apply."""
    return _STEP.get()


def location(layer: str | None = None) -> str:
    """``"layer 'NAME', fit step K"`` (the parts that are known; ``layer`` overrides the current one), or ``""``. No
    tensors, so shapes do not apply."""
    layer = layer if layer is not None else _LAYER.get()
    parts = ([f"layer {layer!r}"] if layer else []) + ([_STEP.get()] if _STEP.get() else [])
    return ", ".join(parts)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of :func:`warn` point at the first frame outside
    the package, Pyro and torch (1 if there is none). No tensors, so shapes do not apply."""
    frame, level = sys._getframe(2), 2  # the caller of warn() is level 2 from warnings.warn's point of view
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def family_layer(q) -> str | None:
    """The name of the layer that owns the variational family ``q`` (a ``GaussianQ`` named ``"<layer>.q_u"`` by
    Pyro), or ``None`` if ``q`` is not part of a named layer. No tensors, so shapes do not apply."""
    name = getattr(q, "_pyro_name", "") or ""
    return name.rpartition(".")[0] or None


def warn(message: str, category=UserWarning, *, layer: str | None = None) -> None:
    """``warnings.warn(message + " [where]", category)`` pointing at the user's code (module docstring); ``layer``
    names the layer where the context does not know it (e.g. an optimiser's step on a layer's q(u)). No tensors, so
    shapes do not apply."""
    where = location(layer)
    warnings.warn(f"{message} [{where}]" if where else message, category, stacklevel=user_stacklevel())


def _warn_once(cause, message, category, stacklevel=None, layer=None):
    """Warn once per ``cause`` through :func:`warn` (the layer and the step appended, the user's line pointed at;
    ``stacklevel`` is ignored: kept for callers that still pass it); :func:`pyro_sparsegp.linalg.reset_warnings`
    re-arms every cause. No tensors, so shapes do not apply."""
    if cause not in _REPORTED:
        _REPORTED.add(cause)
        warn(message, category, layer=layer)
