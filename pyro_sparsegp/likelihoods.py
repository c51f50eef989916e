r"""Likelihoods: the distribution of ``y`` given latent ``f``, the expected log-likelihood under
:math:`q(f_n) = N(\mu_n, \sigma^2_n)`, and the predictive distribution.

One generic method, closed forms as overrides: :meth:`Likelihood.expected_log_prob` integrates by Gauss-Hermite
quadrature with ``num_gh`` nodes (Hensman, Matthews, Ghahramani 2015, section 4); :class:`Gaussian` overrides it
analytically. ``Likelihood.quadrature_expected_log_prob`` is always the generic quadrature, so tests can compare an
override with it.

Binary labels are ``{0, 1}`` everywhere in the package.

Shapes: element-wise likelihoods take ``f`` ``[..., B]`` and give ``y`` ``[..., B]``.
"""

from __future__ import annotations

import math
import numbers
import weakref

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from . import deferred
from .composition import seed_context
from .linalg import gauss_hermite

__all__ = ["Likelihood", "Gaussian", "Bernoulli", "PolyaGammaLogit"]

_LIVE_GAUSSIAN = weakref.WeakSet()  # every Gaussian likelihood alive: NaturalGradient's noise step finds them here


def live_gaussian_likelihoods() -> list:
    """The :class:`Gaussian` likelihoods alive in this process (weak references), each with a scalar ``()`` noise:
    those whose noise :class:`~pyro_sparsegp.infer.NaturalGradient` may step (Hensman, Fusi, Lawrence 2013, eq. 4)."""
    return list(_LIVE_GAUSSIAN)


def _check_finite(name, t):
    if deferred.active() is not None:  # fit checked the data once (deferred.py)
        return
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")


