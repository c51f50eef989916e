"""Every ```python block of README.md and docs/*.md runs, so that a snippet cannot drift from the API.

How a page is run (one test per page, so a failure names the page, the block's index and its first line):

* its ```python blocks are extracted in order and executed in **one namespace**, in order (later blocks use the names
  of earlier ones), as a reader pasting them into one Python session would;
* the namespace starts with the page's **setup** (``SETUP`` below: imports and tiny data such as ``X``, ``y``, ``Z``,
  ``Xtest``, which many snippets use without defining). ``SETUP[page]`` maps a block index to the code run just
  before that block: ``0`` is the page's setup, a later index re-binds small data for a block whose names the page
  leaves to the reader;
* the snippets keep realistic sizes in the Markdown; the test shrinks the training lengths with the substitutions
  listed in ``SUBSTITUTIONS`` (nothing else in the code is rewritten);
* a block that is not meant to run is ```bash (or another language), or carries an HTML comment on the line just
  before its fence, ``<!-- snippet: skip (the reason) -->``; a page may skip at most ``MAX_SKIPPED`` blocks and each
  skip must give its reason;
* every page has at least one block that runs, and every block that runs **asserts** what it claims (an ``assert``
  statement: a figure within a bound, a shape, an average written, an identity), so that a snippet that runs but no
  longer does what its page says fails; a block with nothing of its own to assert is listed in ``NO_ASSERT`` with
  the reason (``test_every_snippet_asserts`` checks both, and that no entry is stale);
* Pyro's settings are a newcomer's (``module_local_params`` off, so modules share Pyro's global parameter store) and
  warnings are errors (pyproject's ``filterwarnings``): a snippet that warns fails.

The working directory is a fresh temporary folder, so snippets that write files (``train.npy``, checkpoints) leave
nothing behind. ``test_state_dict_loads_in_a_fresh_process`` runs docs/saving.md's across-process recipe in a new
interpreter. A snippet that fails because of a library problem is listed in ``LIBRARY_FAILURES`` with the error: its
page's test is then ``xfail(strict=True)``, and passes again only once the library is fixed and the entry removed.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pyro
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MAX_SKIPPED = 2
SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\s`]*)\s*$")

# Smoke sizes: (pattern, replacement), applied to every block of every page; each shortens a training run only.
SUBSTITUTIONS = [
    # fit(..., num_steps=2000) -> num_steps=20: a hundredth, between 2 and 20 (700 -> 7 stays below 2000 -> 20)
    (r"\bnum_steps=(\d[\d_]*)", lambda m: f"num_steps={min(20, max(2, int(m[1]) // 100))}"),
    # fit(..., checkpoint=ps.infer.Checkpoint("run.pt", every=100)) -> every=1: a hundredth too, at least 1
    (r"\bevery=(\d[\d_]*)", lambda m: f"every={max(1, int(m[1]) // 100)}"),
    # a hand-written SVI loop: for step in range(1000) -> range(3)
    (r"\bfor step in range\(\d[\d_]*\)", "for step in range(3)"),
    # a hand-written SVI loop's step count: steps = 2000 -> steps = 3 (NaturalGradient(..., num_steps=steps))
    (r"\bsteps = \d[\d_]*", "steps = 3"),
]

_DATA = """
import torch
X, y = torch.randn(300, 4), torch.randn(300)
Xtest = torch.randn(16, 4)
Z = X[:8].clone()
"""

# page -> {index of the block it runs before: code}. Index 0 is the page's own setup.
SETUP = {
    "README.md": {
        # blocks 0, 1 and 3+ define or re-bind their data; the "More" blocks use X, y, Z, D of the reader's problem
        2: _DATA + "D = 4\n",
        4: _DATA + "y01 = (y > 0).to(y.dtype)\n",
        # 28x28 greyscale images as rows [N, 784]: inducing patches Zp [8, 25], orthogonal patches O, images Zimg
        5: """
import torch
from pyro_sparsegp.inducing import init_patches
X = torch.rand(16, 784)
Zp = init_patches(X, (28, 28, 1), 5, M=8, num_images=16, per_centre=10)
O = init_patches(X, (28, 28, 1), 5, M=4, num_images=16, per_centre=10, seed=1)
Zimg = X[:4].clone()
""",
    },
    "docs/getting_started.md": {},
    "docs/conventions.md": {0: "import torch\nX = torch.randn(300, 2)\ny = (X[:, 0] > 0).to(X.dtype)\n"},
    "docs/multioutput.md": {},
    "docs/composing.md": {0: _DATA},
    "docs/gplvm.md": {},
    "docs/deep_gp.md": {
        1: "X_test, y_test = torch.randn(16, 4), torch.randn(16)\n",
    },
    "docs/streaming.md": {  # the page's "train.npy": 2,000 rows [x_1, ..., x_4, y]
        0: "import torch\nfrom pyro_sparsegp.data_stream import write_npy\n"
           "write_npy('train.npy', torch.randn(2000, 4), torch.randn(2000))\n",
    },
    "docs/equations.md": {},
    "docs/fitting.md": {},
    "docs/fitting_measurements.md": {0: f"import os\nos.chdir({str(ROOT)!r})\n"},  # the page reads benchmarks/records/
    "docs/likelihoods.md": {},
    "docs/extending.md": {},
    "docs/tutorials.md": {0: f"import os\nos.chdir({str(ROOT)!r})\n"},  # the page reads tutorials/ from the root
    "docs/index.md": {},
    "docs/saving.md": {},
    "docs/deployment.md": {},
    "docs/groups.md": {},
    "docs/gpu.md": {  # torchrun's environment for a world of one process (gloo on the CPU), on a free port
        3: """
