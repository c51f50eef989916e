"""Natural-gradient steps (Hensman 2013, section 3.2) against the dense optimum of section 2."""

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.bounds import svgp as B
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.natgrad import (
    gaussian_natgrad_step,
    natgrad_step,
    noise_natgrad_likelihood,
    noise_step_from_grads_,
)

N, M, D = 60, 8, 2


def _gp(whiten, num_outputs=None):
    X = torch.rand(N, D) * 4 - 2
    f = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1]
    y = f + 0.2 * torch.randn(N)
    if num_outputs:
        y = torch.stack([y, -y + 0.1 * torch.randn(N)], -1)
    gp = ps.SVGP(
        RBF(D, lengthscale=torch.tensor(0.8)),
        torch.rand(M, D) * 4 - 2,
        ps.Gaussian(0.05),
        num_outputs=num_outputs,
        whiten=whiten,
    )
    return X, y, gp


def _optimum(gp, X, y):
    k = gp.kernel
    Kuu = k(gp.Z) + 1e-10 * torch.eye(M)
    m, L = B.optimal_qu(y, gp.likelihood.noise, Kuu, k(gp.Z, X))
    if gp.whiten:
        Luu = torch.linalg.cholesky(Kuu)
        m = torch.linalg.solve_triangular(Luu, m.unsqueeze(-1), upper=False).squeeze(-1)
        L = torch.linalg.cholesky(
            torch.linalg.solve_triangular(
                Luu, torch.linalg.solve_triangular(Luu, L @ L.mT, upper=False).mT, upper=False
            )
        )
    return m, L


@pytest.mark.float64
@pytest.mark.parametrize("whiten", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("step", [gaussian_natgrad_step, natgrad_step], ids=["closed_form", "autograd"])
def test_one_full_batch_step_of_length_one_lands_on_the_optimum(step, whiten):
    X, y, gp = _gp(whiten)
    step(gp, X, y, lr=1.0)
    m, L = _optimum(gp, X, y)
    torch.testing.assert_close(gp.q_u.u_loc, m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gp.q_u.u_scale_tril @ gp.q_u.u_scale_tril.mT, L @ L.mT, rtol=1e-6, atol=1e-6)
    # and the bound there is Titsias' collapsed bound (Hensman 2013 section 2)
    k = gp.kernel
    with torch.no_grad():
        Kuu, Kuf, kd = k(gp.Z) + 1e-10 * torch.eye(M), k(gp.Z, X), k(X, diag=True)
        bound = B.kl_sparse_bound(
            y, gp.likelihood.expected_log_prob, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=whiten
        )
        assert abs(bound - B.titsias_bound(y, gp.likelihood.noise, Kuu, Kuf, kd)) < 1e-6 * abs(bound)


def test_minibatch_steps_converge_to_the_optimum():
    """With N/B scaling and decreasing steps, minibatch natural gradients approach the full-batch optimum."""
    X, y, gp = _gp(whiten=True)
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    for t in range(1000):
        idx = torch.randperm(N, generator=g)[:30]
        gaussian_natgrad_step(gp, X[idx], y[idx], lr=1.0 / (t + 2) ** 0.7, num_data=N)
    m, L = _optimum(gp, X, y)
    # from the prior (error = |m|) to within a few per cent of the optimum
    assert (gp.q_u.u_loc - m).abs().max() < 0.05 * m.abs().max()


def test_multi_output_step_matches_each_output_alone():
    X, y, gp = _gp(whiten=True, num_outputs=2)
    gaussian_natgrad_step(gp, X, y, lr=1.0)
    for out in range(2):
        X1, _, gp1 = X, None, ps.SVGP(gp.kernel, gp.Z.detach(), gp.likelihood, whiten=True)
        gaussian_natgrad_step(gp1, X1, y[:, out], lr=1.0)
        torch.testing.assert_close(gp.q_u.u_loc[out], gp1.q_u.u_loc)


@pytest.mark.float64
def test_non_conjugate_step_increases_the_bound():
    X, y, gp = _gp(whiten=True)
    y = (y > 0).to(X.dtype)
    gp.likelihood = ps.Bernoulli("probit")
    k = gp.kernel

    def bound():
        with torch.no_grad():
            Kuu, Kuf, kd = k(gp.Z) + 1e-10 * torch.eye(M), k(gp.Z, X), k(X, diag=True)
            return B.kl_sparse_bound(
                y, gp.likelihood.expected_log_prob, Kuu, Kuf, kd, gp.q_u.u_loc, gp.q_u.u_scale_tril, whiten=True
            )

    values = [bound()]
    for _ in range(15):
        natgrad_step(gp, X, y, lr=0.5)
        values.append(bound())
    assert all(b > a - 1e-9 for a, b in zip(values[:-1], values[1:], strict=True))
    assert values[-1] > values[0] + 1.0


def _noise_optimum(gp, X, y):
    """``S / n`` with ``S = sum E_q[(y - f)^2]`` from q(f)'s marginals (dense), ``n`` the number of observations."""
    with torch.no_grad():
        loc, var = gp.qf(X)
        yt = y.mT if gp.num_outputs else y
        return ((yt - loc).square() + var).sum() / y.numel()


@pytest.mark.float64
@pytest.mark.parametrize("num_outputs", [None, 2], ids=["one_output", "two_outputs"])
@pytest.mark.parametrize("lr", [1.0, 0.3])
def test_noise_step_moves_to_the_optimum_given_q(num_outputs, lr):
    """A Fisher-scoring step of length rho on the noise variance is (1 - rho) sigma^2 + rho S/n, and S/n maximises
    the bound in sigma^2 given q(f) (checked by perturbing it both ways)."""
    X, y, gp = _gp(whiten=True, num_outputs=num_outputs)
    gaussian_natgrad_step(gp, X, y, lr=0.6)  # q(u) away from the prior and from its optimum
    before, target = gp.likelihood.noise.detach().clone(), _noise_optimum(gp, X, y)
    for p in gp.parameters():
        p.grad = None
    (-gp.analytic_elbo(X, y)).backward()
    noise_step_from_grads_(gp.likelihood, lr, y.numel())
    torch.testing.assert_close(gp.likelihood.noise.detach(), (1 - lr) * before + lr * target, rtol=1e-10, atol=0)
    if lr == 1.0:
        with torch.no_grad():
            best = gp.analytic_elbo(X, y)
            for factor in (0.99, 1.01):
                gp.likelihood.noise = target * factor
                assert gp.analytic_elbo(X, y) < best


def test_noise_step_needs_a_gradient_and_skips_a_frozen_noise_or_one_with_a_prior():
    import pyro.distributions as dist
    from pyro.nn import PyroSample

    X, y, gp = _gp(whiten=True)
    with pytest.raises(ValueError, match="backward"):
        noise_step_from_grads_(gp.likelihood, 0.5, N)
    assert noise_natgrad_likelihood(gp) is gp.likelihood
    gp.likelihood.noise_unconstrained.requires_grad_(False)  # frozen by the user: fit leaves it alone
    assert noise_natgrad_likelihood(gp) is None
    before = gp.likelihood.noise.detach().clone()
    fit(gp, X, y, num_steps=2, batch_size=N, natgrad=0.5, progress=False)
    assert torch.equal(gp.likelihood.noise.detach(), before)
    gp.likelihood.noise = PyroSample(dist.LogNormal(-2.0, 1.0))
    assert noise_natgrad_likelihood(gp) is None
    gp.likelihood = ps.Bernoulli()
    assert noise_natgrad_likelihood(gp) is None


@pytest.mark.parametrize("frozen", ["q_u", "q_v"])
def test_fit_leaves_a_frozen_solvegp_family_and_steps_its_partner(frozen):
    """A SOLVE-GP family frozen the PyTorch way is in no joint pair: it stays put and the other family takes its own
    natural steps (the joint step used to raise "no gradient; call backward() first")."""
    X, y, _ = _gp(whiten=True)
    gp = ps.SOLVEGP(RBF(D), X[:4].clone(), X[4:8].clone(), ps.Gaussian(0.1))
    other = "q_v" if frozen == "q_u" else "q_u"
    for p in getattr(gp, frozen).parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in gp.state_dict().items()}
    elbo0 = gp.analytic_elbo(X, y).item()
    fit(gp, X, y, num_steps=10, batch_size=N, progress=False)
    after = gp.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(frozen + "."))
    assert not torch.equal(before[other + ".u_loc_unconstrained"], after[other + ".u_loc_unconstrained"])
    assert gp.analytic_elbo(X, y).item() > elbo0


