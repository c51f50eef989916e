"""Natural-gradient damping, both implementations (issue 25, item 5): the plain step is halved per output until the
new precision has a Cholesky factor, at most 30 times, after which that output's step length is 0 and it **keeps its
q** (``pyro_sparsegp.infer.natgrad`` module docstring), with one :class:`NatGradDampingWarning`.

``natgrad_from_grads_`` (the autograd step, ``_damp``) and the closed-form steps of ``natgrad_step`` (``_apply``,
``_damped_length``) each damp; the halvings of the first are triggered in
tests/infer/natgrad/test_natural_gradient_safety.py, the second's nowhere else, and the "keeps its q" of a frozen output
was asserted by neither (it failed before this file: a non-finite gradient made the frozen output's q NaN, as
``0 * nan = nan``)."""

import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.context import reporting
from pyro_sparsegp.infer.natgrad import NatGradDampingWarning, closed_forms, damping, natgrad_from_grads_
from pyro_sparsegp.variational import GaussianQ, to_natural


def _q_with_grads(L=3, M=4, seed=0):
    """A ``GaussianQ [L, M]`` with the gradient of ``tr(A S) + b^T m`` (``A`` small: no damping needed)."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    dt = torch.get_default_dtype()
    q = GaussianQ(M, num_outputs=L)
    f64 = torch.float64  # the same draws in the float64 and the float32 pass
    B = torch.randn(L, M, M, generator=g, dtype=f64).to(dt)
    q.set(torch.randn(L, M, generator=g, dtype=f64).to(dt), torch.linalg.cholesky(B @ B.mT / M + torch.eye(M)))
    A = 0.1 * torch.randn(L, M, M, generator=g, dtype=f64).to(dt)
    S = q.u_scale_tril @ q.u_scale_tril.mT
    ((A + A.mT) * S).sum().add((torch.randn(L, M, generator=g, dtype=f64).to(dt) * q.u_loc).sum()).backward()
    return q


@pytest.mark.parametrize("retraction", [False, True], ids=["plain", "retraction"])
def test_a_frozen_output_keeps_its_q(monkeypatch, retraction):
    """Output 1's gradient is NaN: 30 halvings cannot make it finite, so its length becomes 0 and its mean and scale
    stay exactly as they were; the other outputs take their (finite) step; the warning is raised."""
    monkeypatch.setattr(reporting, "_REPORTED", set())
    q = _q_with_grads()
    q.u_scale_tril_unconstrained.grad[1].fill_(float("nan"))
    q.u_loc_unconstrained.grad[1].fill_(float("nan"))
    m0, L0 = q.u_loc.detach().clone(), q.u_scale_tril.detach().clone()
    with pytest.warns(NatGradDampingWarning):
        natgrad_from_grads_(q, 0.5, retraction=retraction)
    assert torch.equal(q.u_loc[1], m0[1]) and torch.equal(q.u_scale_tril[1], L0[1])
    for i in (0, 2):
        assert torch.isfinite(q.u_scale_tril[i]).all() and not torch.equal(q.u_scale_tril[i], L0[i])
        assert torch.isfinite(q.u_loc[i]).all() and not torch.equal(q.u_loc[i], m0[i])


def test_closed_form_step_halves_to_the_largest_positive_definite_length(monkeypatch):
    """``_damped_length`` (the closed-form steps' damping) with ``Lambda = I`` and a target precision whose last
    eigenvalue is -6: the new precision ``(1 - r) I + r diag(1, 1, 1, -6)`` is PD iff ``r < 1/7``, so ``r = 1``
    is halved three times to 1/8 (output 0); output 1 (no problem) keeps ``r = 1``; output 2, whose target has an
    eigenvalue of -2e12, needs ``r < 5e-13``, below ``2^-30``: frozen at 0. One warning."""
    monkeypatch.setattr(reporting, "_REPORTED", set())
    M = 4
    theta2 = -0.5 * torch.eye(M).expand(3, M, M).clone()  # natural parameter of precision I
    target = theta2.clone()
    target[0, -1, -1] = 3.0  # precision -6
    target[2, -1, -1] = 1e12
    with pytest.warns(NatGradDampingWarning, match="shortened to 0"):
        rho = damping._damped_length(theta2, target, 1.0)
    torch.testing.assert_close(rho, torch.tensor([0.125, 1.0, 0.0]))


def _two_output_svgp():
    X = torch.linspace(-2, 2, 20)[:, None]
    gp = ps.SVGP(RBF(1), X[::4].clone(), ps.Gaussian(0.1), num_outputs=2)
    with torch.no_grad():
        gp.q_u.set(0.3 * torch.randn(2, 5), torch.eye(5).expand(2, 5, 5) * 0.7)
    return gp


def test_closed_form_step_freezes_an_output_with_a_non_finite_target(monkeypatch):
    """The closed-form update (``_apply``) with a NaN data term for output 1 and a finite one for output 0: output 1
    keeps its q, output 0 moves to ``(1 - r) theta + r target``."""
    monkeypatch.setattr(reporting, "_REPORTED", set())
    gp = _two_output_svgp()
    M = 5
    theta1, theta2 = to_natural(gp.q_u.u_loc.detach().clone(), gp.q_u.u_scale_tril.detach().clone())
    m0, L0 = gp.q_u.u_loc.detach().clone(), gp.q_u.u_scale_tril.detach().clone()
    g1 = torch.randn(2, M)
    g2 = -0.5 * torch.eye(M).expand(2, M, M).clone()  # data precision I: the prior (whitened, -I/2) plus this is PD
    g1[1, 0] = float("nan")
    g2[1, 0, 0] = float("nan")
    Luu = torch.eye(M)
    with pytest.warns(NatGradDampingWarning):
        closed_forms._apply(gp, g1, g2, Luu, 0.5)
    torch.testing.assert_close(gp.q_u.u_loc[1], m0[1])  # through the natural parameters and back
    torch.testing.assert_close(gp.q_u.u_scale_tril[1], L0[1])
    new1, new2 = to_natural(gp.q_u.u_loc.detach(), gp.q_u.u_scale_tril.detach())
    torch.testing.assert_close(new1[0], 0.5 * theta1[0] + 0.5 * g1[0])
    torch.testing.assert_close(new2[0], 0.5 * theta2[0] + 0.5 * (-0.5 * torch.eye(M) + g2[0]))


def test_a_finite_step_is_not_damped(monkeypatch):
    """The control: the same multi-output family and finite gradients give no warning and move every output."""
    monkeypatch.setattr(reporting, "_REPORTED", set())
    q = _q_with_grads()
    L0 = q.u_scale_tril.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NatGradDampingWarning)
        natgrad_from_grads_(q, 0.5)
    assert all(not torch.equal(q.u_scale_tril[i], L0[i]) for i in range(3))
