"""Every tutorial notebook runs end to end (in its smoke-test mode: PYRO_SPARSEGP_SMOKE=1 cuts iterations)."""
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "tutorials").glob("*.ipynb"))


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYRO_SPARSEGP_SMOKE", "1")
    # the kernel imports this checkout's package (not another installed copy), as the tests themselves do
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert os.environ["PYRO_SPARSEGP_SMOKE"] == "1"