class Likelihood(PyroModule):
    """Base class. Subclasses define :meth:`distribution` and ``support``; may override
    :meth:`expected_log_prob` and :meth:`predictive` with closed forms. Element-wise likelihoods take ``f`` and the
    marginals ``f_loc``, ``f_var`` of shape ``[..., B]`` and observations ``y`` ``[..., B]``. The expected
    log-likelihood is the data term of the bound of Hensman, Matthews, Ghahramani 2015, eq. 21, integrated by
    Gauss-Hermite quadrature (their section 4).

    :param int num_gh: number of Gauss-Hermite nodes of the generic expected log-likelihood.
    """

    support = constraints.real
    #: number of latent function values each observation depends on (``1``: element-wise)
    latent_dim = 1

    def __init__(self, num_gh: int = 20):
        super().__init__()
        if isinstance(num_gh, bool) or not isinstance(num_gh, numbers.Integral) or num_gh < 1:
            raise ValueError(f"num_gh (Gauss-Hermite nodes) must be a positive integer, got {num_gh!r}")
        self.num_gh = int(num_gh)

    def num_nodes(self, f_var: torch.Tensor) -> int:
        """Gauss-Hermite nodes for q(f) of variance ``f_var``: ``num_gh`` while every standard deviation is at most
        2, else ``num_gh * sd_max / 2`` (at most ``max(100, num_gh)``). Likelihoods with a kink on the scale of 1
        (``log sigmoid``, ``log Phi``) make the quadrature converge slowly in the width of q(f): measured for
        Bernoulli (worst over means within 3 sd), 20 nodes err by 1.4e-6 nats at sd 2, 6.7e-4 at sd 4, 2.5e-3 at
        sd 5, 1.8e-2 at sd 8; the rule keeps it to 3e-5 at sd 4, 1e-4 at sd 5, 3e-4 at sd 8, 1.4e-3 at sd 12
        (capped at 100 nodes, 1e-2 at sd 20). Inside :func:`~pyro_sparsegp.deferred.deferred_checks` (``fit`` on a
        GPU), where ``sd_max`` is not read back, the cap (never fewer nodes than the rule would take). ``f_var`` has
        any shape (``[..., B]``); returns an ``int``.
        Implements no paper equation: a numerical rule for the quadrature of Hensman et al. 2015, section 4."""
        if f_var.numel() == 0:
            return self.num_gh
        if deferred.active() is not None:
            return max(100, self.num_gh)
        sd = float(f_var.detach().max().clamp(min=0).sqrt())
        if not sd > 2.0:  # also NaN: the likelihood's own checks report it
            return self.num_gh
        return min(max(100, self.num_gh), max(self.num_gh, math.ceil(self.num_gh * min(sd, 1e6) / 2)))

    def _as_values(self, y, f):
        """Observations as floats of ``f``'s dtype (integer or boolean labels of a real-valued support)."""
        y = torch.as_tensor(y, device=f.device)
        return y if y.dtype == f.dtype else y.to(f.dtype)

    # -- the observation model ---------------------------------------------------------------------------------
    def distribution(self, f: torch.Tensor) -> dist.Distribution:
        """Distribution of ``y`` given ``f`` ``[..., B]``; batch shape ``[..., B]``. The factor
        :math:`p(y_n | f_n)` of the factorising likelihood (Hensman et al. 2015, section 4)."""
        raise NotImplementedError

    def y_shape(self, f_shape: torch.Size) -> torch.Size:
        """Batch shape of ``y`` for latent values of shape ``f_shape`` (``[..., B]`` gives ``[..., B]`` for
        element-wise likelihoods). Shape bookkeeping only: implements no paper equation."""
        return torch.Size(f_shape)

    def check_y(self, y: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``y`` (any shape, e.g. ``[..., B]``) is not finite or outside the support.
        An argument check: implements no paper equation (see the class docstring for the section it serves)."""
        _check_finite("y", y)
        if not bool(self.support.check(y).all()):
            raise ValueError(f"y has values outside the support of {type(self).__name__} ({self.support})")

    def forward(self, f: torch.Tensor, y: torch.Tensor | None = None, name: str = "y", prefix: str = "gp"):
        """Model side: register the observed site ``name`` with ``y ~ distribution(f)`` (call inside the data
        plate). ``prefix`` names any auxiliary site a likelihood adds (``<prefix>.omega``)."""
        if y is not None:
            if deferred.active() is None:  # else fit checked y once (deferred.py)
                self.check_y(y)
            y = self._as_values(y, f)
        seed_context(self)
        return pyro.sample(name, self.distribution(f), obs=y)

    def guide(self, qf, prefix: str = "gp") -> None:
        """Guide side, inside the data plate: sample the variational distributions of auxiliary sites, if any.
        ``qf()`` returns the marginals ``(f_loc, f_var)``, each ``[..., B]``, of q(f) on the minibatch (Hensman et
        al. 2015, eq. 19). The default has none."""

    # -- expectations under q(f) -----------------------------------------------------------------------------
    def quadrature_expected_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        r""":math:`\int N(f; \mu, \sigma^2) \log p(y|f) df \approx \sum_i w_i \log p(y | \mu + \sigma x_i)`
        with :meth:`num_nodes` nodes (Hensman, Matthews, Ghahramani 2015, section 4: the one-dimensional integrals
        of the expected log-likelihood in eq. 21). ``y``, ``f_loc``, ``f_var`` broadcast to ``[..., B]``; returns
        ``[..., B]``."""
        x, w = gauss_hermite(self.num_nodes(f_var), f_loc.dtype, f_loc.device)
        f = f_loc.unsqueeze(-1) + f_var.sqrt().unsqueeze(-1) * x  # [..., B, n]
        logp = self.distribution(f).log_prob(self._as_values(y, f_loc).unsqueeze(-1))
        return (logp * w).sum(-1)

    def expected_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        """:math:`E_{N(f; f_{loc}, f_{var})}[\\log p(y|f)]`, shape ``y_shape(f_loc.shape)``: the per-point
        expected log-likelihood of Hensman, Matthews, Ghahramani 2015, eq. 21 (by quadrature, section 4)."""
        return self.quadrature_expected_log_prob(y, f_loc, f_var)

    def predictive(self, f_loc, f_var) -> dist.Distribution:
        """Predictive distribution of ``y*`` given ``q(f*) = N(f_loc, f_var)``, ``f_loc``, ``f_var`` ``[..., B]``;
        batch shape ``[..., B]``. :math:`p(y_*) = \\int p(y_*|f_*) q(f_*) df_*` with :math:`q(f_*)` the marginal
        of Hensman et al. 2015, eqs. 18-19."""
        raise NotImplementedError

    def predictive_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        """:math:`\\log \\int p(y|f) N(f; f_{loc}, f_{var}) df` (test log-likelihood), with :math:`q(f)` the
        marginal of Hensman et al. 2015, eq. 19; ``y``, ``f_loc``, ``f_var`` ``[..., B]``, returns ``[..., B]``."""
        return self.predictive(f_loc, f_var).log_prob(y)


class Gaussian(Likelihood):
    r""":math:`y = f + \epsilon`, :math:`\epsilon \sim N(0, \sigma^2)` with learnable ``noise`` :math:`\sigma^2`.

    Expected log-likelihood (Hensman, Fusi, Lawrence 2013, eq. 4):
    :math:`\log N(y; \mu, \sigma^2) - v / (2\sigma^2)`. ``f``, ``y`` and the marginals ``[..., B]``; ``noise``
    is a scalar ``()``. The predictive is :math:`N(y_*; \mu, v + \sigma^2)` with batch shape ``[..., B]``.
    """

    def __init__(self, noise: float | torch.Tensor = 1.0, num_gh: int = 20):
        super().__init__(num_gh)
        n = torch.as_tensor(noise, dtype=torch.get_default_dtype()).detach()
        if n.numel() != 1 or not bool(torch.isfinite(n).all()) or not bool((n > 0).all()):
            raise ValueError(
                f"noise is the variance of the Gaussian noise and must be one finite positive number, got {noise!r}; "
                "e.g. Gaussian(noise=0.1)"
            )
        self.noise = PyroParam(torch.as_tensor(noise, dtype=torch.get_default_dtype()), constraints.positive)
        _LIVE_GAUSSIAN.add(self)

    def __setstate__(self, state):
        """Unpickling and ``copy.deepcopy`` (which bypass ``__init__``) register the copy too (noise ``()``)."""
        super().__setstate__(state)
        _LIVE_GAUSSIAN.add(self)

    def distribution(self, f):
        return dist.Normal(f, self.noise.sqrt())

    def expected_log_prob(self, y, f_loc, f_var):
        noise = self.noise
        return dist.Normal(f_loc, noise.sqrt()).log_prob(self._as_values(y, f_loc)) - 0.5 * f_var / noise

    def predictive(self, f_loc, f_var):
        return dist.Normal(f_loc, (f_var + self.noise).sqrt())


class Bernoulli(Likelihood):
    r"""Binary labels ``y`` in ``{0, 1}`` with :math:`p(y=1|f) = \Phi(f)` (``link="probit"``) or
    :math:`\sigma(f)` (``link="logit"``). Expected log-likelihood by Gauss-Hermite (Hensman 2015, section 4);
    the probit predictive is closed form, :math:`\Phi(\mu / \sqrt{1 + v})`; the logit predictive is by
    Gauss-Hermite. ``f``, ``y`` and the marginals ``[..., B]``; distributions have batch shape ``[..., B]``.
    """

    support = constraints.boolean

    def __init__(self, link: str = "probit", num_gh: int = 20):
        super().__init__(num_gh)
        if link not in ("probit", "logit"):
            raise ValueError(f"link must be 'probit' or 'logit', got {link!r}")
        self.link = link

    def distribution(self, f):
        if self.link == "logit":
            return dist.Bernoulli(logits=f)
        # log Phi computed stably; Bernoulli(logits=log Phi(f) - log Phi(-f))
        return dist.Bernoulli(logits=_log_ndtr(f) - _log_ndtr(-f))

    def predictive(self, f_loc, f_var):
        if self.link == "probit":
            z = f_loc / (1 + f_var).sqrt()
            return dist.Bernoulli(logits=_log_ndtr(z) - _log_ndtr(-z))
        x, w = gauss_hermite(self.num_nodes(f_var), f_loc.dtype, f_loc.device)
        p = (torch.sigmoid(f_loc.unsqueeze(-1) + f_var.sqrt().unsqueeze(-1) * x) * w).sum(-1)
        return dist.Bernoulli(probs=p.clamp(1e-12, 1 - 1e-12))


def _log_ndtr(x):
    return torch.special.log_ndtr(x)


class PolyaGammaLogit(Bernoulli):
    r"""Logistic likelihood with Pólya-Gamma augmentation (Wenzel et al. 2019; Polson, Scott, Windle 2013).

    Model: :math:`\omega_n \sim \mathrm{PG}(1, 0)` at site ``<prefix>.omega`` and ``y`` observed from
    :class:`~pyro_sparsegp.distributions.PolyaGammaAugmentedBernoulli`; guide: :math:`\omega_n \sim
    \mathrm{PG}(1, c_n)` with the optimal local parameter :math:`c_n = \sqrt{\mathbb{E}_q f_n^2}` (treated as a
    constant: at the optimum its gradient vanishes). ``Trace_ELBO`` then estimates the augmented bound
    :func:`pyro_sparsegp.bounds.polya_gamma.pg_bound`; ``TraceMeanField_ELBO`` evaluates its KLs in closed form.
    ``distribution``, ``expected_log_prob`` and ``predictive`` are those of the plain logit likelihood.
    ``f``, ``y``, ``omega`` and the marginals of q(f) are ``[..., B]``.
    """

    def __init__(self, num_gh: int = 20):
        super().__init__("logit", num_gh)

    def forward(self, f, y=None, name="y", prefix="gp"):
        from .distributions import PolyaGamma, PolyaGammaAugmentedBernoulli

        if y is not None:
            if deferred.active() is None:  # else fit checked y once (deferred.py)
                self.check_y(y)
            y = self._as_values(y, f)
        seed_context(self)
        omega = pyro.sample(f"{prefix}.omega", PolyaGamma(torch.ones_like(f), torch.zeros_like(f)))
        return pyro.sample(name, PolyaGammaAugmentedBernoulli(f, omega), obs=y)

    def expected_log_prob(self, y, f_loc, f_var):
        """The augmented bound's per-point term at the optimal ``c = sqrt(E f^2)`` (closed form, equal to the
        Jaakkola-Jordan bound): a lower bound of the logit expected log-likelihood, which is what the paper
        maximises. The exact logit expectation is :meth:`quadrature_expected_log_prob`. ``y``, ``f_loc``,
        ``f_var`` ``[..., B]``; returns ``[..., B]``."""
        from .bounds.polya_gamma import jaakkola_jordan_bound, optimal_c

        return jaakkola_jordan_bound(self._as_values(y, f_loc), f_loc, f_var, optimal_c(f_loc, f_var))

    def guide(self, qf, prefix="gp"):
        """Sample :math:`\\omega_n \\sim \\mathrm{PG}(1, c_n)` at ``<prefix>.omega``, shape ``[..., B]``, with
        the optimal :math:`c_n = \\sqrt{\\mathbb{E}_q f_n^2}` from ``qf()``'s marginals ``[..., B]`` (Wenzel et
        al. 2019, optimal local parameter of the augmented bound)."""
        from .bounds.polya_gamma import optimal_c
        from .distributions import PolyaGamma

        with torch.no_grad():
            loc, var = qf()
            c = optimal_c(loc, var)
        pyro.sample(f"{prefix}.omega", PolyaGamma(torch.ones_like(c), c))
