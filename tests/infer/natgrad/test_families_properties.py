"""Properties of the discovery of natural-gradient families (``pyro_sparsegp.infer.natgrad.families``): the noise
step takes a learnable Gaussian noise only (not another likelihood, a frozen noise or a noise with a prior); the
families are a module's own choice when it has one, else every full-covariance ``GaussianQ`` in it (ODVGP's mean-only
``q(v)`` excluded)."""

import pyro.distributions as dist
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.nn import PyroModule, PyroSample

import pyro_sparsegp as ps
from pyro_sparsegp.infer.natgrad.families import natgrad_families, noise_natgrad_likelihood
from pyro_sparsegp.variational import GaussianQ


def test_noise_step_takes_only_a_learnable_gaussian_noise():
    gp = ps.SVGP(RBF(1), torch.randn(3, 1), ps.Gaussian(0.2))
    assert noise_natgrad_likelihood(gp) is gp.likelihood
    assert noise_natgrad_likelihood(ps.SVGP(RBF(1), torch.randn(3, 1), ps.Bernoulli())) is None
    assert noise_natgrad_likelihood(torch.nn.Linear(1, 1)) is None
    gp.likelihood.noise_unconstrained.requires_grad_(False)
    assert noise_natgrad_likelihood(gp) is None
    lik = ps.Gaussian(0.2)
    lik.noise = PyroSample(dist.LogNormal(0.0, 1.0))
    assert noise_natgrad_likelihood(ps.SVGP(RBF(1), torch.randn(3, 1), lik)) is None


def test_families_found_in_a_container_and_chosen_by_a_module():
    class Box(PyroModule):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.mean_only = GaussianQ(3), GaussianQ(2, num_outputs=2), GaussianQ(3, learn_scale=False)

    box = Box()
    found = natgrad_families(box)
    assert len(found) == 2 and found[0] is box.a and found[1] is box.b
    odvgp = ps.SOLVEGP(RBF(1), torch.randn(3, 1), torch.randn(2, 1) + 5.0, ps.Gaussian(), odvgp=True)
    assert natgrad_families(odvgp) == [odvgp.q_u]
    solve = ps.SOLVEGP(RBF(1), torch.randn(3, 1), torch.randn(2, 1) + 5.0, ps.Gaussian())
    assert natgrad_families(solve) == [solve.q_u, solve.q_v]
