"""Guards: no untested likelihood subclass, the augmented observation factor follows Pyro's distribution contract,
and SOLVE-GP works with Predictive."""
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Predictive

import pyro_sparsegp as ps
from pyro_sparsegp import likelihoods
from pyro_sparsegp.distributions import PolyaGammaAugmentedBernoulli

# every likelihood and the test file (under tests/) that checks its expectations against an independent computation
TESTS = Path(__file__).resolve().parents[1]
TESTED = {
    "Gaussian": "likelihoods/test_likelihoods.py", "Bernoulli": "likelihoods/test_likelihoods.py",
    "PolyaGammaLogit": "likelihoods/test_polya_gamma_bound.py",
    "RobustMax": "likelihoods/test_multiclass.py", "Softmax": "likelihoods/test_multiclass.py",
    "Poisson": "likelihoods/test_count_likelihoods.py", "NegativeBinomial": "likelihoods/test_count_likelihoods.py",
    "ZeroInflatedPoisson": "likelihoods/test_count_likelihoods.py",
    "ZeroInflatedNegativeBinomial": "likelihoods/test_count_likelihoods.py",
    "StudentT": "likelihoods/test_continuous_likelihoods.py", "Gamma": "likelihoods/test_continuous_likelihoods.py",
    "Beta": "likelihoods/test_continuous_likelihoods.py",
    "HeteroscedasticGaussian": "likelihoods/test_heteroscedastic.py",
    "HeteroscedasticNegativeBinomial": "likelihoods/test_heteroscedastic_counts.py",
}


def _likelihood_modules():
    """The package ``pyro_sparsegp.likelihoods`` and every module in it (one per family)."""
    names = [m.name for m in pkgutil.iter_modules(likelihoods.__path__)]
    subs = [importlib.import_module(f"{likelihoods.__name__}.{name}") for name in names]
    return [likelihoods, *subs]


def test_no_untested_likelihood():
    found = {
        name for mod in _likelihood_modules() for name, cls in inspect.getmembers(mod, inspect.isclass)
        if issubclass(cls, ps.Likelihood) and cls is not ps.Likelihood and not name.startswith("_")
    }
    assert found == set(TESTED)
    assert all((TESTS / path).is_file() for path in TESTED.values()), TESTED


@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
def test_augmented_bernoulli_contract(batch_shape):
    d = PolyaGammaAugmentedBernoulli(torch.randn(batch_shape), torch.rand(batch_shape) + 0.1, validate_args=True)
    y = d.sample()
    assert y.shape == batch_shape and d.log_prob(y).shape == batch_shape
    e = d.expand((5,) + batch_shape)
    assert e.log_prob(e.sample()).shape == (5,) + batch_shape
    # log p(y | f, omega) = s f / 2 - omega f^2 / 2 - log 2, s = 2y - 1
    s = 2 * y - 1
    torch.testing.assert_close(d.log_prob(y), s * d.f / 2 - d.omega * d.f**2 / 2 - torch.log(torch.tensor(2.0)))
    with pytest.raises(ValueError):
        d.log_prob(torch.full(batch_shape, 0.5))


def test_solvegp_predictive():
    gp = ps.SOLVEGP(RBF(2), torch.randn(4, 2), torch.randn(3, 2), ps.Gaussian())
    X = torch.randn(9, 2)
    s = Predictive(gp.model, guide=gp.guide, num_samples=5, return_sites=["gp.u", "gp.v", "gp.f", "y"])(X)
    # u, v live outside the data plate: a singleton stands for it (see pyro_sparsegp.conditionals)
    assert s["gp.f"].shape == (5, 9) and s["y"].shape == (5, 9) and s["gp.v"].shape == (5, 1, 3)
