"""Mutation testing of the packages where a wrong line gives a wrong number (issue 45, item 3): each mutant (one
small change of one line) is run against the tests of its package that execute that line; a failing test kills it.

    pip install -e ".[test,dev]"   # coverage
    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/mutation.py [TARGET ...] [--score PATH] [--detail PATH]
        [--work DIR] [--list] [--check-equivalent] [--sample K [--seed S]] [--survivors-of DETAIL [--pool TESTS]]

``TARGET``: a package of :data:`PACKAGES` (``covariances``, ``infer/natgrad``, ...) or one module file
(``pyro_sparsegp/covariances/points.py``); default all seven. Writes ``tools/records/mutation_score.json`` as
``{"<module path>": {"killed": k, "survived": s, "equivalent": e}}`` (entries of the modules run are replaced, the
others kept) and ``tools/records/mutation_detail.json`` (each surviving mutant, the tests that ran it, wall time
per package). ``--list`` prints the mutants of the targets and runs nothing. ``--sample K`` runs a seeded uniform
sample of at most K mutants per module file (the detail file's ``sampling`` says which scores are sample estimates and
of how many mutants). Not part of CI or of the test suite.

**Tool: our own AST mutator with a fork server, after trying both tools of the package index on
``covariances/points.py`` against ``tests/covariances/`` (2 busy cores):**

* mutmut 3.8.1 (trampolines, forked runs): fast, 0.16 s per mutant (25 mutants in 4 s after a 20 s stats run), but
  it skips every decorated function but ``@staticmethod``/``@classmethod`` ones (``pyro_kernel_diag`` under
  ``@register_diag`` got no mutant), and its trampoline copies a function *with* its decorators, so it cannot be
  forced onto them: a ``@register``/``@register_diag`` copy registers itself again, a ``@property`` copy is not
  callable. In the seven packages that would leave the ``@layer_method`` / ``@in_layer`` / ``@torch.no_grad`` /
  ``@property`` / ``@register_diag`` functions (about 70, most of ``layers/`` and of ``variational/strategy.py``)
  unmutated.
* cosmic-ray 8.7.0 (rewrites the file, one test command per mutant): 13.6 s per mutant (42 mutants in 573 s: a fresh
  interpreter imports torch and Pyro for every mutant), too slow for thousands of mutants.
* Ours: the mutant is written into a scratch copy of the tree, and a child forked from a server that has already
  imported torch, Pyro, pytest and the tests' third-party modules (not ``pyro_sparsegp``) imports the package with
  the mutant (0.2 s) and runs ``pytest -x`` on the tests that cover the mutated line (from one coverage run per
  package with one coverage context per test), fastest first. About 1-2 s per killed mutant on 2 busy cores; a
  survivor costs its covering tests' time. Decorators, PyroModules and autograd ``Function`` classes need nothing
  special, since the file itself is changed.

Mutations (one per mutant, by token, so the rest of the file is untouched): arithmetic ``+ -``, ``* /``, ``** -> *``,
``// -> /``, ``% -> //``, ``| &``; comparisons ``< <=``, ``> >=``, ``== !=``, ``is``/``is not``, ``in``/``not in``;
``and``/``or``; dropping a unary ``-`` or ``not``; integer ``n -> n + 1``, float ``x -> x + 1``, ``True``/``False``;
``+= -=``, ``*= /=``; a call statement replaced by ``pass``; a bare condition negated; ``min``/``max``,
``amin``/``amax``, ``sum``/``mean``, ``tril``/``triu`` swapped (names, attributes and keywords); ``.mT``/``.T``
dropped. Not mutated: docstrings and other strings, f-strings, annotations, decorators, imports, ``raise`` and
``assert`` statements, ``warnings.warn`` calls, ``__all__``, ``__repr__``, and lines marked ``# pragma: no mutate``.

Outcomes: a test failure, an error (an import error included), a crash or a timeout (five times the covering tests'
time plus 60 s) kills; all covering tests passing, or no test covering the line, is a survivor. Equivalent mutants
(no program can tell them from the original) are listed with the reason in
``tools/records/mutation_equivalent.json`` as ``{"<module path>": [{"location": "Class.method", "code":
"<source line, stripped>", "mutation": "<as printed by --list>", "why": "..."}]}`` (the line number is not part of the
match, so the list survives edits elsewhere in the file); they are not run (``--check-equivalent`` runs them and
warns about any that a test kills) and count in ``equivalent`` only.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import tokenize
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "tools" / "records"

# package -> the test folders it is judged against: its own, and those where it is tested by design (the variational
# strategies and the bound oracles are exercised through the layers' tests).
PACKAGES = {
    "covariances": ["tests/covariances", "tests/kernels"],
    "bounds": ["tests/bounds", "tests/layers", "tests/likelihoods"],
    "kernels": ["tests/kernels", "tests/covariances"],
    # tests/deploy: the strategies' predictive_terms (the constants an exported prediction is built from)
    "variational": ["tests/variational", "tests/layers", "tests/deploy"],
    "likelihoods": ["tests/likelihoods"],
    "infer/natgrad": ["tests/infer/natgrad"],
    # the layers' Pyro-program paths (PyroSample hyperpriors, autoguides, user plates, subsampling) are tested in
    # tests/core's composability files: without them a survivor there shows "0 covering tests"
    "layers": ["tests/layers", "tests/core/test_composability.py",
               "tests/core/test_composability_plates_and_autoguides.py"],
}

BINOP = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"), ast.Pow: ("**", "*"),
         ast.FloorDiv: ("//", "/"), ast.Mod: ("%", "//"), ast.BitOr: ("|", "&"), ast.BitAnd: ("&", "|")}
AUGOP = {ast.Add: ("+=", "-="), ast.Sub: ("-=", "+="), ast.Mult: ("*=", "/="), ast.Div: ("/=", "*=")}
CMPOP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="),
         ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"),
         ast.NotIn: ("not in", "in")}
SWAP = {"min": "max", "max": "min", "amin": "amax", "amax": "amin", "sum": "mean", "mean": "sum", "tril": "triu",
        "triu": "tril"}
DROP_ATTR = {"mT", "T"}
# pyproject's addopts run the suite under pytest-xdist (-n auto); the coverage run, the session server and the mutant
# runs must stay in this process (coverage contexts, forked children), so each session turns the workers off
IN_PROCESS = ("-n", "0")
BASELINE_TESTS = 40  # the fastest covering tests, run unmutated through the session server first: the harness check
FORMAT = "coverage map 2"  # bump when the coverage file's layout changes
NO_MUTATE_FUNCS = {"__repr__", "__str__", "extra_repr"}


@dataclass
class Mutant:
    module: str  # "pyro_sparsegp/covariances/points.py"
    location: str  # "PointsRule.check" or "<module>"
    line: int
    code: str  # the stripped source line
    mutation: str  # "`<` -> `<=` (col 12)"
    start: int  # character offsets of the replaced text in the source
    end: int
    new: str
    lines: tuple  # the lines whose covering tests run this mutant; () = every test that uses the module
    func: str | None  # qualified name of the outermost function holding it (None: run at import)
    func_line: int  # that function's first line (its first decorator's)
    status: str = ""
    tests: list = field(default_factory=list)

    def key(self) -> tuple:
        return (self.location, self.code, self.mutation)

    def apply(self, source: str) -> str:
        return source[:self.start] + self.new + source[self.end:]


class _Positions:
    """Character offsets of AST positions (``col_offset`` counts UTF-8 bytes) and the file's tokens."""

    def __init__(self, source: str):
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.tokens = [(self.starts[t.start[0] - 1] + t.start[1], self.starts[t.end[0] - 1] + t.end[1], t.string)
                       for t in tokenize.generate_tokens(io.StringIO(source).readline)
                       if t.type in (tokenize.OP, tokenize.NAME)]

    def offset(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + len(self.lines[lineno - 1].encode()[:col].decode())

    def span(self, node) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def between(self, a: int, b: int) -> list:
        return [t for t in self.tokens if t[0] >= a and t[1] <= b and t[2] not in "()"]


class _Collector(ast.NodeVisitor):
    """Walks one module and lists its mutants (see the module docstring for the operators)."""

    def __init__(self, module: str, source: str):
        self.module, self.pos, self.out = module, _Positions(source), []
        self.scope, self.stmt_lines, self.in_function = [], (), False
        self.func, self.func_line = None, 0
        self.skip_lines = {i + 1 for i, line in enumerate(self.pos.lines) if "pragma: no mutate" in line}

    # -- bookkeeping ------------------------------------------------------------------------------------------------
    def add(self, node_line: int, start: int, end: int, new: str, label: str):
        if node_line in self.skip_lines:
            return
        src = self.pos.source
        line_start = self.pos.starts[node_line - 1]
        col = start - line_start if start >= line_start else 0
        self.out.append(Mutant(self.module, ".".join(self.scope) or "<module>", node_line,
                               self.pos.lines[node_line - 1].strip(), f"{label} (col {col})", start, end, new,
                               self.stmt_lines if self.in_function else (), self.func, self.func_line))
        assert src[start:end] or new  # a mutant changes something

    def visit_stmt_dispatch(self, node):
        """Visit one statement with ``stmt_lines`` set to the lines whose tests judge its mutants: a simple
        statement's lines, a compound statement's header (a function sets its own)."""
        saved = self.stmt_lines
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            self.stmt_lines = tuple(range(node.lineno, max(body[0].lineno, node.lineno + 1)))
        else:
            self.stmt_lines = tuple(range(node.lineno, node.end_lineno + 1))
        try:
            getattr(self, "visit_" + type(node).__name__, self.generic_visit)(node)
        finally:
            self.stmt_lines = saved

    def generic_visit(self, node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.visit_stmt_dispatch(child)
            else:
                self.visit(child)

    # -- statements not mutated or scoped ---------------------------------------------------------------------------
    def visit_Import(self, node):
        pass

    visit_ImportFrom = visit_Raise = visit_Assert = visit_Import

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        if isinstance(node.value, ast.Call) and _is_warn(node.value):
            return
        if isinstance(node.value, ast.Call):
            start, end = self.pos.span(node)
            self.add(node.lineno, start, end, "pass", "call statement -> `pass`")
        self.generic_visit(node)

    def visit_Assign(self, node):
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)

    def visit_If(self, node):
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        self._negate(node.test, node.lineno)
        self.generic_visit(node)

    def visit_While(self, node):
        self._negate(node.test, node.lineno)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        if node.name in NO_MUTATE_FUNCS:
            return
        self.scope.append(node.name)
        saved = self.in_function, self.stmt_lines, self.func, self.func_line
        self.in_function = True
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        self.stmt_lines = tuple(range(body[0].lineno, node.end_lineno + 1)) if body else ()
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)  # a default changes the calls: judged by the tests that run the body
        if self.func is None:  # the outermost function: its code object is what a mutant replaces
            self.func = ".".join(self.scope)
            self.func_line = min([d.lineno for d in node.decorator_list] + [node.lineno])
        for stmt in node.body:
            self.visit_stmt_dispatch(stmt)
        self.scope.pop()
        self.in_function, self.stmt_lines, self.func, self.func_line = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit_stmt_dispatch(stmt)
        self.scope.pop()

    # -- expressions ------------------------------------------------------------------------------------------------
    def visit_JoinedStr(self, node):
        pass

    def visit_Lambda(self, node):
        self.visit(node.body)

    def visit_Call(self, node):
        if _is_warn(node):
            return
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in SWAP:  # torch.sum(...) / x.sum(...), not an attribute `.mean`
            start, end = self.pos.span(f)
            if self.pos.source[end - len(f.attr):end] == f.attr:
                self.add(f.end_lineno, end - len(f.attr), end, SWAP[f.attr], f"`.{f.attr}` -> `.{SWAP[f.attr]}`")
        if isinstance(f, ast.Name) and f.id in ("min", "max"):
            start, end = self.pos.span(f)
            self.add(f.lineno, start, end, SWAP[f.id], f"`{f.id}` -> `{SWAP[f.id]}`")
        self.generic_visit(node)

    def visit_keyword(self, node):
        if node.arg in SWAP and node.arg in ("min", "max"):
            start = self.pos.offset(node.lineno, node.col_offset)
            self.add(node.lineno, start, start + len(node.arg), SWAP[node.arg], f"`{node.arg}=` -> `{SWAP[node.arg]}=`")
        self.visit(node.value)

    def visit_BinOp(self, node):
        if type(node.op) in BINOP and not any(_is_str(x) for x in (node.left, node.right)):
            old, new = BINOP[type(node.op)]
            self._token_swap(node, self.pos.span(node.left)[1], self.pos.span(node.right)[0], old, new)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if type(node.op) in AUGOP:
            old, new = AUGOP[type(node.op)]
            self._token_swap(node, self.pos.span(node.target)[1], self.pos.span(node.value)[0], old, new)
        self.visit(node.target)
        self.visit(node.value)

    def visit_BoolOp(self, node):
        old = "and" if isinstance(node.op, ast.And) else "or"
        for a, b in zip(node.values, node.values[1:], strict=False):
            self._token_swap(node, self.pos.span(a)[1], self.pos.span(b)[0], old, "or" if old == "and" else "and")
        self.generic_visit(node)

    def visit_Compare(self, node):
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            old, new = CMPOP[type(op)]
            toks = self.pos.between(self.pos.span(left)[1], self.pos.span(right)[0])
            if toks and " ".join(t[2] for t in toks) == old:
                self.add(_line_of(self.pos, toks[0][0]), toks[0][0], toks[-1][1], new, f"`{old}` -> `{new}`")
            left = right
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, (ast.USub, ast.Not)):
            start = self.pos.offset(node.lineno, node.col_offset)
            toks = [t for t in self.pos.tokens if t[0] == start]
            if toks and toks[0][2] in ("-", "not"):
                end = toks[0][1] + (1 if toks[0][2] == "not" and self.pos.source[toks[0][1]] == " " else 0)
                self.add(node.lineno, start, end, "", f"drop unary `{toks[0][2]}`")
        self.generic_visit(node)

    def visit_IfExp(self, node):
        self._negate(node.test, node.lineno)
        self.generic_visit(node)

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            new = str(not value)
        elif isinstance(value, int):
            new = str(value + 1)
        elif isinstance(value, float):
            new = repr(value + 1.0)
        else:
            return
        start, end = self.pos.span(node)
        self.add(node.lineno, start, end, new, f"`{self.pos.source[start:end]}` -> `{new}`")

    def visit_Attribute(self, node):
        start, end = self.pos.span(node)
        attr_start = end - len(node.attr)
        if node.attr in DROP_ATTR:
            dots = [t for t in self.pos.between(self.pos.span(node.value)[1], attr_start) if t[2] == "."]
            if dots:
                self.add(node.end_lineno, dots[-1][0], end, "", f"drop `.{node.attr}`")
        self.generic_visit(node)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _token_swap(self, node, a: int, b: int, old: str, new: str):
        toks = [t for t in self.pos.between(a, b) if t[2] == old]
        if toks:
            self.add(_line_of(self.pos, toks[0][0]), toks[0][0], toks[0][1], new, f"`{old}` -> `{new}`")

    def _negate(self, test, lineno: int):
        if isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) and lineno not in self.skip_lines:
            start, end = self.pos.span(test)
            text = self.pos.source[start:end]
            self.add(test.lineno, start, end, f"not ({text})", "negate the condition")


