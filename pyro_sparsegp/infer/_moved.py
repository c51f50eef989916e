"""The flat layout of ``pyro_sparsegp.infer`` before the three subpackages, kept working: an old module path
(``import pyro_sparsegp.infer.natgrad_options``) imports the module at its new place, and an old name of ``ps.infer``
(``ps.infer.natgrad_step``) is read from its new module; both with a ``DeprecationWarning`` that names the new place.
Plumbing: no tensors, no paper equation."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MODULES", "NAMES", "install", "moved_name"]

#: old module (relative to ``pyro_sparsegp.infer``) -> new module
MODULES = {
    "fit": "training.loop", "batches": "training.batches", "checkpoint": "training.checkpoint",
    "guard": "training.guard", "steps": "training.steps", "progress": "training.progress",
    "distributed": "training.distributed", "exact_finish": "training.exact_finish",
    "natural_gradient": "natgrad.optimizer", "natgrad_options": "natgrad.policy", "schedules": "natgrad.schedules",
    "averaging": "natgrad.averaging",
    "ep_sites": "ep.sites", "gfitc": "ep.gfitc", "mfsp": "ep.mfsp",
}

#: a name ``ps.infer`` exported before -> the subpackage that exports it now
NAMES = {
    **{n: "natgrad" for n in (
        "natgrad_step", "gaussian_natgrad_step", "polya_gamma_natgrad_step", "natgrad_step_for", "natgrad_from_grads_",
        "solvegp_natgrad_step", "solvegp_joint_natgrad_from_grads_", "natgrad_pairs", "set_natgrad_probes",
        "clear_natgrad_probes", "LogLinearWarmup", "RunningAverageStart", "IterateAverage")},
    **{n: "ep" for n in ("ep_log_evidence", "ep_surrogate", "gfitc_log_evidence", "gfitc_surrogate", "mfsp_bound")},
    "exact_finish_": "training",
}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}: import it from there (the flat layout of pyro_sparsegp.infer is deprecated)",
                  DeprecationWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of ``pyro_sparsegp.infer`` and loads the module at its new place under that name."""

    def __init__(self, package: str):
        self.package, self._specs = package, {}

    def find_spec(self, fullname, path=None, target=None):
        head, _, tail = fullname.rpartition(".")
        if head != self.package or tail not in MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"{self.package}.{MODULES[spec.name.rpartition('.')[2]]}"
        _warn(spec.name, new)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system sets the alias's spec on it: put it back after
        return module

    def exec_module(self, module):
        """Nothing to run (the new module is already executed): restore its own ``__spec__``."""
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)


def install(package: str) -> None:
    """Register the finder of the old module paths of ``package`` (once per process). An old module whose name is also
    a name of the package (``pyro_sparsegp.infer.fit``, the module of the function ``ps.infer.fit``) is aliased at once
    and silently: importing it through the finder would set the module over the function on the package."""
    parent = sys.modules[package]
    for old, new in MODULES.items():
        if hasattr(parent, old):
            sys.modules.setdefault(f"{package}.{old}", importlib.import_module(f"{package}.{new}"))
    if not any(isinstance(f, _Alias) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_Alias(package))


def moved_name(package: str, name: str):
    """The object an old ``ps.infer.<name>`` named, from its new module (``DeprecationWarning``); an old module name
    (``ps.infer.natgrad_options``) gives the module; ``AttributeError`` otherwise."""
    if name in NAMES:
        new = f"{package}.{NAMES[name]}"
        _warn(f"{package}.{name}", f"{new}.{name}", stacklevel=4)  # the caller of ps.infer.__getattr__
        return getattr(importlib.import_module(new), name)
    if name in MODULES:
        return importlib.import_module(f"{package}.{name}")  # the finder warns (once: then it is in sys.modules)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
