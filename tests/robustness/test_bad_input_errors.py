"""Bad input gets a clear error, never a silent NaN; a nearly singular Kuu succeeds through documented jitter
escalation that warns."""

import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.linalg import CholeskyJitterWarning, IllConditionedWarning, cholesky, reset_warnings


def _gp(lik=None, D=2):
    return ps.SVGP(RBF(D), torch.randn(4, D), lik or ps.Gaussian())


def _loss(gp, X, y):
    return Trace_ELBO().loss(gp.model, gp.guide, X, y)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused(bad):
    gp = _gp()
    X, y = torch.randn(10, 2), torch.randn(10)
    X[3, 1] = bad
    with pytest.raises(ValueError, match="X contains NaN or inf"):
        _loss(gp, X, y)
    X[3, 1] = 0.0
    y[2] = bad
    with pytest.raises(ValueError, match="y contains NaN or inf"):
        _loss(gp, X, y)


def test_bernoulli_labels_outside_zero_one_are_refused():
    gp = _gp(ps.Bernoulli())
    X = torch.randn(10, 2)
    for y in (torch.full((10,), 2.0), -torch.ones(10), torch.full((10,), 0.5)):
        with pytest.raises(ValueError, match="outside the support"):
            _loss(gp, X, y)


def test_mismatched_shapes_are_refused():
    gp = _gp()
    with pytest.raises(ValueError, match=r"y must be \[N\] = \[10\].*got shape \(9,\)"):
        _loss(gp, torch.randn(10, 2), torch.randn(9))
    with pytest.raises(ValueError, match="X must be"):
        _loss(gp, torch.randn(10, 3), torch.randn(10))
    with pytest.raises(ValueError, match="X must be"):
        gp.predict(torch.randn(10))
    gp3 = ps.SVGP(RBF(2), torch.randn(4, 2), ps.Gaussian(), num_outputs=3)
    with pytest.raises(ValueError, match=r"y must be \[N, L\] = \[10, 3\]"):
        _loss(gp3, torch.randn(10, 2), torch.randn(10))


def test_inducing_points_with_the_wrong_dimension_are_refused():
    with pytest.raises(ValueError, match="Z has 2 features but the kernel expects input_dim=3"):
        ps.SVGP(RBF(3), torch.randn(4, 2), ps.Gaussian())
    # more features than the kernel's input_dim: the kernel acts on its active_dims (0, 1), with a warning
    with pytest.warns(UserWarning, match="acts on features 0..1 of the 3 in Z; the others are ignored"):
        ps.SVGP(RBF(2), torch.randn(4, 3), ps.Gaussian())
    with pytest.raises(ValueError, match="Z must be"):
        ps.SVGP(RBF(2), torch.randn(4), ps.Gaussian())
    with pytest.raises(ValueError, match="num_outputs"):
        ps.SVGP(RBF(2), torch.randn(3, 4, 2), ps.Gaussian())
    with pytest.raises(ValueError, match="Z contains NaN"):
        ps.SVGP(RBF(2), torch.full((4, 2), float("nan")), ps.Gaussian())


def test_duplicate_inducing_points_in_float32_escalate_jitter_with_a_warning():
    # on the CPU: that float32 rounding leaves these duplicates indefinite at jitter 1e-9 is LAPACK's doing (cuSOLVER
    # may factorise them); the escalation and its warnings under test are the same code on every device
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float32)
        Z = torch.randn(6, 2)
        Z[3] = Z[1]
        Z[4] = Z[1] + 1e-7
        kernel = RBF(2, lengthscale=torch.tensor(3.0))
        K = kernel(Z)
        reset_warnings()  # warnings are reported once per cause per process
        with pytest.warns(IllConditionedWarning, match="2 of its 6 pivots come from the jitter"):  # the duplicates
            with pytest.warns(CholeskyJitterWarning, match="succeeded with relative jitter"):
                L = cholesky(K, jitter=1e-9)
        assert torch.isfinite(L).all()
        X, y = torch.randn(8, 2), torch.randn(8)
        # unwhitened, Kuu^{-1} enters the bound: the ill-conditioning advice is true and fires
        reset_warnings()
        with pytest.warns(IllConditionedWarning, match="whiten=True"), pytest.warns(CholeskyJitterWarning):
            gp = ps.SVGP(kernel, Z, ps.Gaussian(), jitter=1e-9, whiten=False)  # its q(u) starts at p(u): Kuu's factor
            loss = _loss(gp, X, y)
        assert torch.isfinite(torch.tensor(loss))
        # whitened (the default) never inverts Kuu: only the jitter it needed is reported
        gp = ps.SVGP(kernel, Z, ps.Gaussian(), jitter=1e-9)
        reset_warnings()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = _loss(gp, X, y)
        assert torch.isfinite(torch.tensor(loss))
        kinds = {type(w.message) for w in seen}
        assert CholeskyJitterWarning in kinds and IllConditionedWarning not in kinds, kinds


