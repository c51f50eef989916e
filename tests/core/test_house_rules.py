"""The house rules of the package's layout (shared/DESIGN.md, "Target house"), read from the sources with ``ast``:

* ``bounds/`` is an oracle for the tests: nothing in ``pyro_sparsegp/`` outside ``bounds/`` imports it (the one
  exception is the top-level ``pyro_sparsegp/__init__.py``, which exposes the namespace ``ps.bounds`` to users);
* no file over 400 lines, no class over 200, no function over 80 (a docstring counts; decorators too).

``KNOWN_OVER`` lists what may stay over (with its size, never to grow): nothing since the restructuring of
issue #25.
"""

from __future__ import annotations

import ast
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


def test_nothing_outside_bounds_imports_bounds():
    bad = []
    for path in _sources():
        rel = path.relative_to(PKG)
        if rel.parts[0] == "bounds":
            continue
        for lineno, name in _imported_modules(path):
            if name == "pyro_sparsegp.bounds" and rel == Path("__init__.py"):
                continue  # the namespace ps.bounds, for users
            if name == "pyro_sparsegp.bounds" or name.startswith("pyro_sparsegp.bounds."):
                bad.append(f"{rel}:{lineno} imports {name}")
    assert not bad, "bounds/ is the tests' oracle; the library must not import it:\n" + "\n".join(bad)


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
