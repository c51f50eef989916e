r"""Multi-class likelihoods over ``K`` latent functions: robust-max and softmax.

Shapes: latent values ``f`` ``[..., K, B]`` (the classes are the outputs dimension of a multi-output
:class:`~pyro_sparsegp.SVGP`, to the left of the data dimension); labels ``y`` ``[..., B]`` in ``{0, ..., K-1}``.
The distribution of ``y`` given ``f`` (and ``expected_log_prob``) keeps the classes' dimension as a singleton,
batch shape ``[..., 1, B]``: the observed site then lines up with Pyro's plates (the outputs plate at ``-2``, the
particles further left) under vectorised particles. ``predictive`` drops it: ``[..., B]``.
"""
from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import constraints

from .likelihoods import Likelihood, _check_finite
from .linalg import gauss_hermite

__all__ = ["RobustMax", "Softmax"]


class _Categorical(Likelihood):
    def __init__(self, num_classes: int, num_gh: int = 20):
        super().__init__(num_gh)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.num_classes = num_classes
        self.latent_dim = num_classes
        self.support = constraints.integer_interval(0, num_classes - 1)

    def y_shape(self, f_shape):
        return torch.Size(f_shape[:-2] + (1,) + f_shape[-1:])

    def check_y(self, y):
        _check_finite("y", y)
        if not bool(((y == y.round()) & (y >= 0) & (y <= self.num_classes - 1)).all()):
            raise ValueError(f"labels must be integers in 0..{self.num_classes - 1}")

    def _check_f(self, f):
        if f.dim() < 2 or f.shape[-2] != self.num_classes:
            raise ValueError(f"f must be [..., K={self.num_classes}, B], got {tuple(f.shape)}")

    def quadrature_expected_log_prob(self, y, f_loc, f_var):
        raise NotImplementedError(
            "one-dimensional quadrature does not apply to a likelihood of K latent values; use expected_log_prob"
        )


