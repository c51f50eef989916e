r"""Any Pyro distribution as a likelihood, in one line: :func:`from_distribution`.

``from_distribution(fn, latent_dim=Q, support=...)`` wraps ``fn(f)``, a function (or a ``PyroModule`` with
``forward(f)``, whose ``PyroParam`` s then train with the layer) that returns the distribution of ``y`` given the
latent values ``f``: ``f [..., B]`` for ``Q = 1``, ``f [..., Q, B]`` for ``Q > 1`` (read the latents as
``f[..., q, :]``), batch shape ``[..., B]``, no event dimensions. Its expected log-likelihood (the data term of
Hensman, Matthews, Ghahramani 2015, eq. 21) and predictive distribution are integrated against
:math:`q(f) = \prod_q N(m_q, v_q)`:

* ``Q = 1``: one-dimensional Gauss-Hermite quadrature with :meth:`~.Likelihood.num_nodes` nodes (their section 4),
  as for any :class:`~.Likelihood` subclass;
* ``Q > 1``: the rule of :func:`~.multilatent.gaussian_rule`: by default the product Gauss-Hermite rule for
  ``Q <= 6`` (20, 20, 10, 7, 5, 4 nodes per latent for ``Q`` = 1 to 6: at most 4096 points) and 4096 moment-matched
  antithetic scrambled Sobol' points (``"qmc"``) beyond; ``rule="mc"`` draws fresh points (unbiased). The observed
  site and ``expected_log_prob`` are ``[..., 1, B]`` and the predictive ``[..., B]`` (:mod:`.multilatent`): the
  wrapper calls ``fn`` at ``f[..., None, :, :]``, so ``fn``'s ``[..., B]`` becomes the site's ``[..., 1, B]``.

**Errors of the defaults**, measured by ``tests/likelihoods/test_from_distribution.py`` (worst over 100 points
and 5 draws of the problem, latent means :math:`0.5\,N(0, 1)`, every latent of standard deviation ``sd``):

* a Poisson with log rate :math:`a^\top f`, :math:`\|a\| = 1`, against its closed form: ``Q <= 4`` below ``3e-7``
  nats at sd 1 (``1e-11`` at sd 0.5); ``Q`` = 5, 6 below ``1e-3`` at sd 1 (``2e-6`` at sd 0.5); ``Q >= 7`` (the
  Sobol' rule) below ``5e-2`` at sd 1 (``3e-3`` at sd 0.5). The heavy right tail of :math:`e^{a^\top f}` is
  what a fixed rule integrates worst;
* a Gaussian log-likelihood of a linear combination of the latents: exact to rounding for every ``Q`` (each rule
  integrates polynomials of degree 2 exactly);
* ``Q = 2``: a heteroscedastic Gaussian (mean and log-scale latents) and a Gamma with latent log-mean and
  log-shape, against an 80-node-per-latent product rule: below ``1e-9`` at sd 1; a Student-t with latent
  location and log-scale is the hard case (sharp where :math:`e^h` is small): ``5e-3`` at sd 0.5; at sd 1
  the 20- and 60-node rules differ by ``5e-2``.

Wider :math:`q(f)` and sharper likelihoods need more points: raise ``num_gh`` (or ``num_samples``). The predictive
distribution integrates the *density* :math:`p(y \mid f)` by the same rule, which converges more slowly than the
log-density where the likelihood is narrow compared with :math:`q(f)` (e.g. a noise scale well below the sd of the
mean latent): a built-in that integrates such a latent in closed form (:class:`~.HeteroscedasticGaussian`, the mean)
is then more accurate.
"""

from __future__ import annotations

import numbers

import pyro
import torch
from torch.distributions import constraints

from .base import Likelihood
from .multilatent import _MultiLatent

__all__ = ["from_distribution"]