def _line_of(pos: _Positions, offset: int) -> int:
    lo, hi = 0, len(pos.starts) - 1
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pos.starts[mid] <= offset else (lo, mid)
    return lo + 1


def _is_str(node) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _is_warn(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr in ("warn", "warning")) or (isinstance(f, ast.Name)
                                                                                and f.id == "warn")


def collect_mutants(module: str, root: Path = ROOT) -> list[Mutant]:
    """The mutants of one module file (``module`` relative to ``root``): each compiles and differs from the
    original's AST."""
    source = (root / module).read_text()
    original = ast.dump(ast.parse(source))
    collector = _Collector(module, source)
    for stmt in ast.parse(source).body:
        collector.visit_stmt_dispatch(stmt)
    out, seen = [], set()
    for m in collector.out:
        text = m.apply(source)
        try:
            tree = ast.dump(ast.parse(text))
        except SyntaxError:
            continue
        if tree == original or text in seen:
            continue
        seen.add(text)
        out.append(m)
    return out


# -- coverage: which test runs which line ---------------------------------------------------------------------------
class _ContextPlugin:
    """pytest plugin for the coverage run: one coverage context per test (its node id), and each test's duration."""

    def __init__(self, cov):
        self.cov, self.durations, self.failed = cov, {}, set()

    def pytest_runtest_setup(self, item):
        self.cov.switch_context(item.nodeid)

    def pytest_runtest_logreport(self, report):
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self.failed.add(report.nodeid)

    def pytest_runtest_teardown(self, item, nextitem):
        if nextitem is None:
            self.cov.switch_context("")


