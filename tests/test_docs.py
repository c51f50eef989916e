"""The documentation site builds with warnings as errors (``python -m sphinx -W -b html docs OUT``), and its key pages
exist: the API reference (with SVGP and SOLVEGP), the equations table, the site contract, and one page per tutorial
notebook, rendered with its stored outputs (each has at least one figure)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))


def _text(path: Path) -> str:
    return re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))


def test_sphinx_build_without_warnings(tmp_path):
    out = tmp_path / "html"
    run = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]

    for page in ["index", "getting_started", "conventions", "equations", "tutorials", "api"]:
        assert (out / f"{page}.html").is_file(), page

    api = _text(out / "api.html")
    assert "pyro_sparsegp.SVGP" in api and "pyro_sparsegp.SOLVEGP" in api
    # autodoc anchors: the classes and their members are documented, not only the module docstrings
    layers = (out / "api" / "pyro_sparsegp.layers.html").read_text(encoding="utf-8")
    assert 'id="pyro_sparsegp.layers.SVGP"' in layers and 'id="pyro_sparsegp.layers.SVGP.analytic_elbo"' in layers
    solvegp = (out / "api" / "pyro_sparsegp.solvegp.html").read_text(encoding="utf-8")
    assert 'id="pyro_sparsegp.solvegp.SOLVEGP"' in solvegp

    equations = _text(out / "equations.html")
    for needle in ["Hensman, Fusi, Lawrence (2013)", "Shi, Titsias, Mnih (2020)", "Wenzel", "Villacampa-Calvo",
                   "l3_bound", "kl_sparse_bound", "solvegp_elbo", "pg_bound", "polya_gamma_natgrad_step"]:
        assert needle in equations, needle

    assert "which dimension is which" in _text(out / "conventions.html").lower()

    assert NOTEBOOKS
    for nb in NOTEBOOKS:
        page = out / "tutorials" / f"{nb.stem}.html"
        assert page.is_file(), f"tutorial {nb.name} has no page"
        assert "<img" in page.read_text(encoding="utf-8"), f"tutorial {nb.name} is rendered without a figure"
