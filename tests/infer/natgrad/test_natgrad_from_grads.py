"""Natural gradients from the backward pass (``natgrad_from_grads_``, what ``fit`` uses) for q(u) and for SOLVE-GP's
q(v⊥), against optima computed here with dense matrices and explicit inverses (and against eqs. 28-29 of Shi,
Titsias, Mnih 2020 through the package's bound module)."""

import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import solvegp as SB
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.natgrad import (
    gaussian_natgrad_step,
    natgrad_families,
    natgrad_from_grads_,
    solvegp_natgrad_step,
)

N, M, M2, D = 50, 6, 5, 2
NOISE = 0.05


def _data():
    X = torch.rand(N, D) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.2 * torch.randn(N)
    return X, y


def _solve(whiten):
    return ps.SOLVEGP(
        RBF(D, lengthscale=torch.tensor(0.7)), torch.rand(M, D) * 4 - 2, torch.rand(M2, D) * 4 - 2,
        ps.Gaussian(NOISE), whiten=whiten,
    )


def _dense(gp, X):
    """Plain-coordinate matrices: A = Kfu Kuu^-1, Dm = Cfv Cvv^-1, Kuu, Cvv (explicit inverses, float64)."""
    k = gp.kernel
    with torch.no_grad():
        Z, O = gp.Z, gp.O
        Kuu, Kuv, Kvv = k(Z), k(Z, O), k(O)
        Kfu, Kfv = k(X, Z), k(X, O)
        Kuu_inv = torch.linalg.inv(Kuu)
        Cvv = Kvv - Kuv.mT @ Kuu_inv @ Kuv
        Cfv = Kfv - Kfu @ Kuu_inv @ Kuv
        return Kfu @ Kuu_inv, Cfv @ torch.linalg.inv(Cvv), Kuu, Cvv


def _conditional_optimum(A_self, A_other, m_other, K_prior, y):
    """argmax of E_q log N(y | A_self s + A_other m_other, NOISE) - KL[q(s) || N(0, K_prior)]: (m, S)."""
    beta = 1.0 / NOISE
    S = torch.linalg.inv(torch.linalg.inv(K_prior) + beta * A_self.mT @ A_self)
    m = beta * S @ A_self.mT @ (y - A_other @ m_other)
    return m, S


def _plain(q, K, whiten):
    """(m, S) of a family in plain coordinates (whitened: u = chol(K) u')."""
    m, L = q.u_loc.detach(), q.u_scale_tril.detach()
    S = L @ L.mT
    if whiten:
        Lk = torch.linalg.cholesky(K)
        m, S = Lk @ m, Lk @ S @ Lk.mT
    return m, S