import os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
""",
    },
    "docs/writing_programs.md": {},  # its first block makes its data
}

FLOAT32 = os.environ.get("PYRO_SPARSEGP_DTYPE", "float64") == "float32"  # the float32 pass of the suite (conftest)

# page -> [(applies, reason)]: snippets that fail (or warn) because of a library problem, for the library's owner to
# fix; the page's test is marked xfail(strict=True) where ``applies``, so it fails once the library is fixed.
LIBRARY_FAILURES: dict[str, list[tuple[bool, str]]] = {}

# (page, python block index) -> why the block has no assert of its own (each block that runs asserts otherwise)
NO_ASSERT: dict[tuple[str, int], str] = {
    ("docs/saving.md", 0): "trains the model whose saving and loading the page's next four blocks assert",
    ("docs/saving.md", 5): "predict.py for a fresh process: test_state_dict_loads_in_a_fresh_process runs it in one "
                           "and asserts that its predictions equal the trained module's",
    ("docs/gpu.md", 1): "block 0's fit from a TensorDataset instead of tensors, no result of its own; the dataset "
                        "path's batches are tested in tests/infer/test_fit.py",
    ("docs/gpu.md", 3): "a torchrun script; that ranks stay identical and rank 0 saves is asserted by "
                        "tests/integration/test_distributed.py",
}


def blocks(text: str):
    """``[(index, lang, code, skip_reason, line)]`` for the fenced blocks of a Markdown page (``index`` counts the
    ```python blocks only; other languages get ``None``)."""
    out, lines, i, k = [], text.splitlines(), 0, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(prev)
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^ *```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        i += 1
        lang = m["lang"]
        index = None
        if lang == "python":
            index, k = k, k + 1
        out.append((index, lang, "\n".join(body) + "\n", skip["reason"].strip() if skip else None, start + 1))
    return out


def shrink(code: str) -> str:
    for pattern, repl in SUBSTITUTIONS:
        code = re.sub(pattern, repl, code)
    return code


def _run(code: str, filename: str, ns: dict) -> None:
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks show the lines
    exec(compile(code, filename, "exec"), ns)


def test_blocks_reads_fences_and_skip_markers():
    page = textwrap.dedent("""\
        Text.

        ```python
        a = 1
        ```

        ```bash
        pip install x
        ```

        <!-- snippet: skip (pseudo-code with ... placeholders) -->
        ```python
        f(...)
        ```

        * in a list:

          ```python
          b = a + 1
          ```
        """)
    found = blocks(page)
    assert [(i, lang, reason) for i, lang, _, reason, _ in found] == [
        (0, "python", None), (None, "bash", None), (1, "python", "pseudo-code with ... placeholders"),
        (2, "python", None)]
    assert found[0][2] == "a = 1\n" and found[3][2] == "b = a + 1\n"  # the list item's indent removed
    shrunk = shrink("fit(gp, X, y, num_steps=20_000, checkpoint=ps.infer.Checkpoint(None, every=100))")
    assert shrunk == "fit(gp, X, y, num_steps=20, checkpoint=ps.infer.Checkpoint(None, every=1))"
    assert shrink("steps = 2000\nNaturalGradient(a, num_steps=steps)\nfor step in range(steps):") == (
        "steps = 3\nNaturalGradient(a, num_steps=steps)\nfor step in range(steps):")


def test_every_page_is_covered():
    assert set(SETUP) == set(PAGES), "add the new page to SETUP (an empty dict when it needs no setup)"
    for page in PAGES:
        assert all(isinstance(k, int) and k >= 0 for k in SETUP[page]), page


def _asserts(code: str) -> bool:
    """Whether ``code`` holds an ``assert`` statement (at any depth)."""
    return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))


