r"""The Gaussian likelihood :math:`y = f + \epsilon`, :math:`\epsilon \sim N(0, \sigma^2)`, with its closed-form
expected log-likelihood (Hensman, Fusi, Lawrence 2013, eq. 4) and predictive. Shapes ``[..., B]``."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam
from torch.distributions import constraints

from .base import _LIVE_GAUSSIAN, Likelihood

__all__ = ["Gaussian"]


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
