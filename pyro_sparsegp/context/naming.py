"""Module names: unique by default, and never two live modules reading one set of parameters.

A module's ``name`` prefixes its sample sites (``gp.u``, ``gp.f``) and, under Pyro's global parameter store (Pyro's
default, ``module_local_params=False``), its parameters (``gp.inducing.Z``, ...). Two live modules with the same
name would share those parameters: training the second would silently move the first one's predictions. So:

* ``name=None`` (the default of every layer and model) takes the class's base name (``"gp"``, ``"dgp"``,
  ``"conv"``) if no live module holds it, else the first free ``"<base>_2"``, ``"<base>_3"``, ... A script with one
  model keeps the familiar ``gp.*`` sites; a second model beside it gets its own.
* A copy (``copy.deepcopy``, or a pickled module loaded while its original lives) takes a fresh name the same way, so
  a snapshot never reads the original's parameters; a layer inside another ``PyroModule`` keeps its own name as
  its parameter prefix (:class:`KeepsOwnName`).
* An explicit name that a live module already holds (a notebook cell run twice, ``name="h"`` given twice) is the
  user's choice: under the global store the new module takes the name, the earlier module's entries are dropped with
  a :class:`ParamStoreWarning`, and the earlier module raises a ``RuntimeError`` at its next use instead of reading
  the newer module's values. With ``module_local_params=True`` parameters are never shared and nothing happens.
"""

from __future__ import annotations

import gc
import re
import weakref

import pyro

__all__ = ["ParamStoreWarning", "KeepsOwnName", "unique_name", "register_name", "claim_name",
           "check_not_superseded"]

_LIVE: dict[str, weakref.ref] = {}  # name -> the live module that holds it


class ParamStoreWarning(UserWarning):
    """A module took over a name (and Pyro's global parameter store entries) of an earlier, still live module
    (see :mod:`pyro_sparsegp.context.naming`). A warning: implements no paper equation."""


class KeepsOwnName:
    """A ``PyroModule`` mixin (before ``PyroModule`` in the bases) for a module whose ``name`` attribute prefixes its
    parameters: it keeps that prefix when the module becomes an attribute of another ``PyroModule``. Pyro would
    rename the parameters to the attribute path (``"gp.inducing.Z"`` for every instance of a user's module that
    holds a layer as ``self.gp``, or beside a model of this package named ``"gp"``), and under Pyro's global parameter
    store two such models would read and train one set of parameters (the second adopting the first's, even with
    another shape). The name is unique by default (module docstring) and prefixes the module's sample sites too; the
    parent's Pyro context is shared as Pyro does. No tensors, so shapes do not apply; bookkeeping of names that
    implements no paper equation."""

    def _pyro_set_supermodule(self, name: str, context) -> None:
        super()._pyro_set_supermodule(self.name, context)

    def __setstate__(self, state) -> None:
        """A copy (``copy.deepcopy(gp)``, or ``torch.load`` of a pickled module while its original lives) takes a
        fresh unique name (``gp`` -> ``gp_2``): under Pyro's global store a copy keeping the name would read the
        original's parameters whenever it runs, so a snapshot (``best = copy.deepcopy(gp)``) would follow the
        original's later training. Unpickled where the name is free, it keeps it."""
        super().__setstate__(state)
        name = self.__dict__.get("name")
        if not isinstance(name, str):
            return
        holder = _holder(name)
        if holder is None:
            register_name(self, name)
        elif holder is not self:
            new = unique_name(re.sub(r"_\d+$", "", name))
            for m in self.modules():  # the prefix of this module's and its children's parameters and sites
                prefix = m.__dict__.get("_pyro_name")
                if isinstance(prefix, str) and (prefix == name or prefix.startswith(name + ".")):
                    m.__dict__["_pyro_name"] = new + prefix[len(name):]
            self.__dict__["name"] = new
            claim_name(self, new)


def _holder(name: str):
    ref = _LIVE.get(name)
    return None if ref is None else ref()


def _collect(name: str) -> None:
    """Let the garbage collector free a holder of ``name`` that only waits for it: the young generations first (a
    module dropped moments ago, as when a notebook cell is run again, is usually there, and collecting them costs
    little), the full collection (the heap's size) only if the holder is still there."""
    gc.collect(1)
    if _holder(name) is not None:
        gc.collect()


def unique_name(base: str) -> str:
    """``base`` if no live module holds it, else ``base_2``, ``base_3``, ... (the first free one). Modules that are
    only waiting for the garbage collector do not count (one ``gc.collect()`` before a suffix is given). Strings,
    not tensors, so shapes do not apply; implements no paper equation."""
    if _holder(base) is not None:
        _collect(base)
    if _holder(base) is None:
        return base
    k = 2
    while _holder(f"{base}_{k}") is not None:
        k += 1
    return f"{base}_{k}"


def register_name(module, name: str) -> None:
    """Record that ``module`` holds ``name`` (for :func:`unique_name`) without touching Pyro's parameter store: for
    modules whose name prefixes only a plate or sites, not parameters (a ``DeepGP``). No tensors, so shapes do not
    apply; implements no paper equation."""
    _LIVE[name] = weakref.ref(module)


def claim_name(module, name: str) -> None:
    """Record that ``module`` holds ``name``. Under Pyro's global parameter store, a live earlier holder is marked
    superseded (it raises at its next use) and the store's ``<name>.*`` entries are dropped, with a warning; entries
    left by a module that no longer exists are dropped silently (they would be adopted, even with another shape).
    Implements no paper equation."""
    if _holder(name) is not None and _holder(name) is not module:
        _collect(name)  # (holding no reference to it here: a module waiting for the collector does not count)
    old = _holder(name)
    _LIVE[name] = weakref.ref(module)
    if pyro.settings.get("module_local_params"):
        return
    store = pyro.get_param_store()
    stale = [k for k in list(store.keys()) if k.startswith(name + ".")]
    if old is not None and old is not module:
        old.__dict__["_psgp_superseded"] = name
        from .reporting import warn

        warn(
            f"a module named {name!r} already exists and shares Pyro's global parameter store; this new module takes "
            f"the name, and the earlier one will raise if used again (it would otherwise read this module's "
            "parameters). Leave name=None for a unique name, or use pyro.settings.set(module_local_params=True).",
            ParamStoreWarning,
        )
    for k in stale:
        del store[k]


def check_not_superseded(module) -> None:
    """Raise ``RuntimeError`` if a newer module took over ``module``'s name in Pyro's global parameter store. No
    tensors, so shapes do not apply; implements no paper equation."""
    name = module.__dict__.get("_psgp_superseded")
    if name is not None:
        raise RuntimeError(
            f"this {type(module).__name__} was named {name!r}, and a newer module of that name has taken over its "
            "entries in Pyro's global parameter store; using it would read the newer module's parameters. Rebuild "
            "it, give the modules distinct names (name=None gives unique ones), or use "
            "pyro.settings.set(module_local_params=True)."
        )
