"""The house rules of the package's layout (shared/DESIGN.md, "Target house"), read from the sources with ``ast``:

* ``bounds/`` is an oracle for the tests: nothing in ``pyro_sparsegp/`` outside ``bounds/`` imports it (the one
  exception is the top-level ``pyro_sparsegp/__init__.py``, which exposes the namespace ``ps.bounds`` to users):
  no import statement (at any depth, in functions too), no ``importlib.import_module``/``__import__`` call and no
  string (docstrings aside) names it, and importing every module of the package, with the import functions
  watched in a fresh interpreter, asks for it from nowhere else;
* the top-level modules and subpackages of ``pyro_sparsegp`` import one another without a cycle (function-level
  imports counted: a cycle broken only by deferring an import is still a cycle; ``inputs`` <-> ``validation`` was
  the last, ``checks`` <-> ``linalg`` <-> ``likelihoods`` nearly the next); the run-time context (``context/``)
  imports nothing else of the package;
* the package root holds the user-facing modules only (:data:`ROOT_MODULES`): plumbing lives in a subpackage whose
  name says what it holds (``checks/``, ``context/``, ...);
* one import path per class: a class that a module exports (its ``__all__``) is defined there, so no class is
  importable from two sibling modules that both look like its home (packages' ``__init__`` re-export freely:
  ``ps.DeepGP`` is the public path of :class:`pyro_sparsegp.layers.deep.DeepGP`);
* no file over 400 lines, no class over 200, no function over 80 (a docstring counts; decorators too).

``KNOWN_OVER`` lists what may stay over (with its size, never to grow): nothing since the restructuring of
issue #25.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "pyro_sparsegp"
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 400, 200, 80

# "path relative to pyro_sparsegp/" -> {"file" | "class NAME" | "function NAME": lines at the time}; to be emptied
KNOWN_OVER: dict = {}  # emptied by the restructuring of issue #25


def _sources():
    sources = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
    # a wrong depth of this file below the repository would find no sources and pass every rule vacuously
    assert PKG / "__init__.py" in sources, f"{PKG} is not the package"
    return sources


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path):
    """Every module an ``import``/``from ... import`` statement of ``path`` names (relative imports resolved; for
    ``from P import x`` both ``P`` and ``P.x``, since ``x`` may be a submodule). Yields ``(lineno, name)``."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _spans(path: Path):
    """``(kind NAME, lines)`` of every class and function (methods and nested ones included) of ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield f"{kind} {node.name}", node.end_lineno - start + 1


def test_the_module_name_resolution():
    assert _module_name(PKG / "infer" / "natgrad" / "__init__.py") == "pyro_sparsegp.infer.natgrad"
    assert _module_name(PKG / "likelihoods" / "base.py") == "pyro_sparsegp.likelihoods.base"


_BOUNDS = "pyro_sparsegp.bounds"
# a string that names the oracle as a module: absolute, or relative ("..bounds", ".bounds.svgp"), or bare ("bounds",
# which getattr(package, "bounds") or import_module("bounds", package) would take)
_BOUNDS_STRING = re.compile(r"pyro_sparsegp\.bounds\b|^\.*bounds(\.\w+)*$")
_IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec", "reload", "spec_from_file_location"}


def _names_bounds(name: str) -> bool:
    return name == _BOUNDS or name.startswith(_BOUNDS + ".")


def _docstrings(tree) -> set:
    """``id`` s of the string constants that are docstrings (of the module, classes and functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _bounds_references(path: Path):
    """``(lineno, what)`` for each way ``path`` may reach the oracle: an import statement naming it, a call of an
    import function (``importlib.import_module``, ``__import__``, ...), whatever its arguments, whose arguments
    mention ``bounds``, and any other string that names it as a module."""
    for lineno, name in _imported_modules(path):
        if _names_bounds(name):
            yield lineno, f"imports {name}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname in _IMPORT_FUNCTIONS:
                text = " ".join(ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)])
                if "bounds" in text:
                    yield node.lineno, f"calls {fname}({text})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _BOUNDS_STRING.search(node.value.strip()):
                yield node.lineno, f"names the oracle in the string {node.value!r}"


def test_nothing_outside_bounds_imports_bounds():
    bad = []
    for path in _sources():
        rel = path.relative_to(PKG)
        if rel.parts[0] == "bounds" or rel == Path("__init__.py"):
            continue  # the oracle itself; the top-level namespace ps.bounds, for users
        bad += [f"{rel}:{lineno} {what}" for lineno, what in _bounds_references(path)]
    assert not bad, "bounds/ is the tests' oracle; the library must not import it:\n" + "\n".join(bad)


