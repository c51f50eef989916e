"""Test harness after Pyro's: float64 by default (``PYRO_SPARSEGP_DTYPE=float32`` for a float32 pass), a clear
param store, module-local PyroModule parameters (so two modules in one test never share parameters through Pyro's
global store; tests of the global store opt out), validation on and a fixed seed before every test."""
import os

import pyro
import pytest
import torch

DTYPE = getattr(torch, os.environ.get("PYRO_SPARSEGP_DTYPE", "float64"))


@pytest.fixture(autouse=True)
def _reset():
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(0)
    with pyro.settings.context(module_local_params=True):
        yield
    torch.set_default_dtype(old)
