"""``ps.likelihoods.from_distribution``: any Pyro distribution as a likelihood of one or several latent functions.

The errors the module docstring states for its ``Q > 1`` rules are measured here against closed forms (a Poisson
of a linear combination of the latents, a Gaussian) and against a fine product rule whose own convergence is
checked; the ``"mc"`` rule is unbiased (many replicates, 4 standard errors); ``from_distribution`` of a built-in's own
distribution gives the built-in's bound within the rule's error; shapes follow the ``[..., 1, B]`` convention."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

import pyro_sparsegp as ps
from pyro_sparsegp.likelihoods import QuadratureMixture, from_distribution, gaussian_rule

# (Q, sd) -> the error bound the module docstring of pyro_sparsegp.likelihoods.generic states
POISSON_BOUNDS = {2: (1e-11, 3e-7), 3: (1e-11, 3e-7), 4: (1e-11, 3e-7), 5: (2e-6, 1e-3), 6: (2e-6, 1e-3),
                  7: (3e-3, 5e-2), 8: (3e-3, 5e-2), 12: (3e-3, 5e-2)}


def _problem(Q, sd, n=100):
    m = 0.5 * torch.randn(Q, n)
    return m, torch.full((Q, n), sd * sd)


def _linear_poisson(a):
    return from_distribution(lambda f: dist.Poisson((a[:, None] * f).sum(-2).exp()), latent_dim=len(a))


@pytest.mark.float64  # bounds down to 1e-11
@pytest.mark.parametrize("Q", list(POISSON_BOUNDS))
def test_default_rule_error_against_closed_forms(Q):
    """Poisson with log rate a^T f: E log p = y a^T m - exp(a^T m + a^T V a / 2) - log y!; a Gaussian of a^T f:
    log N(y; a^T m, s^2) - a^T V a / (2 s^2). Worst over 100 points and 5 draws, as the docstring states."""
    worst = {0.5: 0.0, 1.0: 0.0}
    for seed in range(5):
        torch.manual_seed(seed)
        for sd in worst:
            a = torch.randn(Q)
            a = a / a.norm()
            m, v = _problem(Q, sd)
            am, av = a @ m, (a**2) @ v
            y = torch.poisson(am.exp())
            exact = y * am - (am + av / 2).exp() - torch.lgamma(y + 1)
            got = _linear_poisson(a).expected_log_prob(y, m, v)
            assert got.shape == (1, 100)
            worst[sd] = max(worst[sd], (got[0] - exact).abs().max().item())
            yn = am + 0.3 * torch.randn(100)
            gauss = from_distribution(lambda f, a=a: dist.Normal((a[:, None] * f).sum(-2), 0.3), latent_dim=Q)
            exact_n = dist.Normal(am, 0.3).log_prob(yn) - av / (2 * 0.09)
            torch.testing.assert_close(gauss.expected_log_prob(yn, m, v)[0], exact_n, rtol=0, atol=1e-10)
    assert worst[0.5] < POISSON_BOUNDS[Q][0] and worst[1.0] < POISSON_BOUNDS[Q][1], worst


@pytest.mark.float64  # bounds down to 1e-9
def test_two_latent_rule_error_against_a_fine_product_rule():
    """Q = 2 with 20 nodes per latent, against 80 (itself within a tenth of the bound of 100 nodes)."""
    fns = {
        "hetero": (lambda f: dist.Normal(f[..., 0, :], f[..., 1, :].exp()), lambda n: torch.randn(n), 1.0, 1e-9),
        "gamma": (lambda f: dist.Gamma(f[..., 1, :].exp(), f[..., 1, :].exp() * (-f[..., 0, :]).exp()),
                  lambda n: torch.rand(n) * 3 + 0.05, 1.0, 1e-9),
        "student_t": (lambda f: dist.StudentT(3.0, f[..., 0, :], f[..., 1, :].exp()), lambda n: 2 * torch.randn(n),
                      0.5, 5e-3),
    }
    for name, (fn, ys, sd, bound) in fns.items():
        for seed in range(5):
            torch.manual_seed(seed)
            m, v = _problem(2, sd)
            y = ys(100)
            fine = from_distribution(fn, latent_dim=2, num_gh=80).expected_log_prob(y, m, v)
            finer = from_distribution(fn, latent_dim=2, num_gh=100).expected_log_prob(y, m, v)
            assert (fine - finer).abs().max() < bound / 10, name  # the reference has converged
            err = (from_distribution(fn, latent_dim=2).expected_log_prob(y, m, v) - fine).abs().max()
            assert err < bound, (name, seed, err)


def test_mc_rule_is_unbiased_and_differentiable():
    a = torch.tensor([0.6, -0.8, 0.0])
    lik = from_distribution(lambda f: dist.Poisson((a[:, None] * f).sum(-2).exp()), latent_dim=3, rule="mc",
                            num_samples=16)
    m, v = _problem(3, 0.7, n=4)
    m.requires_grad_(True)
    am, av = a @ m, (a**2) @ v
    y = torch.tensor([0.0, 1.0, 2.0, 5.0])
    exact = (y * am - (am + av / 2).exp() - torch.lgamma(y + 1)).detach()
    R = 4000
    reps = lik.expected_log_prob(y, m.expand(R, 3, 4), v)[:, 0]  # R independent estimates [R, 4]
    se = reps.std(0) / math.sqrt(R)
    assert (se > 0).all() and ((reps.mean(0) - exact).abs() < 4 * se).all(), (reps.mean(0), exact, se)
    (g,) = torch.autograd.grad(lik.expected_log_prob(y, m, v).sum(), m)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_qmc_rule_matches_first_and_second_moments():
    for Q in (2, 7, 9):
        x, w = gaussian_rule(Q, "qmc")
        assert x.shape == (4096, Q) and w.shape == (4096,)
        torch.testing.assert_close(w.sum(), torch.tensor(1.0))
        torch.testing.assert_close(w @ x, torch.zeros(Q), rtol=0, atol=1e-6)
        torch.testing.assert_close((x.T * w) @ x, torch.eye(Q), rtol=0, atol=1e-5)
    x, w = gaussian_rule(3, "gh", num_gh=4)
    assert x.shape == (64, 3)
    torch.testing.assert_close((w[:, None] * x**4).sum(0), torch.full((3,), 3.0))  # E z^4 = 3, exact for 4 nodes


# -- built-ins against from_distribution of their own distribution --------------------------------------------
BUILTINS = {
    "Poisson": (lambda: ps.Poisson(), lambda n: torch.poisson(2 * torch.ones(n))),
    "NegativeBinomial": (lambda: ps.NegativeBinomial(0.6), lambda n: torch.poisson(2 * torch.ones(n))),
    "ZeroInflatedPoisson": (lambda: ps.ZeroInflatedPoisson(0.3), lambda n: torch.poisson(torch.ones(n))),
    "ZeroInflatedNegativeBinomial": (lambda: ps.ZeroInflatedNegativeBinomial(0.6, 0.3),
                                     lambda n: torch.poisson(torch.ones(n))),
    "StudentT": (lambda: ps.StudentT(1.2, 4.0), lambda n: 2 * torch.randn(n)),
    "Gamma": (lambda: ps.Gamma(2.5), lambda n: 0.05 + 3 * torch.rand(n)),
    "Beta": (lambda: ps.Beta(8.0), lambda n: 0.02 + 0.96 * torch.rand(n)),
}


@pytest.mark.parametrize("name", list(BUILTINS))
def test_builtin_equals_from_distribution_of_its_distribution(name):
    """1-D Gauss-Hermite over the built-in's own distribution, at q(f) of sd <= 1 (where 20 nodes err below 1e-6
    for every one of them: the closed forms are exact, and the quadratures' rules are measured in their modules)."""
    make, ys = BUILTINS[name]
    lik = make()
    wrapped = from_distribution(lik.distribution, support=lik.support)
    m, v = torch.randn(30), 0.05 + 0.95 * torch.rand(30)
    y = ys(30)
    with torch.no_grad():
        tol = 1e-6 if torch.get_default_dtype() == torch.float64 else 2e-4
        torch.testing.assert_close(wrapped.expected_log_prob(y, m, v), lik.expected_log_prob(y, m, v), rtol=0,
                                   atol=tol)
        torch.testing.assert_close(wrapped.predictive(m, v).log_prob(y), lik.predictive(m, v).log_prob(y), rtol=0,
                                   atol=tol)