def _set_plain(q, m, S, K, whiten):
    if whiten:
        Lk = torch.linalg.cholesky(K)
        m = torch.linalg.solve_triangular(Lk, m.unsqueeze(-1), upper=False).squeeze(-1)
        S = torch.linalg.solve_triangular(Lk, torch.linalg.solve_triangular(Lk, S, upper=False).mT, upper=False)
    q.set(m, torch.linalg.cholesky(0.5 * (S + S.mT)))


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("site", ["v", "u"])
def test_one_full_batch_step_lands_on_the_optimum_given_the_other_factor(site, whiten):
    """One step of length 1 on q(v⊥) (or q(u)), with the other factor held at an arbitrary q, lands on the
    conditional optimum of eq. 8 (a dense solve)."""
    X, y = _data()
    gp = _solve(whiten)
    A, Dm, Kuu, Cvv = _dense(gp, X)
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    if site == "v":  # q(u) fixed: any q(u)
        q, other, K, K_other, F, F_other = gp.q_v, gp.q_u, Cvv, Kuu, Dm, A
        _set_plain(other, torch.randn(M, generator=g), 0.1 * torch.eye(M) + 0.05, K_other, whiten)
    else:  # q(v) fixed
        q, other, K, K_other, F, F_other = gp.q_u, gp.q_v, Kuu, Cvv, A, Dm
        _set_plain(other, torch.linspace(-1, 1, M2), 0.3 * Cvv, K_other, whiten)
    m_other, _ = _plain(other, K_other, whiten)
    solvegp_natgrad_step(gp, X, y, lr=1.0, sites=(site,))
    m, S = _conditional_optimum(F, F_other, m_other, K, y)
    m_q, S_q = _plain(q, K, whiten)
    _close(m_q, m)
    _close(S_q, S)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_q_v_step_at_the_optimal_q_u_lands_on_eqs_28_29(whiten):
    """Eqs. 28-29 maximise eq. 9, i.e. eq. 8 with q(u) optimised out; with q(u) at the joint optimum (a dense solve
    of the joint normal equations), one step of length 1 on q(v⊥) from the prior lands on eqs. 28-29."""
    X, y = _data()
    gp = _solve(whiten)
    m_u, m_v, S_u, _, Kuu, Cvv = _joint_optimum(gp, X, y)
    _set_plain(gp.q_u, m_u, S_u, Kuu, whiten)
    solvegp_natgrad_step(gp, X, y, lr=1.0, sites=("v",))
    k = gp.kernel
    with torch.no_grad():
        m28, L29 = SB.solvegp_optimal_q_v(y, NOISE, k(gp.Z), k(gp.Z, gp.O), k(gp.O), k(gp.Z, X), k(gp.O, X),
                                          whiten=whiten)
    _close(gp.q_v.u_loc, m28)
    _close(gp.q_v.u_scale_tril @ gp.q_v.u_scale_tril.mT, L29 @ L29.mT)
    _close(_plain(gp.q_v, Cvv, whiten)[0], m_v)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_gradient_step_equals_the_closed_form_svgp_step(whiten):
    """For SVGP's q(u) the step from the gradient is Hensman 2013's closed form (full batch, length 1: the optimum;
    minibatch, length 0.3: the same partial step)."""
    X, y = _data()
    for idx, lr, num_data in [(torch.arange(N), 1.0, None), (torch.arange(17), 0.3, N)]:
        gps = [ps.SVGP(RBF(D, lengthscale=torch.tensor(0.7)), X[:M].clone(), ps.Gaussian(NOISE), whiten=whiten)
               for _ in range(2)]
        with torch.no_grad():
            for gp in gps:
                gp.q_u.u_loc_unconstrained.copy_(torch.linspace(-1, 1, M))
        gaussian_natgrad_step(gps[0], X[idx], y[idx], lr=lr, num_data=num_data)
        solvegp_natgrad_step(gps[1], X[idx], y[idx], lr=lr, num_data=num_data, sites=("u",))
        _close(gps[1].q_u.u_loc, gps[0].q_u.u_loc)
        _close(gps[1].q_u.u_scale_tril, gps[0].q_u.u_scale_tril)


def test_multi_output_step_is_each_output_alone():
    X, y = _data()
    Y = torch.stack([y, -2 * y], -1)
    gp = ps.SVGP(RBF(D), X[:M].clone(), ps.Gaussian(NOISE), num_outputs=2)
    solvegp_natgrad_step(gp, X, Y, lr=0.7, sites=("u",))
    for out in range(2):
        one = ps.SVGP(RBF(D), X[:M].clone(), ps.Gaussian(NOISE))
        solvegp_natgrad_step(one, X, Y[:, out], lr=0.7, sites=("u",))
        _close(gp.q_u.u_loc[out], one.q_u.u_loc, 1e-4)
        _close(gp.q_u.u_scale_tril[out], one.q_u.u_scale_tril, 1e-4)


def test_the_step_needs_gradients_and_a_full_covariance_family():
    gp = ps.SOLVEGP(RBF(D), torch.randn(M, D), torch.randn(M2, D), ps.Gaussian(), odvgp=True)
    assert natgrad_families(gp) == [gp.q_u]  # ODVGP's mean-only q(v⊥) stays with Adam
    with pytest.raises(ValueError, match="full-covariance"):
        natgrad_from_grads_(gp.q_v, 0.5)
    with pytest.raises(ValueError, match="backward"):
        natgrad_from_grads_(gp.q_u, 0.5)


