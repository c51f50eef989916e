"""Module names (issue 27): default names are unique among live modules, so training one module never changes
another, under Pyro's global parameter store and with module-local parameters; an explicit name taken over from a
live module makes the earlier module fail loudly instead of reading the newer one's parameters."""

import gc

import pyro
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.deep import build_deep_gp


def _data():
    X = torch.randn(80, 2)
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(80)


@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_training_a_second_default_module_leaves_the_first_unchanged(local):
    with pyro.settings.context(module_local_params=local):
        X, y = _data()
        gp1 = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
        ps.infer.fit(gp1, X, y, num_steps=20, batch_size=40, progress=False)
        before = [t.clone() for t in gp1.predict(X)]
        gp2 = ps.SVGP(RBF(2), X[:12].clone(), ps.Gaussian(0.1))
        assert gp1.name != gp2.name and gp1.name == "gp" and gp2.name == "gp_2"
        ps.infer.fit(gp2, X, y, num_steps=20, batch_size=40, progress=False)
        svi = SVI(gp2.model, gp2.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        for _ in range(5):
            svi.step(X, y)
        for a, b in zip(gp1.predict(X), before, strict=True):
            assert torch.equal(a, b)
        assert gp2.Z.shape == (12, 2) and gp1.Z.shape == (8, 2)


def test_explicit_name_taken_over_under_the_global_store_makes_the_old_module_raise():
    with pyro.settings.context(module_local_params=False):
        X, y = _data()
        old = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="h")
        SVI(old.model, old.guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(X, y)
        assert "h.inducing.Z" in pyro.get_param_store()
        with pytest.warns(ps.layers.ParamStoreWarning, match="'h' already exists"):
            new = ps.SVGP(RBF(2), X[:20].clone(), ps.Gaussian(0.1), name="h")
        SVI(new.model, new.guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(X, y)
        assert pyro.get_param_store()["h.inducing.Z"].shape == (20, 2)
        with pytest.raises(RuntimeError, match="newer module of that name"):
            old.predict(X)
        with pytest.raises(RuntimeError, match="newer module of that name"):
            ps.infer.fit(old, X, y, num_steps=1, progress=False)
        assert new.predict(X)[0].shape == (80,)


def test_explicit_duplicate_names_are_harmless_with_module_local_params():
    with pyro.settings.context(module_local_params=True):
        X, y = _data()
        a = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="h")
        before = a.predict(X)[0].clone()
        b = ps.SVGP(RBF(2), X[:9].clone(), ps.Gaussian(0.1), name="h")
        ps.infer.fit(b, X, y, num_steps=10, progress=False)
        assert torch.equal(a.predict(X)[0], before)


def test_a_name_is_free_again_once_its_module_is_gone():
    X, _ = _data()
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
    assert gp.name == "gp"
    del gp
    gc.collect()
    assert ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1)).name == "gp"


def test_stale_entries_of_a_dead_module_are_dropped_silently():
    with pyro.settings.context(module_local_params=False):
        X, y = _data()
        gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
        SVI(gp.model, gp.guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(X, y)
        del gp
        gc.collect()
        again = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(0.1))  # warnings are errors in this suite
        SVI(again.model, again.guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(X, y)
        assert pyro.get_param_store()["gp.inducing.Z"].shape == (5, 2)


@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_deep_models_get_unique_default_names_and_stay_apart(local):
    with pyro.settings.context(module_local_params=local):
        X = torch.randn(50, 3)
        y = X[:, 0].clone()
        d1 = build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=5, init="random")
        d2 = build_deep_gp(X, [2], ps.Gaussian(0.1), num_inducing=5, init="random")
        assert d1.name != d2.name
        assert not {layer.name for layer in d1.layers} & {layer.name for layer in d2.layers}
        ps.infer.fit(d1, X, y, num_steps=3, progress=False)
        before = {k: v.clone() for k, v in d1.state_dict().items()}
        ps.infer.fit(d2, X, y, num_steps=5, progress=False)
        SVI(d2.model, d2.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO()).step(X, y)
        after = d1.state_dict()
        assert before.keys() == after.keys()
        for k, v in before.items():
            assert torch.equal(v, after[k]), k