def test_heteroscedastic_equals_from_distribution_of_its_distribution():
    lik = ps.HeteroscedasticGaussian()
    wrapped = from_distribution(lambda f: dist.Normal(f[..., 0, :], f[..., 1, :].exp()), latent_dim=2)
    m, v = 0.5 * torch.randn(2, 30), 0.05 + 0.95 * torch.rand(2, 30)
    y = torch.randn(30)
    tol = 1e-9 if torch.get_default_dtype() == torch.float64 else 1e-4
    torch.testing.assert_close(wrapped.expected_log_prob(y, m, v), lik.expected_log_prob(y, m, v), rtol=0, atol=tol)
    # the predictives: the built-in integrates the mean latent exactly, the product rule integrates the density
    # N(y; g, e^h) over g, which is sharp where e^h << sd(g) (at the low nodes of h); where it is not, they agree
    m[1], v = 0.5 + 0.3 * torch.rand(30), 0.05 + 0.1 * torch.rand(2, 30)
    torch.testing.assert_close(wrapped.predictive(m, v).log_prob(y), lik.predictive(m, v).log_prob(y), rtol=0,
                               atol=1e-6 if torch.get_default_dtype() == torch.float64 else 1e-4)


# -- shapes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)], ids=str)
def test_shapes_of_several_latents(batch_shape):
    lik = from_distribution(lambda f: dist.Gamma(f[..., 1, :].exp(), (f[..., 1, :] - f[..., 0, :]).exp()),
                            latent_dim=2)
    n = 5
    f, var = torch.randn(batch_shape + (2, n)), 0.1 + torch.rand(batch_shape + (2, n))
    site = batch_shape + (1, n)
    assert lik.latent_dim == 2 and lik.support is dist.Gamma.support  # read from fn at f = 0
    assert lik.y_shape(f.shape) == site and lik.distribution(f).batch_shape == site
    y = 0.1 + torch.rand(batch_shape + (n,))
    e_flat = lik.expected_log_prob(y, f, var)
    assert e_flat.shape == site
    torch.testing.assert_close(e_flat, lik.expected_log_prob(y.unsqueeze(-2), f, var))
    assert lik.expected_log_prob(y[(0,) * len(batch_shape)], f, var).shape == site  # y [B]
    p = lik.predictive(f, var)
    assert isinstance(p, QuadratureMixture) and p.batch_shape == batch_shape + (n,)
    assert p.log_prob(y).shape == batch_shape + (n,) and p.sample((7,)).shape == (7,) + batch_shape + (n,)
    with pytest.raises(ValueError, match="K=2"):
        lik.expected_log_prob(y, torch.randn(3, n), torch.ones(3, n))