@pytest.mark.float64
@pytest.mark.parametrize("num_outputs", [None, 2], ids=["one_output", "two_outputs"])
def test_fit_with_natural_gradients_reaches_the_collapsed_optimum_in_the_noise(num_outputs):
    """fit steps q(u) and the noise together from one gradient; with frozen kernel hyperparameters (lr tiny) and the
    full batch the iteration converges to the joint maximiser: the noise maximising Titsias' collapsed bound
    (found independently by a golden-section search on the dense bound) and q(u) optimal at that noise."""
    X, y, gp = _gp(whiten=False, num_outputs=num_outputs)
    yt = y.mT if num_outputs else y  # [(L,) N]: the outputs share the noise
    fit(gp, X, y, num_steps=100, batch_size=N, lr=1e-12, natgrad=1.0, progress=False)
    k = gp.kernel
    with torch.no_grad():
        Kuu, Kuf, kd = k(gp.Z) + 1e-10 * torch.eye(M), k(gp.Z, X), k(X, diag=True)

        def collapsed(log_noise):
            return B.titsias_bound(yt, torch.exp(torch.tensor(log_noise)), Kuu, Kuf, kd).sum().item()

        lo, hi, phi = -10.0, 3.0, (5**0.5 - 1) / 2
        for _ in range(100):
            a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
            lo, hi = (lo, b) if collapsed(a) > collapsed(b) else (a, hi)
        noise = torch.exp(torch.tensor((lo + hi) / 2))
        torch.testing.assert_close(gp.likelihood.noise.detach(), noise, rtol=1e-5, atol=0)
        m, L = B.optimal_qu(yt, noise, Kuu, Kuf)
    torch.testing.assert_close(gp.q_u.u_loc.detach(), m, rtol=1e-4, atol=1e-5)


@pytest.mark.float64
def test_noise_step_respects_a_lower_bound_constraint():
    """A noise constrained to ``> c`` (another transform than exp) still moves to S/n, and never below ``c``."""
    import pyro.distributions.constraints as constraints
    from pyro.nn import PyroParam

    X, y, gp = _gp(whiten=True)
    gp.likelihood.noise = PyroParam(torch.tensor(0.3), constraints.greater_than(0.01))
    gaussian_natgrad_step(gp, X, y, lr=1.0)
    target = _noise_optimum(gp, X, y)
    (-gp.analytic_elbo(X, y)).backward()
    noise_step_from_grads_(gp.likelihood, 1.0, N)
    torch.testing.assert_close(gp.likelihood.noise.detach(), target, rtol=1e-10, atol=0)
    gp.likelihood.noise_unconstrained.grad = torch.tensor(1e6)  # a step that would leave the support is refused
    before = gp.likelihood.noise.detach().clone()
    noise_step_from_grads_(gp.likelihood, 1.0, N)
    assert torch.equal(gp.likelihood.noise.detach(), before)
