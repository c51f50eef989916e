"""The built-in likelihoods of the count, continuous and heteroscedastic families, each with a generator of ``y``
given latent values (written with torch's own samplers, not the likelihood's ``distribution``), shared by the
likelihood tests. ``CASES[name] = (make, sample_y, latent_dim)``: ``make()`` builds the likelihood with non-default
parameters; ``sample_y(f)`` draws ``y`` for ``f [..., B]`` (``[..., 2, B]`` for two latents), returning ``[..., B]``."""

import math

import torch

import pyro_sparsegp as ps


def _nb(f, alpha):
    return torch.distributions.NegativeBinomial(1 / alpha, logits=f + math.log(alpha)).sample()


def _zero_inflate(y, gate):
    return torch.where(torch.rand_like(y) < gate, torch.zeros_like(y), y)


CASES = {
    "Poisson": (lambda: ps.Poisson(), lambda f: torch.poisson(f.exp()), 1),
    "NegativeBinomial": (lambda: ps.NegativeBinomial(dispersion=0.5), lambda f: _nb(f, 0.5), 1),
    "ZeroInflatedPoisson": (lambda: ps.ZeroInflatedPoisson(gate=0.3),
                            lambda f: _zero_inflate(torch.poisson(f.exp()), 0.3), 1),
    "ZeroInflatedNegativeBinomial": (lambda: ps.ZeroInflatedNegativeBinomial(dispersion=0.5, gate=0.3),
                                     lambda f: _zero_inflate(_nb(f, 0.5), 0.3), 1),
    "StudentT": (lambda: ps.StudentT(scale=0.3, df=4.0),
                 lambda f: f + 0.3 * torch.distributions.StudentT(4.0).sample(f.shape), 1),
    "Gamma": (lambda: ps.Gamma(shape=3.0), lambda f: torch.distributions.Gamma(3.0, 3.0 * (-f).exp()).sample(), 1),
    "Beta": (lambda: ps.Beta(precision=20.0),
             lambda f: torch.distributions.Beta(20 * torch.sigmoid(f), 20 * torch.sigmoid(-f)).sample()
             .clamp(1e-4, 1 - 1e-4), 1),
    "HeteroscedasticGaussian": (lambda: ps.HeteroscedasticGaussian(),
                                lambda f: f[..., 0, :] + f[..., 1, :].exp() * torch.randn_like(f[..., 0, :]), 2),
    # NB1 as the Gamma-Poisson mixture: rate ~ Gamma(shape mu / alpha, rate 1 / alpha), mean mu, var mu (1 + alpha)
    "HeteroscedasticNegativeBinomial": (
        lambda: ps.HeteroscedasticNegativeBinomial(variance="NB1"),
        lambda f: torch.poisson(torch.distributions.Gamma((f[..., 0, :] - f[..., 1, :]).exp(),
                                                          (-f[..., 1, :]).exp()).sample()), 2),
}


def latent_functions(X, latent_dim):
    """Smooth latent functions at ``X [N, 1]``: ``[N]``, or ``[2, N]`` (a mean and a log noise sd) for two."""
    x = X[..., 0]
    g = 0.8 * torch.sin(2 * x) + 0.5
    if latent_dim == 1:
        return g
    return torch.stack([g, -1.2 + 0.5 * x])


def simulated(name, N=60, seed=0):
    """``(likelihood, X [N, 1], y [N], f)`` of ``CASES[name]`` on a grid of ``[-2, 2]``."""
    make, sample_y, Q = CASES[name]
    torch.manual_seed(seed)
    X = torch.linspace(-2, 2, N).unsqueeze(-1)
    f = latent_functions(X, Q)
    return make(), X, sample_y(f), f