def _coverage_child(tree: Path, pool: list[str], modules: list[str], out: Path) -> None:
    """Runs in a fresh interpreter (``--_cover``): the pool's tests under coverage, written to ``out`` as
    ``{"lines": {module: {line: [node ids]}}, "durations": ..., "failed": [...], "modules": [sys.modules]}``."""
    import coverage

    os.chdir(tree)
    sys.path.insert(0, str(tree))
    files = [str(tree / m) for m in modules]
    cov = coverage.Coverage(data_file=str(out) + ".coverage", include=files, branch=False, config_file=False)
    cov.start()
    import pytest

    plugin = _ContextPlugin(cov)
    rc = pytest.main([*pool, "-q", *IN_PROCESS, "-p", "no:cacheprovider", "--no-header",
                      "-W", "ignore::coverage.exceptions.CoverageWarning"], plugins=[plugin])
    cov.stop()
    data = cov.get_data()
    lines = {}
    for m, f in zip(modules, files, strict=True):
        # a line run outside any test (at import, by a test module's top level) also lists "<import>"
        lines[m] = {str(k): sorted(set(v) - {""}) + ["<import>"] * ("" in v)
                    for k, v in data.contexts_by_lineno(f).items()}
    import pyro_sparsegp

    out.write_text(json.dumps({"lines": lines, "durations": plugin.durations, "failed": sorted(plugin.failed),
                               "rc": int(rc), "package_file": pyro_sparsegp.__file__,
                               "modules": sorted(sys.modules)}))