@pytest.mark.float64
def test_fit_with_natural_gradients_reaches_the_solvegp_optimum():
    """fit steps q(u), q(v⊥) (their means jointly) and the noise together from one gradient; with frozen kernel
    hyperparameters (lr tiny) and the full batch the iteration converges to the maximiser of eq. 8 (q(v⊥): eqs.
    28-29 at the noise it reached)."""
    X, y = _data()
    gp = _solve(whiten=True)
    fit(gp, X, y, num_steps=60, batch_size=N, lr=1e-12, natgrad=1.0, progress=False)
    k = gp.kernel
    with torch.no_grad():
        s2 = gp.likelihood.noise
        m28, L29 = SB.solvegp_optimal_q_v(y, s2, k(gp.Z), k(gp.Z, gp.O), k(gp.O), k(gp.Z, X), k(gp.O, X), whiten=True)
    _close(gp.q_v.u_loc, m28, 1e-5)
    _close(gp.q_v.u_scale_tril @ gp.q_v.u_scale_tril.mT, L29 @ L29.mT, 1e-5)


def test_fit_trains_odvgp_with_natural_gradients_on_q_u():
    X, y = _data()
    gp = ps.SOLVEGP(RBF(D), X[:M].clone(), X[M : M + M2].clone(), ps.Gaussian(0.1), odvgp=True)
    before = gp.q_v.u_loc.detach().clone()
    state = fit(gp, X, y, num_steps=40, batch_size=25, lr=0.02, natgrad=0.5, progress=False)
    assert state.losses[-1] < state.losses[0]
    assert not torch.equal(gp.q_v.u_loc.detach(), before)  # Adam trained the mean-only q(v⊥)


def _joint_optimum(gp, X, y):
    """The maximiser of eq. 8 in plain coordinates by a dense solve of the joint normal equations: means
    ``(m_u, m_v)`` and the two covariances."""
    A, Dm, Kuu, Cvv = _dense(gp, X)
    beta = 1.0 / NOISE
    F = torch.cat([A, Dm], -1)
    prec = torch.block_diag(torch.linalg.inv(Kuu), torch.linalg.inv(Cvv)) + beta * F.mT @ F
    means = torch.linalg.solve(prec, beta * F.mT @ y)
    S_u = torch.linalg.inv(torch.linalg.inv(Kuu) + beta * A.mT @ A)
    S_v = torch.linalg.inv(torch.linalg.inv(Cvv) + beta * Dm.mT @ Dm)
    return means[:M], means[M:], S_u, S_v, Kuu, Cvv


def _start_anywhere(gp, X, whiten):
    A, Dm, Kuu, Cvv = _dense(gp, X)
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    _set_plain(gp.q_u, torch.randn(M, generator=g), 0.1 * torch.eye(M) + 0.05, Kuu, whiten)
    _set_plain(gp.q_v, torch.randn(M2, generator=g), 0.3 * Cvv, Cvv, whiten)


def _assert_at_joint_optimum(gp, X, y, whiten, tol=1e-6):
    m_u, m_v, S_u, S_v, Kuu, Cvv = _joint_optimum(gp, X, y)
    for q, m, S, K in ((gp.q_u, m_u, S_u, Kuu), (gp.q_v, m_v, S_v, Cvv)):
        m_q, S_q = _plain(q, K, whiten)
        _close(m_q, m, tol)
        _close(S_q, S, tol)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_joint_step_lands_on_the_maximiser_of_eq_8(whiten):
    """Both sites at once: the means move jointly (solvegp_joint_natgrad_from_grads_), so one full-batch step of
    length 1 from an arbitrary q(u) q(v⊥) lands on the joint maximiser of eq. 8 (a dense solve), not on each
    factor's optimum given the other's old mean (which separate steps would give)."""
    X, y = _data()
    gp = _solve(whiten)
    _start_anywhere(gp, X, whiten)
    solvegp_natgrad_step(gp, X, y, lr=1.0)
    _assert_at_joint_optimum(gp, X, y, whiten)
    assert gp.strategy.cross_probe is None


