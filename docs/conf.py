"""Sphinx configuration of the pyro_sparsegp documentation.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (warnings are errors;
``tests/integration/test_docs.py`` runs it).

Two folders of the source tree are generated here, at every build, and are not in git:

* ``docs/tutorials/``: a copy of every ``tutorials/*.ipynb`` (and the files beside them), which ``tutorials.md``
  includes by a glob, so that a new notebook in ``tutorials/`` appears on the site without an edit. The notebooks are
  rendered with their committed outputs (myst-nb, ``nb_execution_mode = "off"``): the site never executes them.
* ``docs/api/``: one page per public module of the package (found by walking it), so that a new module appears in the
  API reference without an edit.
"""

import importlib
import pkgutil
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # document the checkout this conf.py belongs to, installed or not

import pyro_sparsegp  # noqa: E402

project = "pyro_sparsegp"
author = "pyro_sparsegp contributors"
copyright = "pyro_sparsegp contributors"  # noqa: A001
release = version = pyro_sparsegp.__version__

extensions = [
    "myst_nb",  # Markdown pages and the tutorial notebooks (with their stored outputs); also loads myst_parser
    "sphinx.ext.autodoc",  # the API reference from the docstrings (which use the :param: field style)
    "sphinx.ext.mathjax",  # LaTeX in docstrings, pages and notebooks
    "sphinx.ext.viewcode",  # links from the API reference to the highlighted source
]
myst_enable_extensions = ["dollarmath", "amsmath"]  # $...$ and $$...$$ in the Markdown pages and notebooks
myst_heading_anchors = 3
nb_execution_mode = "off"  # render the committed outputs; the test suite executes the notebooks
nb_merge_streams = True
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "tutorials/*.py"]
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_mock_imports = []
# notebooks may start at any heading level, and may hold widget outputs (tqdm) that a static page cannot show
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
html_theme = "alabaster"
html_theme_options = {"description": "Sparse variational GPs as Pyro distributions and guides", "fixed_sidebar": True}
html_static_path = []
templates_path = []


# -- generated source folders --------------------------------------------------------------------------------------
def _copy_tutorials():
    """docs/tutorials/ <- tutorials/* (notebooks, the figures and scripts they refer to)."""
    src, dst = ROOT / "tutorials", HERE / "tutorials"
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix in {".ipynb", ".py", ".png"}:
            shutil.copy2(path, dst / path.name)


def _public_modules():
    """Every importable public module of the package (no path component starting with an underscore)."""
    names = ["pyro_sparsegp"]
    for info in pkgutil.walk_packages(pyro_sparsegp.__path__, "pyro_sparsegp."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return sorted(names)


def _write_api_pages():
    """docs/api/<module>.rst: the module's docstring and its public members (its ``__all__`` where it has one).
    Packages whose ``__init__`` only re-exports get their docstring and a list of their modules."""
    dst = HERE / "api"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    modules = _public_modules()
    for name in modules:
        mod = importlib.import_module(name)
        title = f"``{name}``"
        lines = [title, "=" * len(title), ""]
        is_package = hasattr(mod, "__path__")
        if is_package:
            lines += [f".. automodule:: {name}", "   :no-members:", ""]
            children = [m for m in modules if m.rpartition(".")[0] == name]
            if children:
                lines += ["Modules:", ""] + [f"* :doc:`{c}`" for c in children] + [""]
        else:
            lines += [f".. automodule:: {name}", ""]
        (dst / f"{name}.rst").write_text("\n".join(lines))


_copy_tutorials()
_write_api_pages()