def _tree_hash(tree: Path, extra: list[str]) -> str:
    h = hashlib.sha256("\n".join([FORMAT, *extra]).encode())
    for f in sorted([*tree.glob("pyro_sparsegp/**/*.py"), *tree.glob("tests/**/*.py"), tree / "pyproject.toml"]):
        h.update(str(f.relative_to(tree)).encode() + f.read_bytes())
    return h.hexdigest()


def coverage_map(tree: Path, work: Path, package: str, modules: list[str], pool: list[str]) -> dict:
    """The coverage run of ``package``'s test pool, reused while the sources, tests and modules are unchanged."""
    out = work / f"coverage_{package.replace('/', '_')}.json"
    key = _tree_hash(tree, pool + modules)
    if out.exists():
        data = json.loads(out.read_text())
        if data.get("key") == key:
            return data
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_cover", str(tree), str(out), ",".join(pool),
           *modules]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    if not data["package_file"].startswith(str(tree)):
        sys.exit(f"the coverage run imported {data['package_file']}, not the scratch copy under {tree}")
    data["key"], data["file"] = key, str(out)
    out.write_text(json.dumps(data))
    return data


# -- the two servers: mutants inside functions (pre-collected session), the rest (fresh import per mutant) ----------
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return env


def _fork(child, log: Path, timeout: float) -> str:
    """Run ``child()`` (returns an exit code) in a forked process with its output in ``log``: "killed" (a test
    failed or errored, a test module no longer imports, or a crash), "survived" (exit 0, or 5: no test ran),
    "timeout", or "unresolved" (exit 97: the session server could not place the mutant)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = int(child())
        except BaseException:  # noqa: BLE001 - reported through the exit code
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.01)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    if code in (0, 5):
        return "survived"
    if code == 97:
        return "unresolved"
    if code == 4 and "ERROR collecting" in log.read_text(errors="replace"):
        return "killed"  # the mutant broke a test module's import (pytest: "found no collectors" for its node ids)
    if code in (4, 98, 99):
        sys.exit(f"the harness failed (exit {code}); see {log}")
    return "killed"


def _codes(code):
    """``code`` and every code object nested in it, depth first in source order."""
    yield code
    for c in code.co_consts:
        if isinstance(c, type(code)):
            yield from _codes(c)


class _Unresolved(Exception):
    pass


def _live_function(module, qualname: str, firstlineno: int):
    """The function object of ``module`` with this qualified name and first line, found through the namespace and
    the decorators' ``__wrapped__``, ``__func__``, ``fget``/``fset``/``fdel`` and closures."""
    obj = module
    for part in qualname.split(".")[:-1]:
        obj = vars(obj).get(part)
    todo, seen = [vars(obj).get(qualname.split(".")[-1]) if obj is not None else None], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        code = getattr(x, "__code__", None)
        if code is not None and code.co_qualname == qualname and code.co_firstlineno == firstlineno:
            return x
        todo += [getattr(x, a, None) for a in ("__wrapped__", "__func__", "fget", "fset", "fdel")]
        todo += [c.cell_contents for c in (getattr(x, "__closure__", None) or ()) if _cell_full(c)]
    raise _Unresolved(qualname)


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _patch(job: dict, tree: Path) -> None:
    """Swap the code of the mutant's outermost function, in place, for the mutated one (every reference to the
    function, decorated or registered, sees it)."""
    path = tree / job["module"]
    source = path.read_text()
    mutated = source[:job["start"]] + job["new"] + source[job["end"]:]
    q = job["func"]
    originals = [c for c in _codes(compile(source, str(path), "exec", dont_inherit=True)) if c.co_qualname == q]
    index = [c.co_firstlineno for c in originals].index(job["func_line"])
    new = [c for c in _codes(compile(mutated, str(path), "exec", dont_inherit=True)) if c.co_qualname == q][index]
    if new.co_freevars != originals[index].co_freevars:
        raise _Unresolved("the mutant changes the closure")
    module = sys.modules[job["module"].removesuffix(".py").replace("/", ".").removesuffix(".__init__")]
    _live_function(module, q, job["func_line"]).__code__ = new


