r"""Likelihoods of continuous responses: robust regression (Student-t), positive responses (Gamma) and responses in
the unit interval (Beta). ``f``, ``y`` and the marginals of ``q(f)`` are ``[..., B]``; each learnable parameter is
a scalar ``()`` ``PyroParam`` with its constraint (so a ``PyroSample`` hyperprior may replace it).

The expected log-likelihood is the data term of Hensman, Matthews, Ghahramani 2015, eq. 21 under
:math:`q(f) = N(m, v)`: closed form for the Gamma (through :math:`\mathbb{E}_q e^{-f} = e^{-m + v/2}`), Gauss-Hermite
quadrature (their section 4) for the others. Predictive distributions are the Gauss-Hermite mixtures of
:meth:`~.Likelihood.predictive`.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam
from torch.distributions import constraints

from ..context import deferred
from .base import Likelihood, _check_finite, _init_param

__all__ = ["StudentT", "Gamma", "Beta"]


class StudentT(Likelihood):
    r"""Robust regression: :math:`y = f + \sigma \epsilon`, :math:`\epsilon` Student-t with :math:`\nu` degrees of
    freedom,

    .. math:: p(y \mid f) = \frac{\Gamma(\frac{\nu + 1}{2})}{\Gamma(\frac{\nu}{2}) \sqrt{\pi\nu}\, \sigma}
              \Big(1 + \frac{(y - f)^2}{\nu \sigma^2}\Big)^{-\frac{\nu + 1}{2}}

    (identity link; Jylänki, Vanhatalo, Vehtari 2011, "Robust Gaussian process regression with a Student-t
    likelihood"), with learnable ``scale`` :math:`\sigma > 0` and ``df`` :math:`\nu > 0` (``PyroParam`` s,
    positive). Expected log-likelihood by Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani 2015, section 4)
    with :meth:`num_nodes` nodes; predictive: the Gauss-Hermite mixture of Student-t's (its mean is ``NaN`` for
    :math:`\nu \le 1`, where the mean does not exist). ``f``, ``y``, marginals ``[..., B]``; parameters ``()``.

    :param float scale: initial :math:`\sigma`.
    :param float df: initial :math:`\nu` (3: heavy tails with a finite variance).
    :param int num_gh: Gauss-Hermite nodes while :math:`\sqrt{v} \le \sigma` (see :meth:`num_nodes`).
    """

    def __init__(self, scale: float = 1.0, df: float = 3.0, num_gh: int = 20):
        super().__init__(num_gh)
        self.scale = PyroParam(_init_param(scale, "scale", example="StudentT(scale=0.5)"), constraints.positive)
        self.df = PyroParam(_init_param(df, "df", example="StudentT(df=4.0)"), constraints.positive)

    def distribution(self, f):
        return dist.StudentT(self.df, f, self.scale)

    def num_nodes(self, f_var: torch.Tensor) -> int:
        r"""Gauss-Hermite nodes for ``q(f)`` of variance ``f_var`` (any shape, e.g. ``[..., B]``; returns an ``int``):
        ``num_gh * r`` for :math:`r = \sqrt{v_{max}} / \sigma > 1`, at most ``max(100, num_gh)``. The log-density
        has complex singularities at :math:`f = y \pm i\sigma\sqrt{\nu}`, so the quadrature converges slowly once
        ``q(f)`` is wider than :math:`\sigma`. Measured (worst over ``y - m`` in ``{0, 0.5, 1.5, 3}`` sd, against
        scipy's adaptive quadrature), :math:`\nu = 3`: :math:`r \le 1` below ``1e-6`` nats, ``r = 2``
        ``2e-5``, ``r = 4`` ``3e-4``, ``r = 8`` ``7e-3`` (the cap); :math:`\nu = 1` (Cauchy): ``1e-4``, ``8e-4``,
        ``3e-3``, ``2e-2``. A numerical rule for the quadrature of Hensman et al. 2015, section 4."""
        if f_var.numel() == 0:
            return self.num_gh
        cap = max(100, self.num_gh)
        if deferred.skip_reads():
            return cap
        scale = self.__dict__.get("_pyro_samples", {}).get("scale")
        if scale is not None and not isinstance(scale, torch.Tensor):  # a hyperprior: no fixed scale to read
            return super().num_nodes(f_var)
        r = float(f_var.detach().max().clamp(min=0).sqrt() / self.scale.detach())
        if not r > 1.0:  # also NaN: the likelihood's own checks report it
            return self.num_gh
        return min(cap, math.ceil(self.num_gh * min(r, 1e6)))


class Gamma(Likelihood):
    r"""Positive responses :math:`y > 0` from a Gamma of mean :math:`\mu = e^f` (log link) and learnable ``shape``
    :math:`k > 0` (a ``PyroParam``, positive): rate :math:`k / \mu`, variance :math:`\mu^2 / k` (the Gamma
    generalised linear model, McCullagh and Nelder 1989, chapter 8),

    .. math:: \log p(y \mid f) = k \log k - \log\Gamma(k) + (k - 1) \log y - k f - k\, y\, e^{-f}.

    Expected log-likelihood, closed form through :math:`\mathbb{E}_q e^{-f} = e^{-m + v/2}` (the data term of
    Hensman, Matthews, Ghahramani 2015, eq. 21):

    .. math:: k \log k - \log\Gamma(k) + (k - 1)\log y - k m - k\, y\, e^{-m + v/2}.

    Predictive: the Gauss-Hermite mixture of Gammas (mean :math:`\approx e^{m + v/2}`). ``f``, ``y``, marginals
    ``[..., B]``; ``shape`` ``()``.

    :param float shape: initial :math:`k` (1: the exponential distribution).
    :param int num_gh: Gauss-Hermite nodes of the predictive.
    """

    support = constraints.positive
    _y_fix = "; Gamma needs positive responses y > 0 (drop or shift the zeros, or use a count likelihood)"

    def __init__(self, shape: float = 1.0, num_gh: int = 20):
        super().__init__(num_gh)
        self.shape = PyroParam(_init_param(shape, "shape", example="Gamma(shape=2.0)"), constraints.positive)

    def distribution(self, f):
        k = self.shape
        return dist.Gamma(k, k * (-f).exp())

    def expected_log_prob(self, y, f_loc, f_var):
        y, k = self._as_values(y, f_loc), self.shape
        return k * k.log() - torch.lgamma(k) + (k - 1) * y.log() - k * f_loc - k * y * (0.5 * f_var - f_loc).exp()


class Beta(Likelihood):
    r"""Responses in the open unit interval, :math:`0 < y < 1`: the Beta of mean :math:`\mu = \sigma(f)` (logit link)
    and learnable ``precision`` :math:`\phi > 0` (a ``PyroParam``, positive), i.e. :math:`\mathrm{Beta}(\mu\phi,
    (1 - \mu)\phi)`, variance :math:`\mu (1 - \mu) / (1 + \phi)` (Ferrari and Cribari-Neto 2004, "Beta regression
    for modelling rates and proportions"). Expected log-likelihood by Gauss-Hermite quadrature (Hensman,
    Matthews, Ghahramani 2015, section 4) with ``num_gh`` nodes up to a standard deviation of ``q(f)`` of 1 and
    ``num_gh * sd`` beyond (at most ``max(100, num_gh)``): the log-density is :math:`\phi` times a function of
    :math:`\sigma(f)`, so the error grows with the precision; measured at :math:`\phi = 100` (worst over means in
    ``{-2, 0, 2}`` and ``y`` from 0.02 to 0.999, against scipy's adaptive quadrature) ``5e-8`` nats at sd 1,
    ``8e-6`` at sd 2, ``9e-5`` at sd 3, ``8e-4`` at sd 4, ``1e-2`` at sd 6, about in proportion to :math:`\phi`.
    Predictive: the Gauss-Hermite mixture of Betas. ``f``, ``y``, marginals ``[..., B]``; ``precision`` ``()``.

    :param float precision: initial :math:`\phi`.
    :param int num_gh: Gauss-Hermite nodes.
    """

    support = constraints.unit_interval  # the open interval: check_y refuses 0 and 1
    _node_sd = 1.0  # num_gh nodes up to sd 1, then num_gh * sd (class docstring)

    def __init__(self, precision: float = 10.0, num_gh: int = 20):
        super().__init__(num_gh)
        self.precision = PyroParam(_init_param(precision, "precision", example="Beta(precision=5.0)"),
                                   constraints.positive)

    def distribution(self, f):
        tiny = torch.finfo(f.dtype).tiny
        phi = self.precision
        # sigma(-f) for 1 - mu keeps its precision for large f; concentrations stay positive where sigma underflows
        return dist.Beta((phi * torch.sigmoid(f)).clamp(min=tiny), (phi * torch.sigmoid(-f)).clamp(min=tiny))

    def check_y(self, y):
        """Raise ``ValueError`` unless every ``y`` (any shape, e.g. ``[..., B]``) is finite and strictly inside
        ``(0, 1)``. An argument check: implements no paper equation."""
        _check_finite("y", y)
        bad = ~((y > 0) & (y < 1))
        if bool(bad.any()):
            raise ValueError(f"y must lie strictly inside (0, 1) for Beta, got e.g. {y[bad].flatten()[0].item():g}; "
                             "squeeze values at the bounds inwards, e.g. y = (y * (N - 1) + 0.5) / N (Smithson and "
                             "Verkuilen 2006)")
