"""Properties of the ODVGP layer's construction and bookkeeping (``pyro_sparsegp.layers.odvgp``; Shi, Titsias, Mnih
2020, section 6.3): one column per evaluation (``num_subsample=1``) is allowed and its estimates of ``a^T Kvv a``
average, over the ``M2`` columns, to the exact value (eq. 36 at ``S_v = C_vv``); an empty ``O``,
``num_subsample < 1`` and a likelihood of several latent functions are refused by name; a piecewise-constant
likelihood draws no warning about an ``f`` site (ODVGP has none: its bound integrates ``f``); no factor outlives a
call."""

import warnings

import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps

M, M2 = 4, 9


def _gp(**kwargs):
    torch.manual_seed(0)
    gp = ps.ODVGP(RBF(1, lengthscale=torch.tensor(0.7)), torch.linspace(-2, 2, M).unsqueeze(-1),
                  torch.linspace(-2.1, 2.2, M2).unsqueeze(-1), ps.Gaussian(0.1), **kwargs)
    with torch.no_grad():
        gp.a = torch.randn(M2)
        gp.q_u.set(torch.randn(M), 0.5 * torch.eye(M))
    return gp


def test_one_column_per_evaluation_averages_to_the_exact_quadratic_form():
    gp = _gp(num_subsample=1)
    assert gp.num_subsample == 1 and gp.columns().shape == (1,)
    with torch.no_grad():
        O, a = gp.O, gp.a
        exact = a @ gp.kernel(O) @ a  # dense a^T Kvv a
        single = torch.stack([gp.quad_kvv(torch.tensor([j])) for j in range(M2)])  # M2 a_j (Kvv a)_j each
        torch.testing.assert_close(single.mean(), exact)
        torch.testing.assert_close(gp.quad_kvv(torch.arange(M2)), exact)


def test_bad_orthogonal_inputs_are_refused_by_name():
    k, Z = RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1)
    with pytest.raises(ValueError, match="at least one orthogonal"):
        ps.ODVGP(k, Z, torch.zeros(0, 1), ps.Gaussian(0.1))
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_subsample"):
            ps.ODVGP(k, Z, torch.ones(3, 1), ps.Gaussian(0.1), num_subsample=bad)


def test_a_likelihood_of_several_latent_functions_is_refused():
    with pytest.raises(ValueError, match="single output"):
        ps.ODVGP(RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1), torch.ones(3, 1), ps.RobustMax(3))
    gp = ps.ODVGP(RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1), torch.ones(3, 1))  # no likelihood: fine
    assert gp.num_outputs is None and gp.qf(torch.randn(5, 1))[0].shape == (5,)


class _Step(ps.Likelihood):
    """``y ~ Bernoulli(0.2 + 0.6 [f > 0])``: piecewise constant in ``f``."""

    piecewise_constant = True
    support = dist.constraints.boolean

    def distribution(self, f):
        return dist.Bernoulli(probs=0.2 + 0.6 * (f > 0).to(f.dtype))


def test_a_piecewise_constant_likelihood_draws_no_sampled_f_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp = ps.ODVGP(RBF(1), torch.linspace(-2, 2, M).unsqueeze(-1), torch.ones(3, 1), _Step())
    X, y = torch.randn(6, 1), (torch.rand(6) < 0.5).to(torch.get_default_dtype())
    assert torch.isfinite(gp.analytic_elbo(X, y))


def test_no_factor_outlives_a_call():
    gp = _gp()
    X, y = torch.randn(7, 1), torch.randn(7)
    gp.analytic_elbo(X, y)
    assert len(gp.strategy.cache) == 0
    gp.qf(X)
    assert len(gp.strategy.cache) == 0
    gp.kl_divergence()
    assert len(gp.strategy.cache) == 0