class _SessionServer:
    """pytest plugin: after collecting the pool once, fork a child per job that patches the function and runs the
    job's tests (in its order, stopping at the first failure) instead of the test loop."""

    def __init__(self, jobs: list, tree: Path, work: Path, results: dict):
        self.jobs, self.tree, self.work, self.results = jobs, tree, work, results

    def pytest_runtestloop(self, session):
        items = {item.nodeid: item for item in session.items}
        t0 = time.time()
        for i, job in enumerate(self.jobs):
            tests = [items[t] for t in job["tests"] if t in items]
            self.results[job["id"]] = _fork(lambda job=job, tests=tests: self._child(session, job, tests),
                                            self.work / "last_mutant.log", job["timeout"])
            if job["id"] == "baseline" and self.results["baseline"] != "survived":
                break
            if (i + 1) % 100 == 0:
                print(f"    session: {i + 1}/{len(self.jobs)} mutants, {time.time() - t0:.0f} s", flush=True)
        return True

    def _child(self, session, job, tests) -> int:
        if job.get("module"):
            try:
                _patch(job, self.tree)
            except (_Unresolved, ValueError, IndexError, KeyError, AttributeError) as e:
                print("unresolved:", repr(e))
                return 97
        for i, item in enumerate(tests):
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=tests[i + 1] if i + 1 < len(tests) else None)
            if session.testsfailed:
                return 1
        return 0


def _session_worker(tree: Path, work: Path, pool: list[str], jobs_file: Path, out: Path) -> None:
    import pytest

    jobs, results = json.loads(jobs_file.read_text()), {}
    os.chdir(tree)
    sys.path.insert(0, str(tree))
    pytest.main([*pool, "-q", *IN_PROCESS, "-p", "no:cacheprovider", "--no-header"],
                plugins=[_SessionServer(jobs, tree, work, results)])
    if not sys.modules["pyro_sparsegp"].__file__.startswith(str(tree)):
        sys.exit(f"the session imported {sys.modules['pyro_sparsegp'].__file__}, not the copy under {tree}")
    out.write_text(json.dumps(results))


