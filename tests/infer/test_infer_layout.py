"""The ``infer`` package in three rooms (training, natural gradients, EP): ``ps.infer`` exports what a user calls,
each subpackage the rest, and the flat layout before them is gone (no module path or name of it is kept)."""

import importlib

import pytest

import pyro_sparsegp as ps

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


def test_the_flat_layout_is_gone():
    """An old module path (``pyro_sparsegp.infer.natgrad_options``) and an old ``ps.infer`` name
    (``ps.infer.natgrad_step``) no longer resolve: each thing has one place."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pyro_sparsegp.infer.natgrad_options")
    assert callable(ps.infer.fit) and not isinstance(ps.infer.fit, type(ps))
    with pytest.raises(AttributeError):
        ps.infer.natgrad_step  # noqa: B018


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        ps.infer.no_such_name  # noqa: B018


def test_the_ep_package_exports_what_the_old_ep_module_did():
    from pyro_sparsegp.infer.ep import ep as ep_module

    for name in ep_module.__all__:
        assert getattr(ps.infer.ep, name) is getattr(ep_module, name)
