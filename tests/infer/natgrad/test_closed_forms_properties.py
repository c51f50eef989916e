"""Properties of the closed-form natural-gradient steps (``pyro_sparsegp.infer.natgrad.closed_forms``; Hensman,
Fusi, Lawrence 2013, section 3.2; Wenzel et al. 2019): a full step (``lr = 1``) of the Pólya-Gamma step with fixed
local parameters ``c`` lands on the dense optimum ``S = (P + (N/B) kappa^T diag(omega) kappa)^{-1}``,
``m = S (N/2B) kappa^T s`` (``P = Kuu^{-1}``, ``kappa = Kfu Kuu^{-1}``; ``P = I``, ``kappa = W^T`` whitened), on the
full batch and on a minibatch; a multi-output step equals each output's step alone, for the Pólya-Gamma and the generic
(autograd) step; the Gaussian step's default length is the full step; each likelihood gets its step."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer.natgrad.closed_forms import (
    gaussian_natgrad_step,
    natgrad_step,
    natgrad_step_for,
    polya_gamma_natgrad_step,
)


def _gp(lik, whiten, num_outputs=None, seed=0):
    torch.manual_seed(seed)
    Z = torch.linspace(-2, 2, 4).unsqueeze(-1)
    return ps.SVGP(RBF(1, lengthscale=torch.tensor(0.8)), Z, lik, whiten=whiten, num_outputs=num_outputs,
                   jitter=1e-10)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("num_data", [None, 50], ids=["full", "minibatch"])
def test_polya_gamma_full_step_lands_on_the_dense_optimum(whiten, num_data):
    gp = _gp(ps.PolyaGammaLogit(), whiten)
    X, y = torch.linspace(-2.5, 2.5, 10).unsqueeze(-1), (torch.rand(10) > 0.5).double()
    c = torch.rand(10) + 0.3
    polya_gamma_natgrad_step(gp, X, y, lr=1.0, num_data=num_data, c=c)
    with torch.no_grad():
        k = gp.kernel
        Kuu, Kuf = k(gp.inducing.Z) + 1e-10 * k(gp.inducing.Z).diagonal().mean() * torch.eye(4), k(gp.inducing.Z, X)
        if whiten:
            kappa, P = torch.linalg.solve_triangular(torch.linalg.cholesky(Kuu), Kuf, upper=False).mT, torch.eye(4)
        else:
            kappa, P = torch.linalg.solve(Kuu, Kuf).mT, torch.linalg.inv(Kuu)
        scale = (num_data or 10) / 10
        omega = torch.tanh(c / 2) / (2 * c)
        S = torch.linalg.inv(P + scale * kappa.mT @ (omega[:, None] * kappa))
        m = S @ (0.5 * scale * kappa.mT @ (2 * y - 1))
        L = gp.q_u.u_scale_tril
        torch.testing.assert_close(L @ L.mT, S, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(gp.q_u.u_loc, m, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("step, lik", [(polya_gamma_natgrad_step, ps.PolyaGammaLogit), (natgrad_step, ps.Bernoulli)],
                         ids=["polya_gamma", "autograd"])
def test_a_multi_output_step_is_each_outputs_step(step, lik):
    multi = _gp(lik(), whiten=False, num_outputs=2)
    X = torch.linspace(-2.5, 2.5, 8).unsqueeze(-1)
    y = (torch.rand(8, 2) > 0.5).to(X.dtype)
    with torch.no_grad():
        multi.q_u.set(torch.randn(2, 4) * 0.3, (torch.eye(4) * 0.6).expand(2, 4, 4).clone())
    singles = []
    for i in range(2):
        s = _gp(lik(), whiten=False)
        with torch.no_grad():
            s.q_u.set(multi.q_u.u_loc[i].detach(), multi.q_u.u_scale_tril[i].detach())
        step(s, X, y[:, i], lr=0.5)
        singles.append(s)
    step(multi, X, y, lr=0.5)
    for i, s in enumerate(singles):
        torch.testing.assert_close(multi.q_u.u_loc[i], s.q_u.u_loc, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(multi.q_u.u_scale_tril[i], s.q_u.u_scale_tril, rtol=1e-4, atol=1e-5)


def test_gaussian_step_defaults_to_the_full_step_and_each_likelihood_gets_its_step():
    a, b = _gp(ps.Gaussian(0.1), whiten=True), _gp(ps.Gaussian(0.1), whiten=True)
    X, y = torch.linspace(-2, 2, 9).unsqueeze(-1), torch.randn(9)
    gaussian_natgrad_step(a, X, y)
    gaussian_natgrad_step(b, X, y, lr=1.0)
    torch.testing.assert_close(a.q_u.u_loc, b.q_u.u_loc)
    torch.testing.assert_close(a.q_u.u_scale_tril, b.q_u.u_scale_tril)
    assert natgrad_step_for(ps.Gaussian()) is gaussian_natgrad_step
    assert natgrad_step_for(ps.PolyaGammaLogit()) is polya_gamma_natgrad_step
    assert natgrad_step_for(ps.Bernoulli()) is natgrad_step
    assert natgrad_step_for(ps.Poisson()) is natgrad_step


@pytest.mark.parametrize("step, lik", [(polya_gamma_natgrad_step, ps.PolyaGammaLogit), (gaussian_natgrad_step,
                                                                                         ps.Gaussian)],
                         ids=["polya_gamma", "gaussian"])
def test_integer_and_boolean_labels_step_as_floats_do(step, lik):
    """Labels given as ``bool`` or ``int64`` are the same data as the floats ``0.0``/``1.0``: the same step."""
    X = torch.linspace(-2.5, 2.5, 8).unsqueeze(-1)
    y = torch.rand(8) > 0.5
    ref = _gp(lik(), whiten=False)
    step(ref, X, y.to(X.dtype), lr=0.5)
    for labels in (y, y.long()):
        gp = _gp(lik(), whiten=False)
        step(gp, X, labels, lr=0.5)
        torch.testing.assert_close(gp.q_u.u_loc, ref.q_u.u_loc)
        torch.testing.assert_close(gp.q_u.u_scale_tril, ref.q_u.u_scale_tril)