def preload(modules: list[str], tree: Path) -> None:
    """Import (once, in the fresh-import server) the third-party modules that the tests imported, so that each child
    imports only ``pyro_sparsegp`` and the test files."""
    plugin_modules = set()  # pytest rewrites the asserts of its plugins' distributions: they must not be imported yet
    for ep in importlib.metadata.entry_points(group="pytest11"):
        for f in ep.dist.files or ():
            if f.suffix == ".py" or f.name == "__init__.py":
                plugin_modules.add(f.parts[0].removesuffix(".py"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            top = name.split(".")[0]
            if top in ("pyro_sparsegp", "__main__", "conftest") or top.startswith("test_") or top in plugin_modules:
                continue
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError, AttributeError):
                continue
            origin = getattr(spec, "origin", None) or ""
            if spec is None or origin.startswith((str(tree), str(ROOT))):
                continue
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module that does not import on its own is imported by its user
                pass


def _fresh_child(tree: Path, tests: list[str]) -> int:
    os.chdir(tree)
    sys.path.insert(0, str(tree))
    import pytest

    rc = pytest.main(["-x", "-q", *IN_PROCESS, "-p", "no:cacheprovider", "--no-header", *tests])
    imported = getattr(sys.modules.get("pyro_sparsegp"), "__file__", None) or str(tree)
    return 98 if not imported.startswith(str(tree)) else int(rc)


def _fresh_worker(tree: Path, work: Path, cover_file: list[str], jobs_file: Path, out: Path) -> None:
    """Mutants run at import (module and class level, defaults, functions called at import): the mutant is written
    into the file and a child forked from a server without ``pyro_sparsegp`` imports it afresh."""
    jobs, results = json.loads(jobs_file.read_text()), {}
    preload(json.loads(Path(cover_file[0]).read_text())["modules"], tree)
    for job in jobs:
        path = tree / job["module"]
        source = path.read_text()
        pyc = Path(importlib.util.cache_from_source(str(path)))
        path.write_text(source[:job["start"]] + job["new"] + source[job["end"]:])
        pyc.unlink(missing_ok=True)  # a stale .pyc of the same size and second would hide the mutant
        try:
            results[job["id"]] = _fork(lambda job=job: _fresh_child(tree, job["tests"]), work / "last_mutant.log",
                                       job["timeout"])
        finally:
            path.write_text(source)
            pyc.unlink(missing_ok=True)
    out.write_text(json.dumps(results))


def _run_worker(kind: str, tree: Path, work: Path, arg: list[str], jobs: list) -> dict:
    if not jobs:
        return {}
    jobs_file, out = work / f"jobs_{kind}.json", work / f"results_{kind}.json"
    jobs_file.write_text(json.dumps(jobs))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--_{kind}", str(tree), str(work), ",".join(arg),
           str(jobs_file), str(out)]
    subprocess.run(cmd, check=True, env=_env())
    return json.loads(out.read_text())


def select_tests(m: Mutant, cover: dict, max_tests: int | None = None) -> tuple[list[str], bool]:
    """The tests that cover the mutant's lines, fastest first, and whether the lines run at import; a mutant run at
    import (a registration, a module constant) may change what any test sees without that test running a line of the
    module: then every test of the pool follows. ``max_tests``: only that many of them, the fastest (a mutant only
    a slower test would kill then counts as a survivor: the score is a lower bound)."""
    lines = cover["lines"][m.module]
    tests = {t for ln in m.lines for t in lines.get(str(ln), ())}
    at_import = "<import>" in tests or not m.lines
    tests.discard("<import>")
    order = lambda t: cover["durations"].get(t, 0.0)  # noqa: E731
    failed = set(cover["failed"])
    first = sorted(tests - failed, key=order)
    rest = sorted(set(cover["durations"]) - tests - failed, key=order) if at_import else []
    return (first + rest)[:max_tests], at_import


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sample_mutants(mutants: list[Mutant], k: int | None, seed: int, module: str) -> list[Mutant]:
    """At most ``k`` of one module's mutants, a uniform random sample seeded by ``seed`` and the module path (so a
    module's sample does not depend on which other modules run), in file order; all of them if ``k`` is None or there
    are no more than ``k``."""
    if k is None or len(mutants) <= k:
        return mutants
    keep = sorted(random.Random(f"{seed}:{module}").sample(range(len(mutants)), k))
    return [mutants[i] for i in keep]


