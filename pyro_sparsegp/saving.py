r"""A model's layout as plain data, so that a file reloads without the code (or the training data) that built it.

A ``state_dict`` holds a module's tensors, not how to build the module that takes them: a :class:`~pyro_sparsegp.DeepGP`
from :func:`~pyro_sparsegp.deep.build_deep_gp` needs the training inputs again (k-means, the PCA skip connections
of Salimbeni & Deisenroth 2017, section 4.1) before its ``load_state_dict`` fits. :func:`describe` writes the layout
down instead: for every module of the model, its class and the arguments of its constructor, read back from the
module's attributes of the same names (``SVGP.Z`` is read as the inducing variables ``SVGP.inducing``,
``SOLVEGP.O`` as ``SOLVEGP.orthogonal``, a :class:`~pyro_sparsegp.ConvLayer`'s kernel and inducing patches from
its GP over patches). Plain values (numbers, strings, tuples, ``None``) are kept as they are, modules as their own
layouts, and tensors as their shapes only: their values are in the ``state_dict``. :func:`build` calls the
constructors again, inner modules first, each loaded with its values at once (so that a layer's constructor
factorises the trained ``Kuu``, not a placeholder's), and the whole model last; :func:`save` and :func:`load` keep
both in one file that ``torch.load``'s default ``weights_only=True`` reads (no pickled classes: nothing in the file
runs code).

Covered: every model, layer, kernel, inducing variable, mean function and likelihood of this package, and Pyro's
GP kernels, whose constructor arguments are attributes of the same names. A class of your own (a likelihood, a
kernel) is described the same way when it keeps each constructor argument under that name; pass it to
:func:`load` (``classes=[MyLikelihood]``), which otherwise builds classes of ``pyro_sparsegp`` and
``pyro.contrib.gp`` only. Not covered (:class:`LayoutError` at :func:`describe`): ``PyroSample`` hyperparameters
(priors are no tensors of the ``state_dict``), modules shared by two parts of a model, and arguments that are
neither plain values, tensors of the ``state_dict`` nor modules (functions, for instance).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re

import torch

__all__ = ["LayoutError", "describe", "build", "save", "load", "FORMAT"]

#: the ``"format"`` entry of a file written by :func:`save`
FORMAT = "pyro_sparsegp.model"
_VERSION = 1
_PLAIN = (type(None), bool, int, float, str)
_BUILDABLE = ("pyro_sparsegp.", "pyro.contrib.gp.")  # the packages whose classes load() builds unasked
_EMPTY = inspect.Parameter.empty


class LayoutError(ValueError):
    """A module whose layout cannot be written down as plain data, or a layout (or file) that cannot be built
    (module docstring). An error: no tensors, so shapes do not apply; implements no paper equation."""


def _aliases(cls) -> dict:
    """Constructor arguments that a class keeps under another attribute (dotted paths), over its MRO: each class's
    own ``_saving_aliases`` (the layers declare theirs, so this module imports none of them)."""
    out = {}
    for c in reversed(cls.__mro__):
        out.update(c.__dict__.get("_saving_aliases", {}))
    return out


def _signature(cls) -> list:
    """The constructor's parameters (``self`` left out); a ``**kwargs`` that is passed on to the base class's
    constructor is replaced by that constructor's further keyword parameters."""
    from pyro.nn import PyroModule

    out, seen = [], set()
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is None:
            continue
        if init in (PyroModule.__init__, torch.nn.Module.__init__, object.__init__):
            break
        more = False
        for p in list(inspect.signature(init).parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.name not in seen:
                seen.add(p.name)
                out.append(p)
        if not more:
            break
    return out


def class_path(cls) -> str:
    """The shortest public import path of ``cls`` (``pyro_sparsegp.SVGP``, ``pyro.contrib.gp.kernels.RBF``), so
    that a file outlives the move of a class between the package's submodules. No tensors, so shapes do not apply."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        mod = importlib.import_module(".".join(parts[:i]))
        if getattr(mod, cls.__name__, None) is cls:
            return f"{mod.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _read(module, path: str):
    """``(owner, name, value)`` of the dotted attribute ``path``; ``AttributeError`` when it is missing."""
    *parents, name = path.split(".")
    owner = module
    for p in parents:
        owner = getattr(owner, p)
    samples = owner.__dict__.get("_pyro_samples", {})
    if name in samples:
        raise LayoutError(f"{name} of the {type(owner).__name__} is a PyroSample (a prior): a layout holds no priors, "
                          "so fix it to a value (a PyroParam or a tensor) before saving, or save the state_dict")
    return owner, name, getattr(owner, name)


def _encode(value, owner, name: str, root, where: str, seen: set):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        keys = owner.state_dict(keep_vars=True)
        if f"{name}_unconstrained" not in keys and name not in keys:
            raise LayoutError(f"{where}: the tensor {name!r} of the {type(owner).__name__} is not in its state_dict, "
                              "so its value would not be saved")
        return {"tensor": tuple(value.shape)}
    if isinstance(value, torch.nn.ModuleList) or (isinstance(value, (list, tuple)) and value and
                                                  all(isinstance(v, torch.nn.Module) for v in value)):
        return [_encode(v, owner, name, root, where, seen) for v in value]
    if isinstance(value, torch.nn.Module):
        paths = [n for n, m in root.named_modules(remove_duplicate=False) if m is value]
        if len(paths) != 1 or id(value) in seen:
            raise LayoutError(f"{where}: the {type(value).__name__} given as {name!r} is "
                              f"{'not a submodule' if not paths else 'shared by ' + ', '.join(paths)}; a layout "
                              "describes a tree of modules, each built once")
        seen.add(id(value))
        return {"module": _describe(value, root, paths[0], seen), "at": paths[0]}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v, owner, name, root, where, seen) for v in value)
    raise LayoutError(f"{where}: the argument {name!r} of the {type(owner).__name__} is a {type(value).__name__}, "
                      "which a layout cannot hold (plain values, tensors of the state_dict and modules only)")


def _describe(module, root, at: str, seen: set) -> dict:
    cls = type(module)
    where = at or "the model"
    aliases, args = _aliases(cls), {}
    for p in _signature(cls):
        try:
            owner, name, value = _read(module, aliases.get(p.name, p.name))
        except AttributeError:
            if p.default is _EMPTY and p.kind is not p.VAR_POSITIONAL:
                raise LayoutError(f"{where}: {cls.__name__} keeps its constructor argument {p.name!r} under no "
                                  "attribute of that name, so its layout cannot be read back") from None
            continue
        args[p.name] = _encode(value, owner, name, root, f"{where} ({cls.__name__})", seen)
    return {"class": class_path(cls), "args": args}


def describe(module) -> dict:
    """The layout of ``module`` as plain data (module docstring): ``{"class": "pyro_sparsegp.SVGP", "args":
    {...}}``, nested for the modules among the arguments (``{"module": ..., "at": "layers.0.kernel"}``, ``at``
    the submodule's place in the ``state_dict``), tensors as ``{"tensor": shape}`` (their shapes: e.g. ``(M, D)``
    for inducing inputs ``Z`` ``[M, D]``; the values stay in ``module.state_dict()``). What :func:`build` needs,
    with that ``state_dict``, to rebuild a deep GP (Salimbeni & Deisenroth 2017) or any other model of the package
    without its training data. Raises :class:`LayoutError` naming the part that a layout cannot hold."""
    return _describe(module, module, "", set())


# -- building -------------------------------------------------------------------------------------------------------
def _resolve(path: str, classes, source: str):
    for c in classes:
        if path in (class_path(c), f"{c.__module__}.{c.__qualname__}"):
            return c
    if not isinstance(path, str) or not path.startswith(_BUILDABLE):
        raise LayoutError(f"{source}: the layout names the class {path!r}, which load builds only if you pass it "
                          "(classes=[...]); without it, only classes of pyro_sparsegp and pyro.contrib.gp are built")
    module_path, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError) as err:
        raise LayoutError(f"{source}: the layout names the class {path!r}, which this version does not have "
                          f"({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise LayoutError(f"{source}: {path!r} is not a module class")
    return cls


def _free_name(name: str) -> str:
    """``name`` if no live module holds it, else a fresh one (as a copy of a live module gets,
    :mod:`.context.naming`)."""
    from .context.naming import unique_name

    return name if unique_name(name) == name else unique_name(re.sub(r"_\d+$", "", name))


def _check_fit(module, state: dict, prefix: str, source: str) -> None:
    """Raise a :class:`LayoutError` naming the entries of ``state`` that do not fit ``module``'s."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    missing = [prefix + k for k in want if k not in have]
    unexpected = [prefix + k for k in have if k not in want]
    shapes = [f"{prefix + k}: {have[k]} in the file, {want[k]} in the layout" for k in want
              if k in have and have[k] != want[k]]
    if missing or unexpected or shapes:
        problems = [f"{label} {items[:6]}" for label, items in
                    (("missing entries", missing), ("unexpected entries", unexpected), ("other shapes", shapes))
                    if items]
        raise LayoutError(f"{source}: the state_dict does not fit the layout: {'; '.join(problems)}")


def _decode(value, state: dict, classes, source: str):
    if isinstance(value, dict) and "tensor" in value:
        return torch.full(tuple(value["tensor"]), 0.5)  # a placeholder inside every constraint; loaded at once
    if isinstance(value, dict) and "module" in value:
        return _build(value["module"], state, value["at"] + ".", classes, source)
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v, state, classes, source) for v in value)
    return value


