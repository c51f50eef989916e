"""Test harness after Pyro's: float64 by default (``PYRO_SPARSEGP_DTYPE=float32`` for a float32 pass), the default
device from ``PYRO_SPARSEGP_DEVICE`` (e.g. ``cuda``; unset: torch's own default, the CPU; ``cpu`` runs the suite through
the same switch, with ``torch.set_default_device`` active), a clear param store, module-local PyroModule parameters
(so two modules in one test never share parameters through Pyro's global store; tests of the global store opt out),
validation on and a fixed seed before every test.

Tests create tensors with factory functions (``torch.randn``, ``torch.zeros``, ...), which follow the default device,
so the whole suite runs on a GPU with ``PYRO_SPARSEGP_DEVICE=cuda``.

This file applies to every folder below it. The folders follow the package (``tests/layers/``, ``tests/infer/natgrad/``,
...; ``tests/core/`` for the top-level modules, ``tests/integration/``, ``tests/robustness/``) and have no
``__init__.py``: pytest's default ``prepend`` import mode imports each test file under its basename, so no two test
files may share one. Helpers shared by test files live in ``tests/helpers/``, on ``sys.path`` through the
``pythonpath`` setting of ``[tool.pytest.ini_options]``."""

import gc
import os

import pyro
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # one pytest-xdist worker per core (addopts): one thread each, its
    torch.set_num_threads(1)  # subprocesses (notebook kernels, torchrun ranks) too, or the workers oversubscribe
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

DTYPE = getattr(torch, os.environ.get("PYRO_SPARSEGP_DTYPE", "float64"))
DEVICE = os.environ.get("PYRO_SPARSEGP_DEVICE") or None
if DEVICE is not None:
    torch.device(DEVICE)  # a malformed name fails here, before any test


def pytest_collection_finish(session):
    """Move everything imported so far (torch, Pyro, the test modules) to the collector's permanent generation: a
    module built under a name that a dropped module still holds runs a full collection (``context.naming``), which
    otherwise walks that whole heap (0.1-0.3 s each, in most tests)."""
    gc.collect()
    gc.freeze()


def pytest_report_header(config):
    return f"pyro_sparsegp: dtype {DTYPE}, device {DEVICE or 'torch default (cpu)'}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "float64: an identity checked to ~1e-8 (or by gradcheck), which float32 cannot resolve; runs in float64 "
        "even in the float32 pass",
    )


@pytest.fixture(autouse=True)
def _reset(request):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if request.node.get_closest_marker("float64") else DTYPE)
    if DEVICE is not None:
        torch.set_default_device(DEVICE)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(0)
    with pyro.settings.context(module_local_params=True):
        yield
    torch.set_default_dtype(old)
    if DEVICE is not None:
        torch.set_default_device(None)


@pytest.fixture
def registry():
    """Restore the covariance rules' registry after a test that registers rules of its own."""
    from pyro_sparsegp.covariances import dispatch

    saved = dict(dispatch._RULES), dict(dispatch._DIAGS), dict(dispatch._HINTS)
    yield
    for live, old in zip((dispatch._RULES, dispatch._DIAGS, dispatch._HINTS), saved, strict=True):
        live.clear()
        live.update(old)
    dispatch._CACHE.clear()


@pytest.fixture
def differences(monkeypatch):
    """Counts the evaluations of ``kernels.batched._sqdist_by_differences`` (the exact squared distances from the
    differences) made while a test runs: a list with one entry per call."""
    from pyro_sparsegp.kernels import batched

    calls = []
    real = batched._sqdist_by_differences
    monkeypatch.setattr(batched, "_sqdist_by_differences", lambda *args: calls.append(1) or real(*args))
    return calls