def test_an_explicit_name_held_by_a_module_awaiting_the_collector_is_free():
    """A module that only a reference cycle keeps (a notebook's old objects, a traceback) does not hold its name:
    re-building with the same explicit name neither warns nor supersedes."""
    with pyro.settings.context(module_local_params=False):
        X, y = _data()
        old = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="cyc")
        old.__dict__["_cycle"] = [old]  # garbage once dropped, but only the cycle collector frees it
        del old
        new = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1), name="cyc")  # warnings are errors in this suite
        assert new.predict(X)[0].shape == (len(X),)


class _Owner(pyro.nn.PyroModule):
    """A user's module holding a layer as an attribute (Pyro names a submodule's parameters by its attribute path)."""

    def __init__(self, Z):
        super().__init__()
        self.gp = ps.SVGP(RBF(2), Z, ps.Gaussian(0.1))

    def model(self, X, y=None, num_data=None):
        return self.gp.model(X, y, num_data=num_data)

    def guide(self, X, y=None, num_data=None):
        return self.gp.guide(X, y, num_data=num_data)


@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_layers_inside_two_instances_of_a_users_module_stay_apart(local):
    """Two instances of one user ``PyroModule`` class, each holding an SVGP as ``self.gp``, and a model of the
    package named ``"gp"`` beside them: training one never moves another, and none adopts another's ``Z`` (under the
    global store Pyro would name all three layers' parameters ``gp.*``)."""
    with pyro.settings.context(module_local_params=local):
        X, y = _data()
        plain = ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(0.1))
        a = _Owner(X[:8].clone())
        ps.infer.fit(plain, X, y, num_steps=10, batch_size=40, progress=False)
        ps.infer.fit(a, X, y, num_steps=10, batch_size=40, progress=False)
        before = [t.clone() for t in (*plain.predict(X), *a.gp.predict(X))]
        b = _Owner(X[:12].clone())
        ps.infer.fit(b, X, -y, num_steps=10, batch_size=40, progress=False)
        SVI(b.model, b.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO()).step(X, -y)
        assert len({plain.name, a.gp.name, b.gp.name}) == 3
        assert (plain.Z.shape, a.gp.Z.shape, b.gp.Z.shape) == ((5, 2), (8, 2), (12, 2))
        for now, then in zip((*plain.predict(X), *a.gp.predict(X)), before, strict=True):
            assert torch.equal(now, then)
        if not local:  # the parameters live under each layer's own name, the prefix of its sites
            store = pyro.get_param_store()
            assert store[f"{b.gp.name}.inducing.Z"].shape == (12, 2)
            assert store[f"{a.gp.name}.inducing.Z"].shape == (8, 2)


@pytest.mark.parametrize("local", [False, True], ids=["global_store", "module_local"])
def test_a_copy_is_a_snapshot_that_later_training_leaves_alone(local):
    """``best = copy.deepcopy(gp)`` (and a whole-object ``torch.save``/``torch.load`` in the same process) takes a
    fresh name, so under the global store it keeps its own values instead of reading the original's as that trains."""
    import copy
    import io

    with pyro.settings.context(module_local_params=local):
        X, y = _data()
        gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
        ps.infer.fit(gp, X, y, num_steps=10, batch_size=40, progress=False)
        best = copy.deepcopy(gp)
        buf = io.BytesIO()
        torch.save(gp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        snapshot = [m.predict(X)[0].clone() for m in (best, loaded)]
        assert len({gp.name, best.name, loaded.name}) == 3
        ps.infer.fit(gp, X, y, num_steps=30, batch_size=40, lr=0.05, progress=False)
        assert not torch.allclose(gp.predict(X)[0], snapshot[0])
        for m, before in zip((best, loaded), snapshot, strict=True):
            assert torch.equal(m.predict(X)[0], before)
