"""Properties of the SOLVE-GP layer's construction (``pyro_sparsegp.layers.solvegp``; Shi, Titsias, Mnih 2020,
sections 3.2-3.3): a new layer starts at ``q(u) q(v⊥) = p(u) p⊥(v⊥)`` (both KL terms zero, whitened or not), and
with sampled kernel hyperparameters ``q(v⊥)`` starts at the identity; ``O`` given as a list or an array equals the
tensor, and an ``O`` unlike ``Z`` (no inputs, another feature width) is refused by name."""

import numpy as np
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.nn import PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.inducing import InducingPoints
from pyro_sparsegp.mean_functions import Constant


def _kernel():
    return RBF(1, lengthscale=torch.tensor(0.8), variance=torch.tensor(1.2))


def _inputs():
    """``(Z [4, 1], O [6, 1])``, in the test's default dtype."""
    return torch.linspace(-2, 2, 4).unsqueeze(-1), torch.linspace(-1.7, 2.3, 6).unsqueeze(-1)


@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("num_outputs", [None, 2], ids=["single", "two_outputs"])
def test_a_new_layer_starts_at_its_prior(whiten, num_outputs):
    Z, O = _inputs()
    gp = ps.SOLVEGP(_kernel(), Z, O, ps.Gaussian(0.1), num_outputs=num_outputs, whiten=whiten)
    with torch.no_grad():
        kl = gp.kl_divergence()
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-4, rtol=0)


def test_sampled_hyperparameters_start_q_v_at_the_identity():
    Z, O = _inputs()
    k = _kernel()
    k.lengthscale = PyroSample(dist.LogNormal(torch.tensor(0.0), 0.3))
    gp = ps.SOLVEGP(k, Z, O, ps.Gaussian(0.1), whiten=False)
    torch.testing.assert_close(gp.q_v.u_scale_tril.detach(), torch.eye(6))


@pytest.mark.parametrize("as_array", [list, np.asarray], ids=["list", "numpy"])
def test_orthogonal_inputs_as_arrays(as_array):
    Z, O = _inputs()
    a = ps.SOLVEGP(_kernel(), Z, O, ps.Gaussian(0.1), name="a")
    b = ps.SOLVEGP(_kernel(), Z, as_array(O.tolist()), ps.Gaussian(0.1), name="b")
    assert torch.is_tensor(b.orthogonal.Z) and b.orthogonal.Z.dtype == O.dtype
    c = ps.SOLVEGP(_kernel(), Z, InducingPoints(O.clone()), ps.Gaussian(0.1), name="c")  # inducing variables
    X = torch.randn(5, 1)
    torch.testing.assert_close(b.predict(X)[0], a.predict(X)[0])
    torch.testing.assert_close(c.predict(X)[0], a.predict(X)[0])
    with pytest.raises(ValueError, match="at least one orthogonal"):
        ps.SOLVEGP(_kernel(), Z, as_array([[], []]), ps.Gaussian(0.1))


def test_orthogonal_inputs_unlike_z_are_refused():
    Z, O = _inputs()
    with pytest.raises(ValueError, match="shaped like Z"):
        ps.SOLVEGP(_kernel(), Z, torch.randn(6, 2), ps.Gaussian(0.1))
    with pytest.raises(ValueError, match="shaped like Z"):
        ps.SOLVEGP(_kernel(), Z, torch.randn(2, 6, 1), ps.Gaussian(0.1))


def test_the_projection_carries_the_mean_function():
    """``project(X, u)`` is ``Kfu Kuu^-1 u + m(X)`` (eq. 4 plus the prior mean): a constant mean shifts it by ``c``."""
    Z, O = _inputs()
    a = ps.SOLVEGP(_kernel(), Z, O, ps.Gaussian(0.1), name="a")
    b = ps.SOLVEGP(_kernel(), Z, O, ps.Gaussian(0.1), name="b", mean_function=Constant(value=1.7))
    X, u = torch.randn(5, 1), torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(b.project(X, u, consume=False), a.project(X, u, consume=False) + 1.7)