def run_package(package: str, modules: list[str], tree: Path, work: Path, equivalent: dict, check_eq: bool,
                earlier: dict | None = None, pool: list[str] | None = None, sample: int | None = None,
                seed: int = 0, max_tests: int | None = None) -> dict:
    """Run the mutants of ``modules`` against ``package``'s pool (or ``pool``). ``earlier`` (a detail file): a module
    unchanged since that run (same sha256) runs only the mutants that survived it; the others count as killed (tests
    were only added, so ``pool`` may then name just the new test files); a module sampled in that run is sampled
    again with the same size and seed, so the same mutants are judged. ``sample``: at most that many mutants per
    module (:func:`sample_mutants`)."""
    t0 = time.time()
    pool = pool or PACKAGES[package]
    cover = coverage_map(tree, work, package, modules, pool)
    print(f"[{package}] coverage run: {len(cover['durations'])} tests, {time.time() - t0:.0f} s, "
          f"{len(cover['failed'])} failing (left out): {cover['failed'][:5]}", flush=True)
    timeout = lambda tests: 5 * sum(cover["durations"].get(t, 1.0) for t in tests) + 60  # noqa: E731
    every = sorted({t for m in modules for ts in cover["lines"][m].values() for t in ts} - {"<import>"}
                   - set(cover["failed"]), key=lambda t: cover["durations"].get(t, 0.0))[:BASELINE_TESTS]
    mutants, sampling = {}, {}
    for module in modules:
        every_mutant = collect_mutants(module, tree)
        k, s = sample, seed
        before = (earlier or {}).get("sampling", {}).get(module)
        if earlier and earlier.get("sources", {}).get(module) == _sha(tree / module):
            k, s = (before["k"], before["seed"]) if before and before.get("sampled") else (None, seed)
        mutants[module] = sample_mutants(every_mutant, k, s, module)
        sampling[module] = {"sampled": len(mutants[module]) < len(every_mutant), "population": len(every_mutant),
                            "k": k, "seed": s}
    session, fresh, by_id = [{"id": "baseline", "tests": every, "timeout": timeout(every)}], [], {}
    for module, ms in mutants.items():
        eq_keys = equivalent_keys(equivalent, module)
        survived_before = None
        if earlier and earlier.get("sources", {}).get(module) == _sha(tree / module):
            survived_before = {(e["location"], e["code"], e["mutation"]) for e in earlier["survivors"].get(module, [])}
        for i, m in enumerate(ms):
            m.status = "equivalent?" if m.key() in eq_keys else ""
            if m.status and not check_eq:
                continue
            if not m.status and survived_before is not None and m.key() not in survived_before:
                m.status = "killed"  # in the earlier run
                continue
            m.tests, at_import = select_tests(m, cover, max_tests)
            if not m.tests:
                m.status += "survived"
                continue
            job = {"id": f"{module}#{i}", "module": module, "start": m.start, "end": m.end, "new": m.new,
                   "func": m.func, "func_line": m.func_line, "tests": m.tests, "timeout": timeout(m.tests)}
            by_id[job["id"]] = m
            (fresh if at_import or m.func is None else session).append(job)
    print(f"[{package}] {sum(map(len, mutants.values()))} mutants: {len(session) - 1} in the session server, "
          f"{len(fresh)} with a fresh import", flush=True)
    results = _run_worker("session", tree, work, pool, session)
    if results.get("baseline") != "survived":
        sys.exit(f"the unmutated tree fails its tests in the harness ({results.get('baseline')}); see "
                 f"{work / 'last_mutant.log'}")
    unresolved = [j for j in session[1:] if results[j["id"]] == "unresolved"]
    print(f"[{package}] session done ({time.time() - t0:.0f} s); {len(unresolved)} unresolved go to a fresh import")
    results.update(_run_worker("fresh", tree, work, [cover["file"]], fresh + unresolved))
    out = {}
    for module, ms in mutants.items():
        counts = tally(module, ms, results, equivalent)
        out[module] = (counts, ms)
        note = f" (a sample of {len(ms)} of {sampling[module]['population']})" if sampling[module]["sampled"] else ""
        print(f"[{package}] {module}: {counts}{note}", flush=True)
    return {"results": out, "wall_s": round(time.time() - t0, 1), "tests": len(cover["durations"]),
            "sampling": sampling}


# -- bookkeeping: outcomes, counts, the record files -------------------------------------------------------------------
def equivalent_keys(equivalent: dict, module: str) -> set:
    """The ``(location, code, mutation)`` keys of ``module``'s entries in the equivalent-mutants list (the line
    number is not part of the key, so an entry survives edits elsewhere in the file): compared with
    :meth:`Mutant.key`."""
    return {(e["location"], e["code"], e["mutation"]) for e in equivalent.get(module, [])}


def tally(module: str, mutants: list[Mutant], results: dict, equivalent: dict) -> dict:
    """Settle each mutant's status from the workers' ``results`` (``"<module>#<index>"`` -> ``"killed"``,
    ``"survived"``, ``"timeout"``; a mutant without a result keeps the status set before the run) and count the
    module's ``{"killed", "survived", "equivalent"}``: a timeout counts as killed, a listed equivalent mutant as
    equivalent whatever its run said (with a warning where a test killed it), and stale equivalent entries (no such
    mutant now) are warned about."""
    counts = {"killed": 0, "survived": 0, "equivalent": 0}
    for i, m in enumerate(mutants):
        m.status += results.get(f"{module}#{i}", "")
        if m.status.startswith("equivalent?"):
            if m.status not in ("equivalent?", "equivalent?survived"):
                print(f"  WARNING: listed as equivalent but {m.status[11:]}: {module} {m.key()}")
            m.status = "equivalent"
        counts["killed" if m.status == "timeout" else m.status] += 1
        if m.status == "survived":
            print(f"  survived {module}:{m.line} {m.location}: {m.mutation}  | {m.code}")
    for stale in equivalent_keys(equivalent, module) - {m.key() for m in mutants}:
        print(f"  WARNING: stale equivalent entry (no such mutant now): {module} {stale}")
    return counts


