r"""The Pólya-Gamma augmented bound of Wenzel, Galy-Fajou, Donner, Kloft, Opper (2019), "Efficient Gaussian process
classification using Pólya-Gamma data augmentation", AAAI 2019 (and its workshop version, "Scalable logit Gaussian
process classification"), in closed form.

Labels :math:`y_n \in \{0, 1\}`, signs :math:`s_n = 2y_n - 1`. The augmentation (Polson, Scott, Windle 2013) writes

.. math:: p(y_n | f_n) = \sigma(s_n f_n)
          = \int \tfrac12 e^{s_n f_n/2} e^{-\omega_n f_n^2/2}\, \mathrm{PG}(\omega_n|1,0)\,d\omega_n,

so with :math:`q(u) = N(m, S)`, :math:`q(\omega_n) = \mathrm{PG}(1, c_n)` and :math:`q(f_n) = N(\mu_n, \sigma_n^2)`:

.. math:: \mathcal{L}(c) = \sum_n \Big[-\log 2 + \tfrac{s_n\mu_n}{2} - \tfrac{\bar\omega_n}{2}(\mu_n^2+\sigma_n^2)
          - \mathrm{KL}[\mathrm{PG}(1,c_n)\|\mathrm{PG}(1,0)]\Big] - \mathrm{KL}[q(u)\|p(u)],

:math:`\bar\omega_n = \tanh(c_n/2)/(2c_n)`, :math:`\mathrm{KL}[\mathrm{PG}(1,c)\|\mathrm{PG}(1,0)] = \log\cosh(c/2) -
c^2\bar\omega/2`. The optimal local parameter is :math:`c_n = \sqrt{\mu_n^2 + \sigma_n^2}` (the poster's update).
For every :math:`c` the per-point term equals the Jaakkola-Jordan bound on :math:`\mathbb{E}\log\sigma(s_n f_n)`
(Durante and Rigon 2019), which :func:`jaakkola_jordan_bound` computes independently for the tests.
"""

from __future__ import annotations

import math

import torch

from ..distributions.polya_gamma import log_cosh_half, pg_mean  # written once, beside the PG distribution
from .svgp import gauss_kl, qf_dense

__all__ = ["pg_mean", "log_cosh_half", "pg_bound", "optimal_c", "jaakkola_jordan_bound"]


def optimal_c(f_loc: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    r"""The optimal local parameters :math:`c_n = \sqrt{\mathbb{E}_q[f_n^2]}` (Wenzel et al. 2019, local update).
    ``f_loc``, ``f_var`` ``[..., N]`` (the marginals of q(f)) -> ``[..., N]``."""
    return (f_loc.pow(2) + f_var).sqrt()


def _pg_terms(y, f_loc, f_var, c):
    s = 2 * y - 1
    w = pg_mean(c)
    kl_pg = log_cosh_half(c) - 0.5 * c.pow(2) * w
    return -math.log(2) + 0.5 * s * f_loc - 0.5 * w * (f_loc.pow(2) + f_var) - kl_pg


def pg_bound(y, Kuu, Kuf, kff_diag, m, L, c=None, whiten: bool = False) -> torch.Tensor:
    r"""The augmented bound :math:`\mathcal{L}(c)` of Wenzel et al. (2019) (module docstring) from dense matrices;
    ``c=None`` uses the optimal :func:`optimal_c`. ``y [..., N]`` in ``{0, 1}``, ``Kuu [..., M, M]``,
    ``Kuf [..., M, N]``, ``kff_diag [..., N]``, ``c [..., N]``; ``(m [..., M], L [..., M, M])`` parameterise ``q(u)``
    (``q(v)``, ``u = Luu v``, if ``whiten``). Returns ``[...]``."""
    if whiten:
        Luu = torch.linalg.cholesky(Kuu)
        mu, var = qf_dense(Kuu, Kuf, kff_diag, (Luu @ m.unsqueeze(-1)).squeeze(-1), Luu @ L)
        kl = gauss_kl(m, L, None)
    else:
        mu, var = qf_dense(Kuu, Kuf, kff_diag, m, L)
        kl = gauss_kl(m, L, Kuu)
    if c is None:
        c = optimal_c(mu, var)
    return _pg_terms(y, mu, var, c).sum(-1) - kl


def jaakkola_jordan_bound(y, f_loc, f_var, xi) -> torch.Tensor:
    r"""Jaakkola and Jordan (2000): :math:`\log\sigma(x) \ge \log\sigma(\xi) + (x - \xi)/2 - \lambda(\xi)(x^2-\xi^2)`,
    :math:`\lambda(\xi) = \tanh(\xi/2)/(4\xi)`, in expectation under :math:`x = s f`, :math:`f \sim N(\mu, \sigma^2)`.
    Written from the logistic function directly (no Pólya-Gamma quantities), per point: ``y``, ``f_loc``,
    ``f_var``, ``xi`` broadcast to ``[..., N]`` -> ``[..., N]``."""
    s = 2 * y - 1
    lam = torch.tanh(xi / 2) / (4 * xi)
    return torch.nn.functional.logsigmoid(xi) + (s * f_loc - xi) / 2 - lam * (f_loc.pow(2) + f_var - xi.pow(2))
