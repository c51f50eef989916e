"""Properties of the natural-gradient step-length check and damping (``pyro_sparsegp.infer.natgrad.damping``):
``check_natgrad_lr`` takes any real number in ``(0, 1]`` or a one-element tensor and refuses the rest with the range
in the message; ``_damped_length`` leaves a step that keeps the precision positive definite at ``lr`` without a
warning, and otherwise returns the largest ``lr / 2^k`` that does (``(1 - r) + r c > 0`` for a target precision
``c I``), per batch member."""

import warnings

import pytest
import torch

from pyro_sparsegp.context import reporting
from pyro_sparsegp.infer.natgrad.damping import NatGradDampingWarning, _damped_length, check_natgrad_lr


@pytest.mark.parametrize("lr", [1.0, 1, 0.5, 1e-9, torch.tensor(0.25), torch.tensor([0.25])])
def test_check_natgrad_lr_accepts(lr):
    out = check_natgrad_lr(lr)
    assert isinstance(out, float) and out == pytest.approx(float(torch.as_tensor(lr).reshape(())))


@pytest.mark.parametrize("lr", [0.0, -0.1, 1.0001, True, "0.1", None, torch.tensor([0.1, 0.2]), float("nan")])
def test_check_natgrad_lr_refuses(lr):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        check_natgrad_lr(lr)


def test_damped_length_is_the_largest_halving_that_keeps_the_precision_positive(monkeypatch):
    monkeypatch.setattr(reporting, "_REPORTED", set())
    M = 3
    theta2 = (-0.5 * torch.eye(M)).expand(4, M, M)  # precision I
    c = torch.tensor([2.0, -0.5, -3.0, -20.0])  # target precision c I: PD after a step r iff (1 - r) + r c > 0
    target2 = -0.5 * c[:, None, None] * torch.eye(M)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rho = _damped_length(theta2[:2], target2[:2], 0.5)  # both PD at r = 0.5: no damping, no warning
    assert rho.tolist() == [0.5, 0.5]
    with pytest.warns(NatGradDampingWarning):
        rho = _damped_length(theta2, target2, 1.0)
    expected = []
    for ci in c.tolist():
        r = 1.0
        while (1 - r) + r * ci <= 0:
            r /= 2
        expected.append(r)
    assert rho.tolist() == expected  # [1, 0.5, 0.125, 0.03125]
