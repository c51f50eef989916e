"""Test harness after Pyro's: float64 by default (``PYRO_SPARSEGP_DTYPE=float32`` for a float32 pass), a clear
param store, module-local PyroModule parameters (so two modules in one test never share parameters through Pyro's
global store; tests of the global store opt out), validation on and a fixed seed before every test."""

import os

import pyro
import pytest
import torch

DTYPE = getattr(torch, os.environ.get("PYRO_SPARSEGP_DTYPE", "float64"))


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
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(0)
    with pyro.settings.context(module_local_params=True):
        yield
    torch.set_default_dtype(old)