def _build(config: dict, state: dict, prefix: str, classes, source: str):
    if not isinstance(config, dict) or not isinstance(config.get("args"), dict):
        raise LayoutError(f"{source}: the layout at {prefix[:-1] or 'the model'!r} is no {{'class', 'args'}} entry")
    cls = _resolve(config.get("class"), classes, source)
    args = {k: _decode(v, state, classes, source) for k, v in config["args"].items()}
    if isinstance(args.get("name"), str):
        args["name"] = _free_name(args["name"])
    params = _signature(cls)
    star = next((p for p in params if p.kind is p.VAR_POSITIONAL), None)
    positional = []
    if star is not None:  # the parameters before *args go by position
        for p in params[: params.index(star)]:
            positional.append(args.pop(p.name, p.default))
        positional += list(args.pop(star.name, ()))
    try:
        module = cls(*positional, **args)
    except Exception as err:
        raise LayoutError(f"{source}: the {cls.__name__} at {prefix[:-1] or 'the model'!r} could not be built from "
                          f"its layout: {err}") from err
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if prefix else state
    _check_fit(module, own, prefix, source)
    module.load_state_dict(own)
    return module


@contextlib.contextmanager
def _dtype_of(state: dict):
    dtypes = {v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    old = torch.get_default_dtype()
    if len(dtypes) == 1 and next(iter(dtypes)) in (torch.float32, torch.float64):
        torch.set_default_dtype(next(iter(dtypes)))
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(config: dict, state_dict: dict, *, classes=(), source: str = "the layout"):
    """The module of layout ``config`` (:func:`describe`) with the values of ``state_dict`` (entries of any shape, as
    ``module.state_dict()`` gave them), in their dtype; a deep GP (Salimbeni & Deisenroth 2017) needs no training
    data. Names (of sites and of Pyro's parameter store entries) are the saved ones, unless a live module holds one:
    then a fresh one, as for a copy (:mod:`pyro_sparsegp.context.naming`). ``classes``: classes of your own that the
    layout names. ``source`` names the origin in errors (:class:`LayoutError`: a class that is not there, a constructor
    that refuses its arguments, entries or shapes that do not fit the layout)."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise LayoutError(f"{source}: the state_dict must be a dict of tensors")
    with _dtype_of(state_dict), torch.no_grad():
        return _build(config, state_dict, "", tuple(classes), source)


# -- files ----------------------------------------------------------------------------------------------------------
def save(module, path) -> None:
    """Write ``module``'s layout (:func:`describe`) and ``state_dict`` (tensors of their own shapes) to ``path``, one
    ``torch.save`` file of plain data that :func:`load` rebuilds in any process, without the training data (e.g. a
    deep GP of Salimbeni & Deisenroth 2017 with its PCA skip connections). Written to a temporary file first, then
    renamed, so an interrupted save leaves the previous file. :class:`LayoutError` (before writing) if the layout
    cannot be described."""
    payload = {"format": FORMAT, "version": _VERSION, "config": describe(module), "state_dict": module.state_dict()}
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load(path, *, map_location=None, classes=()):
    """The module saved by :func:`save` at ``path``, rebuilt from its layout and loaded with its values (shapes as
    saved; :func:`build`), in the dtype it was saved in: a deep GP (Salimbeni & Deisenroth 2017) or any model of the
    package, without its training data. ``map_location`` as for ``torch.load`` (``"cpu"`` for a file written on a
    GPU); ``classes``: classes of your own that the file names. ``torch.load(..., weights_only=True)`` reads it:
    nothing in the file runs code. Raises :class:`LayoutError` naming the file and what is wrong with it (not a
    model file, a state_dict without its layout, a newer format, entries that do not fit)."""
    source = f"{os.fspath(path)!r}"
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise LayoutError(f"{source} is not a model file that pyro_sparsegp.saving.load reads (torch.load with "
                          f"weights_only=True failed: {str(err).splitlines()[0][:300]}); a module pickled with "
                          "torch.save(module) loads with torch.load(path, weights_only=False), for files you "
                          "trust") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        hint = ""
        if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
            hint = (": it holds a state_dict without its layout (torch.save(module.state_dict())); build the module "
                    "as it was built and call load_state_dict, or save with pyro_sparsegp.saving.save(module, path)")
        raise LayoutError(f"{source} is no file of pyro_sparsegp.saving.save{hint}")
    if payload.get("version") != _VERSION:
        raise LayoutError(f"{source} has format version {payload.get('version')!r}; this version of pyro_sparsegp "
                          f"reads version {_VERSION}")
    return build(payload.get("config"), payload.get("state_dict"), classes=classes, source=source)


class Saveable:
    """Mixin of the models (:class:`~pyro_sparsegp.DeepGP`, :class:`~pyro_sparsegp.DeepConvGP`): their layout and
    file as methods (:func:`describe`, :func:`save`, :func:`build`, :func:`load`), for deep GPs of Salimbeni &
    Deisenroth 2017 that reload without their training data. Shapes are those of the model's ``state_dict``."""

    def config(self) -> dict:
        """This model's layout as plain data (:func:`describe`; tensors as their shapes only)."""
        return describe(self)

    def save(self, path) -> None:
        """Write the layout and the ``state_dict`` (tensors of their own shapes) to ``path`` (:func:`save`)."""
        save(self, path)

    @classmethod
    def from_config(cls, config: dict, state_dict: dict, *, classes=()):
        """The model of layout ``config`` with the values of ``state_dict`` (:func:`build`, shapes as saved); a
        ``TypeError`` if the layout is of another class."""
        return _expect(cls, build(config, state_dict, classes=classes), "the layout")

    @classmethod
    def load(cls, path, *, map_location=None, classes=()):
        """The model saved at ``path`` (:func:`load`, shapes as saved); a ``TypeError`` naming the file if it holds
        a model of another class."""
        return _expect(cls, load(path, map_location=map_location, classes=classes), f"{os.fspath(path)!r}")


def _expect(cls, module, source: str):
    if not isinstance(module, cls):
        raise TypeError(f"{source} holds a {type(module).__name__}, not a {cls.__name__}: load it with "
                        f"pyro_sparsegp.saving.load or {type(module).__name__}.load")
    return module