def test_the_bounds_scan_sees_every_way_in(tmp_path, monkeypatch):
    """The scan itself: each way in is reported, a docstring or an unrelated word is not."""
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "pyro_sparsegp")
    src = tmp_path / "pyro_sparsegp" / "layers" / "mod.py"
    src.parent.mkdir(parents=True)
    ways = ["import importlib\nm = importlib.import_module('pyro_sparsegp.bounds')",
            "def f():\n    return __import__('pyro_sparsegp.bounds.svgp')",
            "from importlib import import_module\nm = import_module('.bounds', 'pyro_sparsegp')",
            "def f(p):\n    return getattr(p, 'bounds')",
            "def f():\n    from ..bounds import svgp",
            "NAME = 'pyro_sparsegp.' + 'bounds'\nimport importlib\nimportlib.import_module(NAME)"]
    for code in ways:  # (a name computed from pieces that spell no "bounds" is for the runtime test below)
        src.write_text(code + "\n")
        assert list(_bounds_references(src)), code
    src.write_text('"""Checked against :mod:`pyro_sparsegp.bounds`."""\nx = "out of bounds"\n')
    assert not list(_bounds_references(src))


WATCH = r"""
import builtins, importlib, importlib.util, json, pkgutil, sys, warnings
from pathlib import Path
PKG, BOUNDS = Path(sys.argv[1]), "pyro_sparsegp.bounds"
found = []


def _caller():
    f = sys._getframe(3)  # _caller <- _note <- the watched import function <- its caller
    while f is not None and "importlib" in f.f_code.co_filename:
        f = f.f_back
    return f


def _note(name, package, fromlist=()):
    try:
        full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
    except (ImportError, ValueError):
        return
    names = [full] + [f"{full}.{x}" for x in fromlist or () if isinstance(x, str)]
    if not any(n == BOUNDS or n.startswith(BOUNDS + ".") for n in names):
        return
    f = _caller()
    path = Path(f.f_code.co_filename).resolve() if f is not None else None
    if path is None or PKG not in path.parents:
        return
    rel = path.relative_to(PKG)
    if rel.parts[0] != "bounds" and rel != Path("__init__.py"):
        found.append(f"{rel}:{f.f_lineno} asks for {names}")


_import, _import_module = builtins.__import__, importlib.import_module


def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
    package = (globals or {}).get("__package__") or ""
    _note("." * level + name if level else name, package, fromlist)
    return _import(name, globals, locals, fromlist, level)


def watched_import_module(name, package=None):
    _note(name, package)
    return _import_module(name, package)


builtins.__import__, importlib.import_module = watched_import, watched_import_module
warnings.simplefilter("ignore")
import pyro_sparsegp
for info in pkgutil.walk_packages(pyro_sparsegp.__path__, "pyro_sparsegp."):
    if not info.name.startswith(BOUNDS) and info.name != "pyro_sparsegp.__main__":
        importlib.import_module(info.name)
print(json.dumps(found))
"""


