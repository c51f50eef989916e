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
(Durante and Rigon 2019), which the library computes independently
(:func:`pyro_sparsegp.likelihoods.polya_gamma.jaakkola_jordan_bound`, what ``PolyaGammaLogit.expected_log_prob``
returns); the tests compare the two.
"""

from __future__ import annotations

import math

import torch

from ..distributions.polya_gamma import log_cosh_half, pg_mean  # written once, beside the PG distribution
from ..likelihoods.polya_gamma import optimal_c  # the local update, c = sqrt(E f^2): not what this oracle checks
from .svgp import gauss_kl, qf_dense

__all__ = ["pg_bound"]


def _pg_terms(y, f_loc, f_var, c):
    s = 2 * y - 1
    w = pg_mean(c)
    kl_pg = log_cosh_half(c) - 0.5 * c.pow(2) * w
    return -math.log(2) + 0.5 * s * f_loc - 0.5 * w * (f_loc.pow(2) + f_var) - kl_pg


def pg_bound(y, Kuu, Kuf, kff_diag, m, L, c=None, whiten: bool = False) -> torch.Tensor:
    r"""The augmented bound :math:`\mathcal{L}(c)` of Wenzel et al. (2019) (module docstring) from dense matrices;
    ``c=None`` uses the optimal
    :func:`~pyro_sparsegp.likelihoods.polya_gamma.optimal_c`. ``y [..., N]`` in ``{0, 1}``, ``Kuu [..., M, M]``,
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
