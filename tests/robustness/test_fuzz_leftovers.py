"""The fuzz suite's last silent and unclear cases (issue 45, item 5), each now loud and named:

* float32 inputs that rounding merged into one number (Unix seconds within two minutes: a column constant at 1.7e9)
  carry no information, and the model that trained on them predicts nothing; an :class:`InputPrecisionWarning` names
  the column, the spacing and the fix (the spread test cannot see it: the spread is 0);
* ``linalg.cholesky`` of a non-symmetric matrix factorised its lower triangle without a word; it refuses it now, and
  a 1-D tensor or a non-square one, naming ``A`` and its shape;
* a Pólya-Gamma ``b`` and ``c`` that do not broadcast got torch's size message; the error names both;
* a noise driven to 0 by a poisoned parameter raised torch's ``Expected parameter scale`` from the middle of ``fit``
  and left the module poisoned; it is a :class:`NonFiniteLossError` now, with the last good parameters restored."""

import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.checks import InputPrecisionWarning
from pyro_sparsegp.context.deferred import DeferredChecks, deferred_checks
from pyro_sparsegp.distributions import PolyaGamma
from pyro_sparsegp.infer import NonFiniteLossError, fit
from pyro_sparsegp.linalg import cholesky, reset_warnings


# -- float32 inputs merged by rounding ---------------------------------------------------------------------------------
def _unix_seconds(n, dtype=torch.float32):
    """``n`` times within 10 s of 1.7e9 (Unix seconds of November 2023), made in float64 and converted by the user,
    and a second, standardised column."""
    g = torch.Generator().manual_seed(0)
    t = 1.7e9 + 10 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return torch.cat([t, torch.randn(n, 1, generator=g, dtype=torch.float64)], -1).to(dtype)


def test_float32_inputs_merged_by_rounding_warn_once_with_the_fix():
    reset_warnings()
    torch.set_default_dtype(torch.float32)  # a float32 model whatever the pass (the fixture restores the default)
    X = _unix_seconds(50)
    assert (X[:, 0] == X[0, 0]).all()  # what float32 made of 50 different times: one number
    gp = ps.SVGP(RBF(2), torch.randn(4, 2), ps.Gaussian(0.1))
    with pytest.warns(InputPrecisionWarning, match=r"X \(torch.float32\): column 0 is the same number, 1\.7e\+09, in "
                                                   r"all 50 rows.* 128 apart.*in float64") as record:
        gp.predict(X)
        gp.predict(X)  # once per cause
    assert sum(issubclass(w.category, InputPrecisionWarning) for w in record) == 1
    # silent where nothing was merged: the same times in float64, a constant column of ordinary size, zeros
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputPrecisionWarning)
        fixed = _unix_seconds(50, torch.float64)
        fixed[:, 0] -= 1.7e9  # the fix: the offset removed in float64, then converted
        gp.predict(fixed.float())
        for column in (torch.full((50, 1), 3.0), torch.zeros(50, 1)):
            gp.predict(torch.cat([column, torch.randn(50, 1)], -1).float())