@pytest.mark.float64
def test_joint_steps_of_length_below_one_converge_to_the_maximiser():
    """Steps of length 0.5: once the covariances settle the mean step is a damped Newton step on the joint means,
    so 40 steps reach the maximiser."""
    X, y = _data()
    gp = _solve(whiten=True)
    _start_anywhere(gp, X, True)
    for _ in range(40):
        solvegp_natgrad_step(gp, X, y, lr=0.5)
    _assert_at_joint_optimum(gp, X, y, True, 1e-6)


@pytest.mark.float64
def test_joint_step_multi_output_is_each_output_alone():
    X, y = _data()
    Y = torch.stack([y, -2 * y], -1)
    Z, O = torch.rand(M, D) * 4 - 2, torch.rand(M2, D) * 4 - 2
    gp = ps.SOLVEGP(RBF(D, lengthscale=torch.tensor(0.7)), Z, O, ps.Gaussian(NOISE), num_outputs=2)
    solvegp_natgrad_step(gp, X, Y, lr=0.7)
    for out in range(2):
        one = ps.SOLVEGP(RBF(D, lengthscale=torch.tensor(0.7)), Z, O, ps.Gaussian(NOISE))
        solvegp_natgrad_step(one, X, Y[:, out], lr=0.7)
        for a, b in ((gp.q_u, one.q_u), (gp.q_v, one.q_v)):
            _close(a.u_loc[out], b.u_loc, 1e-6)
            _close(a.u_scale_tril[out], b.u_scale_tril, 1e-6)


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
def test_fit_steps_solvegp_means_jointly(whiten):
    """fit's natural-gradient step on a SOLVE-GP is the joint one: one full-batch step of length 1 (frozen noise,
    Adam's step 1e-12) lands on the maximiser of eq. 8, and the probe is gone afterwards."""
    X, y = _data()
    gp = _solve(whiten)
    gp.likelihood.noise_unconstrained.requires_grad_(False)
    _start_anywhere(gp, X, whiten)
    fit(gp, X, y, num_steps=1, batch_size=N, lr=1e-12, natgrad=1.0, progress=False)
    _assert_at_joint_optimum(gp, X, y, whiten, 1e-5)
    assert gp.strategy.cross_probe is None


@pytest.mark.float64
def test_deep_solvegp_last_layer_joint_step_zeroes_its_mean_gradient():
    """In a DeepGP whose last layer is a SOLVE-GP, the probe's gradient comes through DeepGP.analytic_elbo (the last
    layer's marginals at the propagated samples): with the hidden samples held (same seed) a joint step of length 1
    leaves the bound's gradient in the last layer's means (and covariances) at zero."""
    from pyro_sparsegp.deep import build_deep_gp
    from pyro_sparsegp.infer.natgrad import natgrad_pairs, set_natgrad_probes, solvegp_joint_natgrad_from_grads_

    X, y = _data()
    dgp = build_deep_gp(X, [2], ps.Gaussian(NOISE), num_inducing=M, num_orthogonal=M2, num_samples=3)
    last = dgp.last
    pairs = natgrad_pairs(dgp, natgrad_families(dgp))
    assert pairs == [last]
    qs = [last.q_u.u_loc_unconstrained, last.q_v.u_loc_unconstrained,
          last.q_u.u_scale_tril_unconstrained, last.q_v.u_scale_tril_unconstrained]

    def grads():
        torch.manual_seed(5)
        return torch.autograd.grad(-dgp.analytic_elbo(X, y), qs + [gp.strategy.cross_probe for gp in pairs])

    set_natgrad_probes(pairs)
    before = grads()
    assert before[-1].abs().max() > 1.0  # the coupling the joint step uses is there
    for p, g in zip(qs + [last.strategy.cross_probe], before, strict=True):
        p.grad = g
    solvegp_joint_natgrad_from_grads_(last, 1.0)
    set_natgrad_probes(pairs)
    after = grads()
    for g0, g1 in zip(before[:4], after[:4], strict=True):
        assert g1.abs().max() < 1e-6 * g0.abs().max()