class RobustMax(_Categorical):
    r"""Robust-max likelihood (Hernández-Lobato, Hernández-Lobato, Dupont 2011; Villacampa-Calvo and
    Hernández-Lobato 2017, eq. 13):

    .. math:: p(y = k | f) = (1 - \epsilon)\,[k = \arg\max_j f_j] + \tfrac{\epsilon}{K-1}\,[k \ne \arg\max_j f_j].

    Expected log-likelihood under independent :math:`q(f_{j}) = N(m_j, v_j)` (Villacampa-Calvo and
    Hernández-Lobato 2017, eq. 15's data term):

    .. math:: \mathbb{E}_q \log p(y|f) = \log(1-\epsilon)\,P + \log\tfrac{\epsilon}{K-1}(1 - P),\quad
              P = \mathbb{E}_{f_y \sim N(m_y, v_y)} \prod_{j \ne y} \Phi\Big(\frac{f_y - m_j}{\sqrt{v_j}}\Big),

    the probability that the true class's latent is the largest, by one-dimensional Gauss-Hermite quadrature over
    :math:`f_y` with ``num_gh`` nodes. ``epsilon`` is a fixed float.

    The likelihood is piecewise constant in ``f``, so a sampled ``f`` site carries no pathwise gradient to the
    kernel or the inducing points: train with ``SVGP(..., integrate_f=True)`` or ``fit(..., elbo="analytic")``,
    which use the quadrature above (the sampled site still estimates the bound without bias).
    """

    def __init__(self, num_classes: int, epsilon: float = 1e-3, num_gh: int = 20):
        super().__init__(num_classes, num_gh)
        if not 0 < epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    def _probs(self, f):
        onehot = torch.nn.functional.one_hot(f.argmax(-2), self.num_classes).to(f.dtype)  # [..., B, K]
        eps = self.epsilon
        return onehot * (1 - eps) + (1 - onehot) * eps / (self.num_classes - 1)

    def distribution(self, f):
        self._check_f(f)
        return dist.Categorical(probs=self._probs(f).unsqueeze(-3))

    def _p_largest(self, k, f_loc, f_var):
        """P(f_k is the largest) under independent Gaussians; ``k`` ``[..., B]`` long -> ``[..., B]``."""
        x, w = gauss_hermite(self.num_gh, f_loc.dtype, f_loc.device)
        loc_k = f_loc.gather(-2, k.unsqueeze(-2)).squeeze(-2)  # [..., B]
        sd_k = f_var.gather(-2, k.unsqueeze(-2)).squeeze(-2).sqrt()
        fk = loc_k.unsqueeze(-1) + sd_k.unsqueeze(-1) * x  # [..., B, n]
        z = (fk.unsqueeze(-3) - f_loc.unsqueeze(-1)) / f_var.sqrt().unsqueeze(-1)  # [..., K, B, n]
        logphi = torch.special.log_ndtr(z)
        own = torch.nn.functional.one_hot(k, self.num_classes).to(f_loc.dtype).movedim(-1, -2).unsqueeze(-1)
        log_prod = (logphi * (1 - own)).sum(-3)  # [..., B, n]
        return (log_prod.exp() * w).sum(-1).clamp(0.0, 1.0)

    def expected_log_prob(self, y, f_loc, f_var):
        self._check_f(f_loc)
        k = y.long().expand(f_loc.shape[:-2] + f_loc.shape[-1:])
        P = self._p_largest(k, f_loc, f_var)
        eps = self.epsilon
        return (math.log(1 - eps) * P + math.log(eps / (self.num_classes - 1)) * (1 - P)).unsqueeze(-2)

    def predictive(self, f_loc, f_var):
        """Categorical with :math:`p_k = (1-\\epsilon)P_k + \\frac{\\epsilon}{K-1}(1-P_k)`; the :math:`P_k` sum to one up
        to quadrature error, and are renormalised."""
        self._check_f(f_loc)
        K = self.num_classes
        shape = f_loc.shape[:-2] + f_loc.shape[-1:]
        P = torch.stack(
            [self._p_largest(torch.full(shape, k, dtype=torch.long, device=f_loc.device), f_loc, f_var)
             for k in range(K)], -1)  # [..., B, K]
        P = P / P.sum(-1, keepdim=True)
        eps = self.epsilon
        return dist.Categorical(probs=(1 - eps) * P + eps / (K - 1) * (1 - P))


class Softmax(_Categorical):
    r""":math:`p(y = k | f) = \mathrm{softmax}(f)_k`. Its expected log-likelihood has no closed form: it is estimated
    by Monte Carlo with ``num_samples`` reparameterised draws of :math:`f \sim q(f)` (unbiased for the expectation,
    and so for the bound), and the predictive probabilities likewise."""

    def __init__(self, num_classes: int, num_samples: int = 100):
        super().__init__(num_classes)
        self.num_samples = num_samples

    def distribution(self, f):
        self._check_f(f)
        return dist.Categorical(logits=f.movedim(-2, -1).unsqueeze(-3))

    def _draws(self, f_loc, f_var):
        eps = torch.randn((self.num_samples,) + f_loc.shape, dtype=f_loc.dtype, device=f_loc.device)
        return f_loc + f_var.sqrt() * eps  # [S, ..., K, B]

    def expected_log_prob(self, y, f_loc, f_var):
        self._check_f(f_loc)
        logp = torch.log_softmax(self._draws(f_loc, f_var), dim=-2)  # [S, ..., K, B]
        k = y.long().expand(f_loc.shape[:-2] + f_loc.shape[-1:])
        idx = k.unsqueeze(-2).expand((self.num_samples,) + k.shape[:-1] + (1,) + k.shape[-1:])
        return logp.gather(-2, idx).mean(0)  # [..., 1, B]

    def predictive(self, f_loc, f_var):
        self._check_f(f_loc)
        with torch.no_grad():
            probs = torch.softmax(self._draws(f_loc, f_var), dim=-2).mean(0)
        return dist.Categorical(probs=probs.movedim(-2, -1))
