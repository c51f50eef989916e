r"""The Bernoulli likelihood of binary labels ``y`` in ``{0, 1}``, probit or logit link: expected log-likelihood by
Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani 2015, section 4), closed-form probit predictive.
Shapes ``[..., B]``."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from torch.distributions import constraints

from ..linalg import gauss_hermite
from .base import Likelihood

__all__ = ["Bernoulli"]


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
