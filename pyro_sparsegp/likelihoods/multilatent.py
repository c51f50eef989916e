r"""Likelihoods of several latent functions per observation, and the Gaussian rules that integrate them.

A likelihood with ``latent_dim = Q > 1`` reads ``Q`` latent values per observation: the outputs of a multi-output
layer, ``f [..., Q, B]`` (outputs at dim -2, the data at dim -1). Its observed site keeps the latents' dimension as
a singleton, ``[..., 1, B]``, so that particle and plate dimensions line up (:mod:`.multiclass` explains why); its
predictive distribution drops it, ``[..., B]``. ``y`` may be given as ``[B]``, ``[..., 1, B]`` or ``[..., B]``.

Under independent GPs (or independent outputs of one layer), :math:`q(f_n)` factorises over the ``Q`` latents:
:math:`\prod_q N(f_{qn}; m_{qn}, v_{qn})`, and the expected log-likelihood of Hensman, Matthews, Ghahramani 2015,
eq. 21 is a ``Q``-dimensional Gaussian integral per observation. :func:`gaussian_rule` gives the rules:

* ``"gh"``: the product Gauss-Hermite rule, ``num_gh`` nodes per latent (``num_gh ** Q`` points, the tensor
  product of the one-dimensional rule of their section 4); exact for polynomials of degree ``2 num_gh - 1`` in each
  latent; the default for ``Q <= 6``, with 20, 20, 10, 7, 5, 4 nodes per latent for ``Q`` = 1 to 6;
* ``"qmc"``: a fixed quasi-Monte-Carlo rule: ``num_samples / 2`` scrambled Sobol' points (seed 0) mapped through
  the normal quantile and whitened by their own second moment, and their negatives (so every first and second
  moment is exact); weights ``1 / n``; the default for ``Q >= 7``, with 4096 points. Deterministic, hence
  biased, by an amount the tests measure (:mod:`.generic` lists it);
* ``"mc"``: ``num_samples`` fresh standard normal draws per evaluation, independent for every observation
  (torch's global generator, default 256), as :class:`~.multiclass.Softmax` draws: unbiased for the expected
  log-likelihood (so the bound is estimated without bias) and differentiable; the predictive uses ``"qmc"``
  instead, so that it is a fixed distribution.

:class:`QuadratureMixture` is the predictive distribution these rules give:
:math:`p(y_*) \approx \sum_i w_i\, p(y_* \mid f_i)`.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
from pyro.distributions.torch_distribution import TorchDistribution

from ..linalg import gauss_hermite
from .base import Likelihood

__all__ = ["gaussian_rule", "QuadratureMixture"]

_RULES = ("auto", "gh", "qmc", "mc")
_VAR_FLOOR = 1e-20  # variances below are raised to it (a standard deviation of 1e-10): finite gradients


_GH_PER_LATENT = {1: 20, 2: 20, 3: 10, 4: 7, 5: 5, 6: 4}  # "gh" nodes per latent; Q beyond: "qmc"


def _default_num_gh(Q: int) -> int:
    return _GH_PER_LATENT.get(Q, 3)


def gaussian_rule(dim: int, rule: str = "auto", num_gh: int | None = None, num_samples: int | None = None,
                  dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Points and weights for :math:`\mathbb{E}_{z \sim N(0, I_Q)}[g(z)] \approx \sum_i w_i\, g(x_i)`, ``Q = dim``:
    the product Gauss-Hermite rule (``"gh"``, ``num_gh`` nodes per dimension, default 20, 20, 10, 7, 5, 4 for ``Q``
    = 1 to 6, 3 beyond), the moment-matched antithetic scrambled Sobol' rule (``"qmc"``, ``num_samples`` points,
    default 4096) or fresh normal draws (``"mc"``, default 256); ``"auto"`` is ``"gh"`` for ``Q <= 6``, else
    ``"qmc"`` (module docstring). The
    multi-dimensional version of the quadrature of Hensman, Matthews, Ghahramani 2015, section 4.

    :returns: ``(x [n, Q], w [n])``; the weights sum to one.
    """
    Q = int(dim)
    rule = ("gh" if Q in _GH_PER_LATENT else "qmc") if rule == "auto" else rule
    dtype = dtype or torch.get_default_dtype()
    if rule == "gh":
        x1, w1 = gauss_hermite(num_gh or _default_num_gh(Q), dtype, device)
        grids = torch.meshgrid(*([x1] * Q), indexing="ij")
        x = torch.stack([g.reshape(-1) for g in grids], -1)  # [n^Q, Q]
        w = math.prod(g.reshape(-1) for g in torch.meshgrid(*([w1] * Q), indexing="ij"))  # [n^Q]
        return x, w
    n = num_samples or (4096 if rule == "qmc" else 256)
    if rule == "mc":
        return torch.randn(n, Q, dtype=dtype, device=device), torch.full((n,), 1.0 / n, dtype=dtype, device=device)
    x = _sobol_normal(Q, (n + 1) // 2).to(dtype=dtype, device=device)
    return x, torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def _sobol_normal(Q: int, half: int) -> torch.Tensor:
    """``half`` scrambled Sobol' points (seed 0) through the normal quantile, and their negatives: ``[2 half, Q]``,
    float64 on the CPU (cached; callers copy)."""
    u = torch.quasirandom.SobolEngine(Q, scramble=True, seed=0).draw(half, dtype=torch.float64)
    z = torch.special.ndtri(u.clamp(1e-12, 1 - 1e-12))  # [half, Q]
    # moment matching: the antithetic pairs make every odd moment exact; whitening by the points' own second
    # moment makes the second moments exact too (the rule integrates a Gaussian log-likelihood exactly)
    L = torch.linalg.cholesky(z.mT @ z / half)  # [Q, Q]
    z = torch.linalg.solve_triangular(L, z.mT, upper=False).mT
    return torch.cat([z, -z])


class QuadratureMixture(TorchDistribution):
    r"""The mixture :math:`p(y) = \sum_i w_i\, p_i(y)` of a distribution's components along its leftmost batch
    dimension: the predictive distribution :math:`\int p(y_* \mid f) q(f) df` by a quadrature rule with points
    :math:`f_i` and weights :math:`w_i` (Hensman, Matthews, Ghahramani 2015, section 4; ``component`` is
    :math:`p(y \mid f_i)`).

    :param component: a distribution of batch shape ``[n, ...]`` (the rule's ``n`` points first).
    :param torch.Tensor weights: ``[n]``, non-negative, summing to one.

    Batch shape ``[...]`` (the component's without ``n``); ``log_prob`` (a log-sum-exp over the points), ``mean``,
    ``variance`` (the law of total variance) and ``sample`` (a point drawn by its weight, then ``y``) are exact for
    the mixture.
    """

    arg_constraints = {}

    def __init__(self, component, weights: torch.Tensor, validate_args=None):
        if component.batch_shape[:1] != weights.shape:
            raise ValueError(f"component batch shape {tuple(component.batch_shape)} must start with the "
                             f"{weights.shape[0]} points of the weights")
        self.component, self.weights = component, weights
        super().__init__(component.batch_shape[1:], component.event_shape, validate_args=False)

    @property
    def support(self):
        return self.component.support

    def _w(self, extra: int = 0):
        return self.weights.reshape((-1,) + (1,) * (len(self.batch_shape) + len(self.event_shape) + extra))

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(QuadratureMixture, _instance)
        new.component = self.component.expand(self.weights.shape + torch.Size(batch_shape))
        new.weights = self.weights
        super(QuadratureMixture, new).__init__(torch.Size(batch_shape), self.event_shape, validate_args=False)
        return new

    def log_prob(self, value):
        value = torch.as_tensor(value, dtype=self.weights.dtype, device=self.weights.device)
        shape = torch.broadcast_shapes(value.shape, self.batch_shape + self.event_shape)
        value = value.expand(shape)
        k = len(self.batch_shape) + len(self.event_shape)
        lp = self.component.log_prob(value.unsqueeze(-k - 1))  # [..., n, *batch]
        logw = self.weights.log().reshape((-1,) + (1,) * len(self.batch_shape))
        return torch.logsumexp(lp + logw, dim=-len(self.batch_shape) - 1)

    @property
    def mean(self):
        return (self._w() * self.component.mean).sum(0)

    @property
    def variance(self):
        m = self.component.mean
        second = (self._w() * (self.component.variance + m.pow(2))).sum(0)
        return second - self.mean.pow(2)

    def sample(self, sample_shape=torch.Size()):
        with torch.no_grad():
            sample_shape = torch.Size(sample_shape)
            draws = self.component.sample(sample_shape)  # [*S, n, *batch, *event]
            idx = torch.multinomial(self.weights, math.prod(sample_shape + self.batch_shape), replacement=True)
            idx = idx.reshape(sample_shape + (1,) + self.batch_shape + (1,) * len(self.event_shape))
            idx = idx.expand(sample_shape + (1,) + self.batch_shape + self.event_shape)
            return draws.gather(len(sample_shape), idx).squeeze(len(sample_shape))


class _MultiLatent(Likelihood):
    """Shared parts of the likelihoods of ``Q = latent_dim > 1`` latent functions (module docstring): shapes, the
    site-shaped ``y``, and the generic expected log-likelihood and predictive by the rule of :func:`gaussian_rule`.
    Subclasses define :meth:`_flat_distribution` (the distribution of ``y`` given ``f [..., Q, B]``, batch
    ``[..., B]``), or override :meth:`distribution` and the expectations (multi-class)."""

    def __init__(self, latent_dim: int, num_gh: int | None = None, rule: str = "auto", num_samples: int | None = None):
        if isinstance(latent_dim, bool) or not isinstance(latent_dim, numbers.Integral) or latent_dim < 2:
            raise ValueError(f"latent_dim must be an integer of at least 2 here, got {latent_dim!r}")
        super().__init__(_default_num_gh(int(latent_dim)) if num_gh is None else num_gh)
        if rule not in _RULES:
            raise ValueError(f"rule must be one of {_RULES}, got {rule!r}")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral)
                                        or num_samples < 2):
            raise ValueError(f"num_samples (points of the 'qmc' or 'mc' rule) must be an integer >= 2, got "
                             f"{num_samples!r}")
        self.latent_dim = int(latent_dim)
        self.rule, self.num_samples = rule, num_samples

    def y_shape(self, f_shape):
        """``[..., 1, B]`` for ``f`` ``[..., Q, B]`` (the latents' dimension kept as a singleton, module docstring)."""
        f_shape = torch.Size(f_shape)
        return f_shape[:-2] + (1,) + f_shape[-1:]

    def _check_f(self, f):
        if f.dim() < 2 or f.shape[-2] != self.latent_dim:
            raise ValueError(f"latent values must be [..., K={self.latent_dim}, B] (the {type(self).__name__}'s "
                             f"{self.latent_dim} latent functions at dim -2), got {tuple(f.shape)}")

    def _site_shaped(self, y, f_loc):
        """``y`` broadcastable to the site shape ``[..., 1, B]`` (``[..., B]`` gets its singleton)."""
        y = torch.as_tensor(y, device=f_loc.device)
        if y.dim() >= 2 and y.shape == f_loc.shape[:-2] + f_loc.shape[-1:]:
            y = y.unsqueeze(-2)
        return y

    def _flat_distribution(self, f):
        raise NotImplementedError(f"{type(self).__name__} must define _flat_distribution(f) or distribution(f)")

    def distribution(self, f):
        """The distribution of ``y`` given ``f`` ``[..., Q, B]``, batch shape ``[..., 1, B]`` (module docstring)."""
        self._check_f(f)
        d = self._flat_distribution(f.unsqueeze(-3))
        if d.batch_shape != self.y_shape(f.shape) or d.event_shape != torch.Size():
            raise ValueError(f"the distribution of y given f [..., {self.latent_dim}, B] must have batch shape "
                             f"[..., B] and no event dimensions; got batch {tuple(d.batch_shape)} and event "
                             f"{tuple(d.event_shape)} for f[..., None, :, :] of shape {tuple(f.unsqueeze(-3).shape)}")
        return d

    def _points(self, f_loc, f_var, rule=None):
        """The rule's latent values ``[n, ..., Q, B]`` at ``q(f) = N(f_loc, f_var)`` and its weights ``[n]``."""
        self._check_f(f_loc)
        f_loc, f_var = torch.broadcast_tensors(f_loc, f_var)
        rule = rule or self.rule
        if rule == "mc":  # independent draws for every observation and batch element: [n, ..., Q, B]
            n = self.num_samples or 256
            x = torch.randn((n,) + f_loc.shape, dtype=f_loc.dtype, device=f_loc.device)
            w = torch.full((n,), 1.0 / n, dtype=f_loc.dtype, device=f_loc.device)
        else:
            x, w = gaussian_rule(self.latent_dim, rule, self.num_gh, self.num_samples, f_loc.dtype, f_loc.device)
            x = x.reshape((x.shape[0],) + (1,) * (f_loc.dim() - 2) + (self.latent_dim, 1))
        return f_loc + f_var.clamp(min=_VAR_FLOOR).sqrt() * x, w

    def quadrature_expected_log_prob(self, y, f_loc, f_var):
        r""":math:`\mathbb{E}_{q(f)} \log p(y \mid f) \approx \sum_i w_i \log p(y \mid f_i)` by the likelihood's
        rule (module docstring; the data term of Hensman, Matthews, Ghahramani 2015, eq. 21, integrated as in their
        section 4, over ``Q`` latents). ``f_loc``, ``f_var`` ``[..., Q, B]``; ``y`` ``[B]``, ``[..., 1, B]`` or
        ``[..., B]``; returns ``[..., 1, B]``."""
        f, w = self._points(f_loc, f_var)
        lp = self.distribution(f).log_prob(self._as_values(self._site_shaped(y, f_loc), f_loc))  # [n, ..., 1, B]
        return torch.tensordot(w, lp, dims=1)

    def predictive(self, f_loc, f_var):
        r""":class:`QuadratureMixture` of the distributions of ``y`` at the rule's points (``"qmc"`` for the
        ``"mc"`` rule), batch ``[..., B]``: :math:`p(y_*) \approx \sum_i w_i p(y_* \mid f_i)`, ``f_loc``, ``f_var``
        ``[..., Q, B]`` (Hensman, Matthews, Ghahramani 2015, section 4)."""
        f, w = self._points(f_loc, f_var, "qmc" if self.rule == "mc" else None)
        return QuadratureMixture(self._flat_distribution(f), w)