def test_no_module_asks_for_bounds_when_imported():
    """Every module of the package imported in a fresh interpreter whose ``__import__`` and
    ``importlib.import_module`` note who asks for ``pyro_sparsegp.bounds`` (computed names included, which the
    source scan cannot read): nobody but ``pyro_sparsegp/__init__.py`` and ``bounds/`` itself."""
    env = {**os.environ, "PYTHONPATH": str(PKG.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", WATCH, str(PKG.resolve())], env=env, cwd=PKG.parent,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert not found, "bounds/ is the tests' oracle; the library must not import it:\n" + "\n".join(found)


def _top_level_graph() -> dict:
    """``{unit: {units it imports}}`` over the top-level modules and subpackages of ``pyro_sparsegp`` (a unit:
    ``inputs``, ``layers``, ...; every import statement of every file of a unit, at any depth, counts; the
    package's ``__init__.py``, which imports everything to expose it, is left out)."""
    units = {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"}
    units |= {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    graph = {u: set() for u in units}
    for path in _sources():
        rel = path.relative_to(PKG)
        if rel == Path("__init__.py"):
            continue
        src = rel.parts[0].removesuffix(".py")
        for _, name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] == "pyro_sparsegp" and len(parts) > 1 and parts[1] in units and parts[1] != src:
                graph[src].add(parts[1])
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one node (Tarjan), each sorted: the import cycles."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_top_level_modules_import_without_a_cycle():
    graph = _top_level_graph()
    assert {"checks", "context", "linalg", "layers", "infer"} <= set(graph)  # the scan found the package
    assert "checks" in graph["linalg"] and "linalg" not in graph["checks"]  # the Cholesky's checks live in checks/
    assert not graph["context"], f"context/ is the bottom layer and imports {graph['context']}"
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between top-level modules (function-level imports count): {cycles}"
    # the detector: a checks -> linalg import (the warn-once helper, or the likelihoods' quadrature) closes a cycle
    assert _cycles({**graph, "checks": graph["checks"] | {"linalg"}}) == [["checks", "linalg"]]


def test_the_inputs_validation_circle_stays_broken():
    """Inside ``checks/``: ``validation`` converts through ``inputs``, and ``inputs`` never imports ``validation``."""
    names = {name for _, name in _imported_modules(PKG / "checks" / "validation.py")}
    assert "pyro_sparsegp.checks.inputs" in names
    names = {name for _, name in _imported_modules(PKG / "checks" / "inputs.py")}
    assert not any(n.startswith("pyro_sparsegp.checks.validation") for n in names), names


#: the modules the package root may hold: what a user imports by name (``ps.datasets``, ``ps.saving``, ...); plumbing
#: goes into a subpackage that says what it holds (``checks/``, ``context/``, ``infer/``, ...)
ROOT_MODULES = {"__init__", "__main__", "conditionals", "conv", "datasets", "data_stream", "deep", "linalg",
                "mean_functions", "saving"}


def test_the_package_root_holds_no_plumbing():
    found = {p.stem for p in PKG.glob("*.py")}
    extra, missing = found - ROOT_MODULES, ROOT_MODULES - found
    assert not extra, (f"modules at the package root that are not user-facing: {sorted(extra)}; move them into the "
                       "subpackage that says what they hold (checks/, context/, ...) or, if users import them by "
                       "name, add them to ROOT_MODULES")
    assert not missing, f"ROOT_MODULES names modules that no longer exist: {sorted(missing)}"


def _exported_classes(module) -> list:
    """``(name, class)`` for every class in ``module.__all__`` (a module without ``__all__`` exports nothing)."""
    return [(name, obj) for name in getattr(module, "__all__", ()) if isinstance(obj := getattr(module, name), type)]


def _misplaced_classes(modules) -> list:
    """``"module.Name (defined in home)"`` for each class a non-``__init__`` module exports but does not define."""
    bad = []
    for module in modules:
        if hasattr(module, "__path__"):
            continue  # a package's __init__ re-exports its modules' classes: the public path
        for name, cls in _exported_classes(module):
            if cls.__module__ != module.__name__:
                bad.append(f"{module.__name__}.{name} (defined in {cls.__module__})")
    return bad


def test_one_import_path_per_class():
    """No class is exported by a module other than the one that defines it (packages' ``__init__`` aside): the
    defining module is the only non-``__init__`` import path that names it."""
    import importlib
    import pkgutil
    import warnings

    import pyro_sparsegp

    modules = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(pyro_sparsegp.__path__, "pyro_sparsegp."):
            if info.name != "pyro_sparsegp.__main__":
                modules.append(importlib.import_module(info.name))
    assert len(modules) > 50  # the walk found the package
    bad = _misplaced_classes(modules)
    assert not bad, ("classes exported by a module that does not define them (a second import path beside their "
                     "home; export them from a package's __init__ or import them from their home):\n"
                     + "\n".join(bad))


def test_the_re_export_scan_sees_a_sibling_re_export():
    """The scan itself: a module that exports a sibling's class is reported, one that only uses it is not, and a
    package's ``__init__`` may re-export."""
    import types

    home, sibling, user, package = (types.ModuleType(n) for n in ("pkg.home", "pkg.sibling", "pkg.user", "pkg"))
    Thing = type("Thing", (), {"__module__": "pkg.home"})
    home.Thing, home.__all__ = Thing, ["Thing"]
    sibling.Thing, sibling.__all__ = Thing, ["Thing", "helper"]
    sibling.helper = len
    user.Thing, user.__all__ = Thing, ["build"]
    user.build = len
    package.Thing, package.__all__, package.__path__ = Thing, ["Thing"], []
    assert _misplaced_classes([home, sibling, user, package]) == ["pkg.sibling.Thing (defined in pkg.home)"]


def _over(path: Path) -> tuple[str, dict]:
    rel = str(path.relative_to(PKG).as_posix())
    found = {}
    n = len(path.read_text(encoding="utf-8").splitlines())
    if n > MAX_FILE:
        found["file"] = n
    for key, span in _spans(path):
        limit = MAX_CLASS if key.startswith("class") else MAX_FUNCTION
        if span > limit:
            found[key] = max(span, found.get(key, 0))
    return rel, found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PKG)))
def test_size_limits(path):
    rel, found = _over(path)
    known = KNOWN_OVER.get(rel, {})
    new = {k: v for k, v in found.items() if k not in known}
    grown = {k: (known[k], v) for k, v in found.items() if k in known and v > known[k]}
    assert not new, (f"{rel}: over the house limits (file {MAX_FILE}, class {MAX_CLASS}, function {MAX_FUNCTION} "
                     f"lines): {new}")
    assert not grown, f"{rel}: grew past its KNOWN_OVER size (was, now): {grown}"


def test_known_over_lists_only_existing_files():
    missing = [rel for rel in KNOWN_OVER if not (PKG / rel).is_file()]
    assert not missing, f"KNOWN_OVER names files that no longer exist: {missing}"