def test_every_snippet_asserts():
    """Every page runs at least one block; every block that runs asserts something, or is in ``NO_ASSERT`` with a
    reason; no ``NO_ASSERT`` entry names a block that asserts or does not run."""
    missing, stale = [], []
    for page in PAGES:
        runnable = _runnable(page)
        assert runnable, f"{page}: no python block runs; give the page a snippet that asserts what it claims"
        for index, code, line in runnable:
            listed = (page, index) in NO_ASSERT
            if not _asserts(code) and not listed:
                missing.append(f"{page}:{line} (block {index})")
            if listed and _asserts(code):
                stale.append(f"{page} block {index} asserts now")
    runs = {(page, index) for page in PAGES for index, _, _ in _runnable(page)}
    stale += [f"{key} does not run" for key in NO_ASSERT if key not in runs]
    assert not missing, "snippets without an assert (add one, or a NO_ASSERT entry with the reason):\n" + "\n".join(
        missing)
    assert not stale, f"stale NO_ASSERT entries: {stale}"
    assert all(len(reason) >= 20 for reason in NO_ASSERT.values())
    assert _asserts("for i in x:\n    assert i\n") and not _asserts("x = 1  # assert nothing\n")


def _runnable(page: str):
    """The page's ```python blocks that run, ``[(index, code, line)]``, after checking its skip markers."""
    found = blocks((ROOT / page).read_text(encoding="utf-8"))
    skipped = [b for b in found if b[0] is not None and b[3] is not None]
    assert len(skipped) <= MAX_SKIPPED, f"{page}: {len(skipped)} python blocks skipped (at most {MAX_SKIPPED})"
    for _, _, _, reason, line in found:
        if reason is not None:
            assert len(reason) >= 10, f"{page}:{line}: a skipped block needs a reason in the marker"
    runnable = [(b[0], b[2], b[4]) for b in found if b[0] is not None and b[3] is None]
    for index in SETUP[page]:
        assert any(b[0] == index for b in runnable), f"{page}: SETUP names block {index}, which does not run"
    return runnable


def _run_page(page: str, ns: dict, until=None) -> None:
    """Run the page's setup and blocks in ``ns``, in order (up to and including block ``until``); a failure names
    the page, the block's index and line, and its first line."""
    for index, code, line in _runnable(page):
        setup = SETUP[page].get(index)
        if setup:
            _run(textwrap.dedent(setup), f"<setup of {page} block {index}>", ns)
        first = code.strip().splitlines()[0] if code.strip() else ""
        error = None
        try:
            _run(shrink(code), f"{page}:{line} (block {index})", ns)
        except Exception as exc:  # noqa: BLE001 - reported with the page, block and first line
            error = "".join(traceback.format_exception(exc)[-12:])
        if error is not None:
            pytest.fail(f"{page}, python block {index} (line {line}: {first!r}) raised\n{error}", pytrace=False)
        if index == until:
            return


def _params():
    """The pages, a page with a library failure marked ``xfail(strict=True)``: it must fail until the fix."""
    for page in PAGES:
        reason = "; ".join(why for applies, why in LIBRARY_FAILURES.get(page, []) if applies)
        yield pytest.param(page, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else page


@pytest.mark.parametrize("page", list(_params()))
def test_page_snippets_run(page, tmp_path, monkeypatch):
    from pyro_sparsegp.covariances import dispatch

    monkeypatch.chdir(tmp_path)
    pyro.clear_param_store()
    environ = dict(os.environ)
    # a page may register covariance rules (docs/extending.md): its classes' methods hold the page's namespace, so a
    # rule left registered would keep the page's modules, and their names ("gp"), alive for every later test
    registry = [(d, dict(d)) for d in (dispatch._RULES, dispatch._DIAGS, dispatch._HINTS)]
    try:
        with pyro.settings.context(module_local_params=False):  # Pyro's default, as in a new session
            _run_page(page, {"__name__": "__snippet__"})
    finally:  # a page's setup may set torchrun's variables; a failed page may leave a process group
        os.environ.clear()
        os.environ.update(environ)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for live, saved in registry:
            live.clear()
            live.update(saved)
        dispatch._CACHE.clear()


def test_state_dict_loads_in_a_fresh_process(tmp_path, monkeypatch):
    """docs/saving.md, "In another process": the model trained and its state_dict saved here (the page's blocks up
    to the state_dict section), the page's ``# predict.py`` block run by a new interpreter (``python -c``, warnings
    as errors) in the same folder; its predictions equal the trained module's."""
    page = "docs/saving.md"
    runnable = _runnable(page)
    saver = next(i for i, code, _ in runnable if 'torch.save(gp.state_dict(), "svgp.pt")' in code)
    child = next(code for _, code, _ in runnable if code.startswith("# predict.py"))
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__snippet__"}
    with pyro.settings.context(module_local_params=False):
        _run_page(page, ns, until=saver)
    assert (tmp_path / "svgp.pt").is_file()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    code = shrink(child) + "\ntorch.save((mean, var), 'predicted_in_child.pt')\n"
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    mean, var = torch.load(tmp_path / "predicted_in_child.pt")
    assert mean.dtype == ns["mean"].dtype and mean.shape == ns["mean"].shape
    # the child loads with map_location="cpu"; the parent's module is on the suite's device
    assert torch.allclose(mean, ns["mean"].cpu()) and torch.allclose(var, ns["var"].cpu())