@pytest.mark.float64
def test_joint_step_falls_back_to_the_factors_own_steps_without_a_joint_factor():
    """A cross block that makes the joint precision indefinite (here: planted) leaves the means to the factors' own
    steps, exactly, instead of a NaN or a wrong step."""
    from pyro_sparsegp.infer.natgrad import set_natgrad_probes, solvegp_joint_natgrad_from_grads_

    X, y = _data()
    gps = [_solve(True), _solve(True)]
    gps[1].load_state_dict(gps[0].state_dict())
    for gp in gps:
        set_natgrad_probes([gp])
        params = [*gp.q_u.parameters(), *gp.q_v.parameters(), gp.strategy.cross_probe]
        grads = torch.autograd.grad(-gp.analytic_elbo(X, y), params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    gps[0].strategy.cross_probe.grad.fill_(1e6)
    solvegp_joint_natgrad_from_grads_(gps[0], 0.5)
    natgrad_from_grads_(gps[1].q_u, 0.5)
    natgrad_from_grads_(gps[1].q_v, 0.5)
    for a, b in ((gps[0].q_u, gps[1].q_u), (gps[0].q_v, gps[1].q_v)):
        _close(a.u_loc, b.u_loc, 1e-12)
        _close(a.u_scale_tril, b.u_scale_tril, 1e-12)


@pytest.mark.float64
def test_fit_with_a_pyro_elbo_takes_the_factors_own_steps():
    """Under a Pyro ELBO the sites sample ``u`` and ``v⊥`` and the layer's ``qf`` (where the cross probe lives) is
    bypassed: ``fit`` then takes each factor's own natural-gradient step, which equals ``natgrad_from_grads_`` on
    the same gradients, instead of raising for the missing probe gradient."""
    from pyro.infer import TraceMeanField_ELBO

    from pyro_sparsegp.infer.natgrad import NatGradDampingWarning

    X, y = _data()
    gp = _solve(True)
    before = [gp.q_u.u_loc.detach().clone(), gp.q_v.u_loc.detach().clone()]
    with warnings.catch_warnings():  # a one-sample estimate of the covariance gradient may need its step damped
        warnings.simplefilter("ignore", NatGradDampingWarning)
        fit(gp, X, y, num_steps=3, batch_size=N, lr=1e-3, natgrad=0.05, elbo=TraceMeanField_ELBO(),
            progress=False)
    after = [gp.q_u.u_loc.detach(), gp.q_v.u_loc.detach()]
    for b, a in zip(before, after, strict=True):
        assert torch.isfinite(a).all() and (a - b).abs().max() > 1e-4


@pytest.mark.float64
def test_fit_step_under_a_pyro_elbo_is_natgrad_from_grads_on_the_same_gradients():
    """One ``fit`` step under a Pyro ELBO, replayed by hand: the same seed, the same (permuted) batch, the ELBO's
    gradients, then ``natgrad_from_grads_`` on q(u) and q(v⊥) -- the two results agree to round-off."""
    import copy

    import pyro
    from pyro.infer import TraceMeanField_ELBO

    X, y = _data()
    gp = _solve(True)
    replica = copy.deepcopy(gp)
    seen = []

    class Recorded(torch.utils.data.Dataset):  # fit reads batches by index: record the index it drew
        def __len__(self):
            return N

        def __getitem__(self, idx):
            seen.append(idx)
            return X[idx], y[idx]

    fit(gp, Recorded(), num_steps=1, batch_size=N, lr=1e-3, natgrad=ps.infer.NaturalPolicy(lr=0.05, retraction=True),
        elbo=TraceMeanField_ELBO(), progress=False)  # the positive-definite step: a one-sample gradient never damps
    idx = seen[-1]
    pyro.set_rng_seed(0)  # fit's seed=0 at a fresh run's start
    TraceMeanField_ELBO().differentiable_loss(replica.model, replica.guide, X[idx], y[idx], num_data=N).backward()
    for q in (replica.q_u, replica.q_v):
        natgrad_from_grads_(q, 0.05, True)
    for a, b in ((gp.q_u, replica.q_u), (gp.q_v, replica.q_v)):
        _close(a.u_loc, b.u_loc, 1e-10)
        _close(a.u_scale_tril, b.u_scale_tril, 1e-10)