def test_hopeless_matrix_raises_linalg_error_naming_the_jitter():
    K = -torch.eye(3)
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite even with relative jitter"):
        cholesky(K)
    with pytest.raises(ValueError, match="NaN"):
        cholesky(torch.full((3, 3), float("nan")))


def test_ill_conditioning_advice_fits_the_method_and_is_silent_where_harmless():
    """IllConditionedWarning gives the advice that is true where it fires: EP (which needs Kuu^{-1}, whitened or
    not) says to remove the duplicate inducing inputs and does not offer whiten=True; joint posterior draws at many
    points (a covariance that is low-rank by nature) and a whitened layer's Kuu do not warn at all."""
    X = torch.linspace(-2, 2, 40)[:, None]
    y = (X[:, 0] > 0).long()
    Z = X[::4].clone()
    Z[1] = Z[0]  # a repeated inducing input, as random rows of a data set with repeated rows give
    gp = ps.SVGP(RBF(1), Z, ps.RobustMax(2))
    reset_warnings()
    with pytest.warns(IllConditionedWarning, match="whose inverse this method uses") as seen:
        ps.infer.fit_ep(gp, X, y, num_iters=2)
    assert not any("whiten=True" in str(w.message) for w in seen)
    smooth = ps.SVGP(RBF(1, lengthscale=torch.tensor(2.0)), X[::8].clone(), ps.Gaussian(0.1))
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the whitened Kuu of Z nor the 300 x 300 covariance of q(f*) warns
        draws = smooth.sample_posterior(torch.linspace(-2, 2, 300)[:, None], num_samples=3)
    assert draws.shape == (3, 300) and torch.isfinite(draws).all()


def test_a_user_kernel_with_a_transposed_or_square_block_is_refused():
    """A user kernel's ``forward(X, Z)`` must give ``[N, M]`` and ``forward(X, diag=True)`` ``[N]``: a transposed block
    used to be reshaped into ``[N, M]`` silently (a model that trained on scrambled covariances)."""
    from pyro.contrib.gp.kernels import Kernel

    class Transposed(Kernel):
        def forward(self, X, Z=None, diag=False):
            Z = X if Z is None else Z
            if diag:
                return torch.ones(X.shape[0], dtype=X.dtype)
            return torch.exp(-0.5 * torch.cdist(Z, X) ** 2)  # [M, N]: the bug

    class SquareDiag(Kernel):
        def forward(self, X, Z=None, diag=False):
            Z = X if Z is None else Z
            return torch.exp(-0.5 * torch.cdist(X, Z) ** 2)  # ignores diag

    X, y = torch.randn(6, 2), torch.randn(6)
    with pytest.raises(ValueError, match=r"k\(X, Z\) must have shape \[3, 6\].*got \[6, 3\] \(transposed"):
        ps.SVGP(Transposed(2), X[:3].clone(), ps.Gaussian(0.1)).analytic_elbo(X, y)
    with pytest.raises(ValueError, match=r"k\(X, diag=True\) must have shape \[6\]"):
        ps.SVGP(SquareDiag(2), X[:3].clone(), ps.Gaussian(0.1)).analytic_elbo(X, y)