def test_quadrature_mixture_against_direct_sums_and_sampling():
    w = torch.tensor([0.2, 0.5, 0.3])
    comp = dist.Gamma(torch.tensor([[1.0, 2.0], [3.0, 0.5], [2.0, 2.0]]), torch.tensor([[1.0, 0.5], [2.0, 1.0],
                                                                                          [0.5, 3.0]]))
    mix = QuadratureMixture(comp, w)
    assert mix.batch_shape == (2,)
    y = torch.tensor([0.7, 1.9])
    direct = (w[:, None] * comp.log_prob(y).exp()).sum(0).log()
    torch.testing.assert_close(mix.log_prob(y), direct)
    torch.testing.assert_close(mix.log_prob(y.expand(4, 2)), direct.expand(4, 2))  # a sample dimension
    mean = (w[:, None] * comp.mean).sum(0)
    torch.testing.assert_close(mix.mean, mean)
    S = 200_000
    draws = mix.sample((S,))
    se = draws.std(0) / math.sqrt(S)
    assert ((draws.mean(0) - mean).abs() < 4 * se).all()
    torch.testing.assert_close(mix.variance, draws.var(0), rtol=0.03, atol=0)
    assert mix.expand((3, 2)).log_prob(y).shape == (3, 2)


# -- in a layer: a PyroModule's parameters train; bad input --------------------------------------------------------
class _ScaledStudentT(PyroModule):
    def __init__(self):
        super().__init__()
        self.scale = PyroParam(torch.tensor(0.5), constraints.positive)

    def forward(self, f):
        return dist.StudentT(4.0, f, self.scale)