def test_a_model_trained_on_merged_inputs_predicts_nothing_and_said_so():
    """Why it warns: the same function of time fits to RMSE 0.02 from times given relative to their start and to
    about the function's spread (0.7) from float32 Unix seconds, where every time is one number."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    t = 10 * torch.rand(300, 1, dtype=torch.float64)
    y = torch.sin(t[:, 0]).float() + 0.1 * torch.randn(300)
    rmse = {}
    for offset in (0.0, 1.7e9):
        reset_warnings()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            gp = ps.SVGP(RBF(1), (torch.linspace(0, 10, 20, dtype=torch.float64)[:, None] + offset).float(),
                         ps.Gaussian(0.1))
            fit(gp, (t + offset).float(), y, num_steps=40, batch_size=150, progress=False)
            mean, _ = gp.predict((t + offset).float())
        rmse[offset] = float((mean - torch.sin(t[:, 0]).float()).pow(2).mean().sqrt())
        merged = [w for w in seen if issubclass(w.category, InputPrecisionWarning) and "same number" in str(w.message)]
        assert bool(merged) == (offset > 0), (offset, [str(w.message) for w in seen])
    assert rmse[0.0] < 0.1 and rmse[1.7e9] > 0.5, rmse


# -- cholesky's input checks -------------------------------------------------------------------------------------------
def _spd(M, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(M, M, generator=g, dtype=dtype)
    return B @ B.mT + M * torch.eye(M, dtype=dtype)


@pytest.mark.parametrize("M", [5, 40, 700])  # every entry compared; above 512, the rows of 64 indices
def test_cholesky_refuses_a_non_symmetric_matrix(M):
    A = _spd(M)
    L = cholesky(A)
    torch.testing.assert_close(L @ L.mT, A)  # a symmetric one is factorised as before
    i, j = M - 1, 0  # rows 0 and M - 1 are sampled at every size
    bad = A.clone()
    bad[i, j] += 0.5 * A[i, i]  # what the lower triangle alone would factorise, silently: another matrix
    with pytest.raises(ValueError, match=rf"A \({M}, {M}\) is not symmetric: \|A\[0, {i}\] - A\[{i}, 0\]\|.*"
                                         r"0\.5\*\(A \+ A\.mT\)|A \(.*\) is not symmetric.*0\.5 \* \(A \+ A\.mT\)"):
        cholesky(bad)
    batch = torch.stack([A, bad, A])  # one bad matrix in a batch is enough
    with pytest.raises(ValueError, match="is not symmetric"):
        cholesky(batch)


def test_cholesky_takes_round_off_asymmetry_and_checks_the_shape():
    A = _spd(30, torch.float32)
    wobble = A * (1 + 1e-6 * torch.randn(30, 30, generator=torch.Generator().manual_seed(1), dtype=A.dtype))
    assert not torch.equal(wobble, wobble.mT)
    L = cholesky(wobble)
    torch.testing.assert_close(L @ L.mT, torch.tril(wobble) + torch.tril(wobble, -1).mT, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match=r"A must be a square matrix.*got shape \(5,\); for a scalar variance"):
        cholesky(torch.ones(5))
    with pytest.raises(ValueError, match=r"A must be a square matrix.*got shape \(2, 3\)"):
        cholesky(torch.ones(2, 3))
    with pytest.raises(TypeError, match="A must be a torch.Tensor"):
        cholesky([[1.0, 0.0], [0.0, 1.0]])


def test_inside_fits_deferred_steps_cholesky_reads_nothing_back():
    """On an accelerator ``fit``'s steps read nothing back (pyro_sparsegp.context.deferred): the symmetry test, which
    reads, is not run there (the package's own matrices are symmetric by construction); a float tensor would sync."""
    A = _spd(6)
    bad = A.clone()
    bad[5, 0] += 10.0
    with deferred_checks(DeferredChecks(A.device)):
        L = cholesky(bad)
    torch.testing.assert_close(L @ L.mT, torch.tril(bad) + torch.tril(bad, -1).mT)


# -- Pólya-Gamma arguments ---------------------------------------------------------------------------------------------
def test_polya_gamma_arguments_that_do_not_broadcast_are_named():
    with pytest.raises(ValueError, match=r"PolyaGamma: b \(3,\) and c \(4,\) do not broadcast.*size-1 dims"):
        PolyaGamma(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match=r"PolyaGamma: b and c must be numbers or tensors \(c is a str\)"):
        PolyaGamma(torch.ones(3), "1")
    assert PolyaGamma(1.0, torch.ones(2, 3)).batch_shape == (2, 3)  # what broadcasts still does


# -- a noise driven to zero --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("elbo", ["analytic", "trace"])
def test_a_noise_driven_to_zero_is_a_non_finite_loss_error_and_the_module_is_restored(elbo):
    """A raw noise parameter poisoned to -1e4 (``exp`` underflows: the noise is exactly 0) after step 4: torch's
    distributions refuse the zero scale; ``fit`` raises :class:`NonFiniteLossError` naming the step and the cause,
    with the parameters of the last step kept before it back in the module (those at which the loss of step 3 was
    computed, as for a NaN: ``tests/infer/test_fit.py``), a noise of about 0.5 again."""
    import pyro

    X = torch.rand(300, 1) * 6 - 3
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(300)
    gp = ps.SVGP(RBF(1), torch.linspace(-3, 3, 12).unsqueeze(-1), ps.Gaussian(0.5))
    good = {}

    def poison(step, loss):  # step: the steps taken; the module is where the next step's loss is computed
        if step == 3:
            good.update({k: v.detach().clone() for k, v in gp.state_dict().items()})
        if step == 4:
            with torch.no_grad():
                gp.likelihood.noise_unconstrained.fill_(-1e4)

    with pytest.raises(NonFiniteLossError, match=r"Expected parameter scale.*at step 4; parameters restored to those "
                                                 r"of step 3") as info:
        fit(gp, X, y, num_steps=20, batch_size=64, progress=False, callback=poison, natgrad=None, sync_every=1,
            elbo="analytic" if elbo == "analytic" else pyro.infer.TraceMeanField_ELBO())
    assert info.value.step == 4 and isinstance(info.value.__cause__, ValueError)
    for k, v in gp.state_dict().items():
        torch.testing.assert_close(v, good[k], rtol=0, atol=0, msg=k)
    assert 0.3 < gp.likelihood.noise.item() < 0.7