def _support_of(fn, latent_dim):
    f = torch.zeros((latent_dim, 1) if latent_dim > 1 else (1,))
    with torch.no_grad(), pyro.validation_enabled(False):
        support = fn(f).support
    if constraints.is_dependent(support):
        raise ValueError("the support of fn(f)'s distribution depends on its parameters; pass support= (a "
                         "torch.distributions.constraints object, used to check y), e.g. "
                         "support=constraints.nonnegative_integer")
    return support


class _FromDistribution(Likelihood):
    """``Q = 1``: the generic Gauss-Hermite quadrature of :class:`~.Likelihood` over ``fn(f)``, ``f [..., B]``."""

    def __init__(self, fn, support, num_gh):
        super().__init__(num_gh)
        self.fn = fn
        self.support = support

    def distribution(self, f):
        d = self.fn(f)
        if d.batch_shape != f.shape or d.event_shape != torch.Size():
            raise ValueError(f"fn(f) must return a distribution of batch shape [..., B] = {tuple(f.shape)} (that of "
                             f"f) and no event dimensions; got batch {tuple(d.batch_shape)}, event "
                             f"{tuple(d.event_shape)}")
        return d


class _FromDistributionQ(_MultiLatent):
    """``Q > 1``: the rule of :func:`~.multilatent.gaussian_rule` over ``fn(f)``, ``f [..., Q, B]``."""

    def __init__(self, fn, latent_dim, support, num_gh, rule, num_samples):
        super().__init__(latent_dim, num_gh, rule, num_samples)
        self.fn = fn
        self.support = support

    def _flat_distribution(self, f):
        return self.fn(f)


def from_distribution(fn, latent_dim: int = 1, support=None, *, num_gh: int | None = None, rule: str = "auto",
                      num_samples: int | None = None) -> Likelihood:
    r"""A :class:`~.Likelihood` from ``fn(f)``, the Pyro distribution of ``y`` given the latent values (module
    docstring): ``f [..., B]`` for ``latent_dim = 1``, ``[..., Q, B]`` for ``latent_dim = Q > 1``, batch ``[..., B]``.

    :param fn: a callable, or a ``PyroModule`` whose ``forward(f)`` returns the distribution (its parameters train).
    :param int latent_dim: ``Q``, the latent functions per observation (a layer infers ``num_outputs = Q``).
    :param support: a ``torch.distributions.constraints`` object that ``y`` must satisfy; default: the support of
        ``fn`` at ``f = 0`` (give it when that depends on the parameters).
    :param int num_gh: Gauss-Hermite nodes (per latent for ``Q > 1``); default 20 for ``Q <= 2``, then 10, 7, 5, 4
        for ``Q`` = 3 to 6.
    :param str rule: ``Q > 1``: ``"auto"``, ``"gh"``, ``"qmc"`` or ``"mc"`` (:mod:`.multilatent`).
    :param int num_samples: points of the ``"qmc"`` rule (default 4096) or draws of ``"mc"`` (default 256).

    The expected log-likelihood is the data term of Hensman, Matthews, Ghahramani 2015, eq. 21, integrated as in
    their section 4 (module docstring for the rules and their measured errors).
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable f -> distribution of y, got {type(fn).__name__}")
    if isinstance(latent_dim, bool) or not isinstance(latent_dim, numbers.Integral) or latent_dim < 1:
        raise ValueError(f"latent_dim must be a positive integer (latent functions per observation), got "
                         f"{latent_dim!r}")
    if support is None:
        support = _support_of(fn, int(latent_dim))
    elif not isinstance(support, constraints.Constraint):
        raise TypeError(f"support must be a torch.distributions.constraints object (e.g. constraints.positive), got "
                        f"{type(support).__name__}")
    if latent_dim == 1:
        if rule not in ("auto", "gh"):
            raise ValueError(f"latent_dim=1 integrates by Gauss-Hermite quadrature: rule must be 'auto' or 'gh', got "
                             f"{rule!r}")
        return _FromDistribution(fn, support, 20 if num_gh is None else num_gh)
    return _FromDistributionQ(fn, int(latent_dim), support, num_gh, rule, num_samples)