def record_run(score: dict, detail: dict, package: str, run: dict, tree: Path, max_tests: int | None) -> None:
    """Merge one package's :func:`run_package` result into the score and detail records (in place): the entries of
    the modules run are replaced (a module without mutants keeps its score entry), the others kept."""
    for module, (counts, mutants) in run["results"].items():
        detail.setdefault("sources", {})[module] = _sha(tree / module)
        detail.setdefault("sampling", {})[module] = run["sampling"][module]
        if sum(counts.values()):
            score[module] = counts
        detail.setdefault("survivors", {})[module] = [
            {"location": m.location, "line": m.line, "code": m.code, "mutation": m.mutation,
             "covering_tests": len(m.tests)} for m in mutants if m.status == "survived"]
    detail.setdefault("runs", {})[package] = {
        "wall_s": run["wall_s"], "tests_in_pool": run["tests"], "max_tests": max_tests,
        "mutants": sum(sum(c.values()) for c, _ in run["results"].values()),
        "modules": {m: c for m, (c, _) in run["results"].items()}}


def write_records(score_path: str | Path, score: dict, detail_path: str | Path, detail: dict) -> None:
    for path, obj in ((score_path, score), (detail_path, detail)):
        Path(path).write_text(json.dumps(dict(sorted(obj.items())), indent=1) + "\n")


# -- command line ---------------------------------------------------------------------------------------------------
def targets_to_modules(targets: list[str]) -> dict[str, list[str]]:
    by_package: dict[str, list[str]] = {}
    for target in targets or list(PACKAGES):
        target = target.rstrip("/").removeprefix("pyro_sparsegp/")
        if target in PACKAGES:
            files = sorted((ROOT / "pyro_sparsegp" / target).glob("*.py"))
            by_package.setdefault(target, []).extend(str(f.relative_to(ROOT)) for f in files)
            continue
        package = str(Path(target).parent)
        if package not in PACKAGES or not (ROOT / "pyro_sparsegp" / target).is_file():
            sys.exit(f"unknown target {target!r}: name a package of {list(PACKAGES)} or a module file in one")
        by_package.setdefault(package, []).append("pyro_sparsegp/" + target)
    return by_package


def make_tree(work: Path) -> Path:
    """A scratch copy of the working tree (tracked and untracked, not ignored, files) for the mutants."""
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True, text=True,
                           capture_output=True).stdout.split("\n")
    for f in filter(None, files):
        if (ROOT / f).is_file() and not f.startswith(("tutorials/", "docs/")):
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    return tree


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_cover":
        tree, out, pool = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4].split(",")
        return _coverage_child(tree, pool, sys.argv[5:], out)
    if len(sys.argv) > 1 and sys.argv[1] in ("--_session", "--_fresh"):
        worker = _session_worker if sys.argv[1] == "--_session" else _fresh_worker
        return worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4].split(","), Path(sys.argv[5]),
                      Path(sys.argv[6]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("targets", nargs="*")
    p.add_argument("--score", default=str(RECORDS / "mutation_score.json"))
    p.add_argument("--detail", default=str(RECORDS / "mutation_detail.json"))
    p.add_argument("--equivalent", default=str(RECORDS / "mutation_equivalent.json"))
    p.add_argument("--work", default="/tmp/pyro_sparsegp_mutation")
    p.add_argument("--list", action="store_true", help="print the mutants and run nothing")
    p.add_argument("--check-equivalent", action="store_true", help="run the listed equivalent mutants too")
    p.add_argument("--pool", nargs="+", help="test files or folders to judge by, instead of the package's (with "
                   "--survivors-of: the tests added since that run)")
    p.add_argument("--survivors-of", metavar="DETAIL", help="a detail file of an earlier run: in modules unchanged "
                   "since, run only its survivors and count the rest as killed")
    p.add_argument("--sample", type=int, metavar="K", help="run a seeded random sample of at most K mutants per module "
                   "(all if fewer); the detail file marks the module sampled with its population")
    p.add_argument("--seed", type=int, default=0, help="the seed of --sample (default 0)")
    p.add_argument("--max-tests", type=int, metavar="N", help="run each mutant against at most the N fastest of its "
                   "covering tests (a survivor otherwise runs them all: minutes where a line is covered by ~200 "
                   "tests); the score is then a lower bound")
    args = p.parse_args()
    by_package = targets_to_modules(args.targets)
    if args.list:
        for modules in by_package.values():
            for module in modules:
                for m in sample_mutants(collect_mutants(module), args.sample, args.seed, module):
                    print(f"{module}:{m.line} {m.location}: {m.mutation}  | {m.code}")
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    equivalent = json.loads(Path(args.equivalent).read_text()) if Path(args.equivalent).exists() else {}
    score = json.loads(Path(args.score).read_text()) if Path(args.score).exists() else {}
    detail = json.loads(Path(args.detail).read_text()) if Path(args.detail).exists() else {"runs": {}, "survivors": {}}
    earlier = json.loads(Path(args.survivors_of).read_text()) if args.survivors_of else None
    tree = make_tree(work)
    for package, modules in by_package.items():
        run = run_package(package, modules, tree, work, equivalent, args.check_equivalent, earlier, args.pool,
                          args.sample, args.seed, args.max_tests)
        record_run(score, detail, package, run, tree, args.max_tests)
        write_records(args.score, score, args.detail, detail)
        print(f"[{package}] done in {run['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