def test_a_pyro_module_fn_trains_in_an_svgp():
    X = torch.linspace(-2, 2, 40).unsqueeze(-1)
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(40)
    gp = ps.SVGP(RBF(1), X[::8].clone(), from_distribution(_ScaledStudentT()))
    loss = Trace_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1).differentiable_loss(
        gp.model, gp.guide, X, y)
    loss.backward()
    assert gp.likelihood.fn.scale_unconstrained.grad.abs() > 0
    ps.infer.fit(gp, X, y, num_steps=60, lr=0.05, progress=False)
    assert gp.likelihood.fn.scale.item() < 0.3  # from 0.5 towards the noise level 0.1


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be a callable"):
        from_distribution(3.0)
    with pytest.raises(ValueError, match="latent_dim must be a positive integer"):
        from_distribution(lambda f: dist.Poisson(f.exp()), latent_dim=0)
    with pytest.raises(ValueError, match="rule must be"):
        from_distribution(lambda f: dist.Normal(f[..., 0, :], 1.0), latent_dim=2, rule="sparse")
    with pytest.raises(ValueError, match="rule must be 'auto' or 'gh'"):
        from_distribution(lambda f: dist.Normal(f, 1.0), rule="qmc")
    with pytest.raises(ValueError, match="num_samples"):
        from_distribution(lambda f: dist.Normal(f[..., 0, :], 1.0), latent_dim=2, num_samples=1)
    class Dependent(dist.Normal):
        support = constraints.dependent

    with pytest.raises(ValueError, match="pass support="):
        from_distribution(lambda f: Dependent(f, 1.0))
    with pytest.raises(TypeError, match="support must be"):
        from_distribution(lambda f: dist.Normal(f, 1.0), support="real")
    lik = from_distribution(lambda f: dist.Binomial(10, logits=f))  # the support read at f = 0: 0..10
    with pytest.raises(ValueError, match="outside the support"):
        lik.check_y(torch.tensor([3.0, 11.0]))
    wrong = from_distribution(lambda f: dist.Normal(f.sum(-1), 1.0), support=constraints.real)
    with pytest.raises(ValueError, match="batch shape"):
        wrong.expected_log_prob(torch.zeros(3), torch.zeros(3), torch.ones(3))
    wrong2 = from_distribution(lambda f: dist.Normal(f, 1.0), latent_dim=2, support=constraints.real)
    with pytest.raises(ValueError, match="batch shape"):
        wrong2.expected_log_prob(torch.zeros(3), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="num_outputs = 2"):
        ps.SVGP(RBF(1), torch.randn(3, 1), ps.HeteroscedasticGaussian(), num_outputs=3)
    pyro.clear_param_store()
