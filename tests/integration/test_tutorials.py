"""Every tutorial notebook runs end to end (in its smoke-test mode: PYRO_SPARSEGP_SMOKE=1 cuts iterations), and the
data-parallel tutorial's script runs under torchrun with two processes."""
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
WARNING = re.compile(r"\b\w*Warning\b: ")  # how Python shows a warning: "path:line: SomeWarning: message"


def _warnings_shown(nb):
    """The warnings a reader of the notebook sees: every ``Warning: `` line in a cell's text outputs."""
    shown = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        for o in cell.get("outputs", []):
            text = o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
            shown += [f"cell {i + 1}: {line.strip()}" for line in str(text).splitlines() if WARNING.search(line)]
    return shown


def test_there_are_tutorials():
    names = {p.stem for p in NOTEBOOKS}
    assert {"solvegp_snelson", "hierarchical_gp", "gplvm"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_executed(path):
    """Tutorials are committed with the outputs of a full run: every code cell executed in order, no error, plots."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert not _warnings_shown(nb), _warnings_shown(nb)  # the default path is warning-free


def test_warnings_shown_finds_a_warning_line():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
        "stream", name="stderr", text="/x/layers.py:256: IllConditionedWarning: cholesky: a 10 x 10 matrix\n")])])
    assert _warnings_shown(nb) == ["cell 1: /x/layers.py:256: IllConditionedWarning: cholesky: a 10 x 10 matrix"]
    nb.cells[0].outputs[0].text = "fit: step 20/20 (100%)  elbo -287.8\n"
    assert _warnings_shown(nb) == []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYRO_SPARSEGP_SMOKE", "1")
    # the kernel imports this checkout's package (not another installed copy), as the tests themselves do
    root = str(ROOT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert not _warnings_shown(nb), _warnings_shown(nb)  # no warning on the default path, without a filter
    assert os.environ["PYRO_SPARSEGP_SMOKE"] == "1"


def test_distributed_script_under_torchrun(tmp_path):
    """tutorials/distributed_train.py under torchrun with two gloo processes (smoke mode): the ranks hold identical
    parameters, equal to a single process trained on the union of their minibatches."""
    import json
    import subprocess
    import sys

    script = ROOT / "tutorials" / "distributed_train.py"
    out = tmp_path / "result.json"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYRO_SPARSEGP_SMOKE="1", OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         "--steps", "12", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and len(res["losses_data_parallel"]) == 12
    assert res["max_abs_diff_between_ranks"] == 0.0
    assert res["max_abs_diff_to_single_process"] < 1e-8
    assert res["losses_data_parallel"][-1] < res["losses_data_parallel"][0]  # it trains
