"""The ``infer`` package in three rooms (training, natural gradients, EP) and the flat layout's paths kept working:
every old module path and every old ``ps.infer`` name gives the same object as its new place, with a
``DeprecationWarning`` naming that place, and importing the old module of ``fit`` never replaces the function."""

import importlib
import subprocess
import sys

import pytest

import pyro_sparsegp as ps
from pyro_sparsegp.infer import _moved

USER_NAMES = {"fit", "NaturalPolicy", "Checkpoint", "FitState", "NonFiniteLossError", "save_checkpoint",
              "load_checkpoint", "EpochBatchSampler",
              "NaturalGradient", "natgrad_families", "fit_ep", "EPState", "fit_gfitc", "GFITCState",
              "GFITCConvergenceWarning", "fit_mfsp", "MFSpState"}


def test_ps_infer_exports_what_a_user_calls():
    assert set(ps.infer.__all__) == USER_NAMES
    for name in USER_NAMES:
        assert getattr(ps.infer, name) is not None
    for sub in ("training", "natgrad", "ep"):
        assert importlib.import_module(f"pyro_sparsegp.infer.{sub}").__all__


def test_every_old_module_path_imports_the_new_module_in_a_fresh_process():
    """In a fresh interpreter (the alias is made at first import, so this process's earlier imports would hide it):
    each old module path gives the new module, with its own ``__spec__``, a ``DeprecationWarning`` naming the new path
    (but for ``pyro_sparsegp.infer.fit``, aliased silently), and ``ps.infer.fit`` stays the function."""
    code = (
        "import warnings, importlib\n"
        "warnings.simplefilter('error')\n"
        "import pyro_sparsegp as ps\n"
        "from pyro_sparsegp.infer._moved import MODULES\n"
        "for old, new in MODULES.items():\n"
        "    target = importlib.import_module('pyro_sparsegp.infer.' + new)\n"
        "    with warnings.catch_warnings(record=True) as w:\n"
        "        warnings.simplefilter('always')\n"
        "        got = importlib.import_module('pyro_sparsegp.infer.' + old)\n"
        "    said = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
        "    assert got is target, (old, got, target)\n"
        "    assert got.__spec__.name == 'pyro_sparsegp.infer.' + new, got.__spec__.name\n"
        "    assert old == 'fit' or any('pyro_sparsegp.infer.' + new in m for m in said), (old, said)\n"
        "    assert callable(ps.infer.fit) and not isinstance(ps.infer.fit, type(ps)), ps.infer.fit\n"
        "print(len(MODULES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(_moved.MODULES) >= 15


@pytest.mark.parametrize("name", sorted(_moved.NAMES))
def test_an_old_name_of_ps_infer_warns_and_gives_the_same_object(name):
    new = importlib.import_module(f"pyro_sparsegp.infer.{_moved.NAMES[name]}")
    with pytest.warns(DeprecationWarning, match=f"pyro_sparsegp.infer.{_moved.NAMES[name]}.{name}"):
        obj = getattr(ps.infer, name)
    assert obj is getattr(new, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ps.infer.no_such_name  # noqa: B018


def test_the_ep_package_exports_what_the_old_ep_module_did():
    from pyro_sparsegp.infer.ep import ep as ep_module

    for name in ep_module.__all__:
        assert getattr(ps.infer.ep, name) is getattr(ep_module, name)
