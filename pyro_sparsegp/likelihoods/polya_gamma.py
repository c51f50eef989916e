r"""The Pólya-Gamma augmented logistic likelihood (Wenzel, Galy-Fajou, Donner, Kloft, Opper 2019; Polson, Scott,
Windle 2013), and the two closed forms of the augmented bound that the library uses: the optimal local parameter
:func:`optimal_c` and the per-point term at that optimum, :func:`jaakkola_jordan_bound`.

The Pólya-Gamma pieces live in three places, one concept each:

* :mod:`pyro_sparsegp.distributions.polya_gamma`: the distribution :math:`\mathrm{PG}(b, c)` and its elementary
  functions :func:`~pyro_sparsegp.distributions.polya_gamma.pg_mean` (:math:`\bar\omega`) and
  :func:`~pyro_sparsegp.distributions.polya_gamma.log_cosh_half` (its normaliser); its KL in
  :mod:`pyro_sparsegp.distributions.kl`; the augmented observation factor in
  :mod:`pyro_sparsegp.distributions.augmented`;
* this module: the likelihood and the bound's closed forms;
* :func:`pyro_sparsegp.infer.natgrad.polya_gamma_natgrad_step`: the closed-form natural-gradient step.

:mod:`pyro_sparsegp.bounds.polya_gamma` writes the augmented bound out from dense matrices, an oracle for the tests.
Shapes: ``f``, ``y``, ``omega`` and the marginals of q(f) are ``[..., B]``.
"""

from __future__ import annotations

import pyro
import torch

from ..context import deferred
from ..context.composition import seed_context
from ..distributions import PolyaGamma, PolyaGammaAugmentedBernoulli
from .bernoulli import Bernoulli

__all__ = ["PolyaGammaLogit", "optimal_c", "jaakkola_jordan_bound"]


# -- the augmented bound's closed forms ----------------------------------------------------------------------------
def optimal_c(f_loc: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    r"""The optimal local parameters :math:`c_n = \sqrt{\mathbb{E}_q[f_n^2]}` (Wenzel et al. 2019, local update).
    ``f_loc``, ``f_var`` ``[..., N]`` (the marginals of q(f)) -> ``[..., N]``."""
    return (f_loc.pow(2) + f_var).sqrt()


def jaakkola_jordan_bound(y, f_loc, f_var, xi) -> torch.Tensor:
    r"""Jaakkola and Jordan (2000): :math:`\log\sigma(x) \ge \log\sigma(\xi) + (x - \xi)/2 - \lambda(\xi)(x^2-\xi^2)`,
    :math:`\lambda(\xi) = \tanh(\xi/2)/(4\xi)`, in expectation under :math:`x = s f`, :math:`f \sim N(\mu, \sigma^2)`.
    Written from the logistic function directly (no Pólya-Gamma quantities), per point: ``y``, ``f_loc``,
    ``f_var``, ``xi`` broadcast to ``[..., N]`` -> ``[..., N]``. For every :math:`\xi = c` it equals the per-point
    term of the augmented bound (Durante and Rigon 2019), which :func:`pyro_sparsegp.bounds.polya_gamma.pg_bound`
    writes with Pólya-Gamma quantities (the tests compare the two)."""
    s = 2 * y - 1
    lam = torch.tanh(xi / 2) / (4 * xi)
    return torch.nn.functional.logsigmoid(xi) + (s * f_loc - xi) / 2 - lam * (f_loc.pow(2) + f_var - xi.pow(2))


# -- the likelihood ------------------------------------------------------------------------------------------------
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
        if y is not None:
            if not deferred.skip_reads():  # else fit checked y once (context/deferred.py)
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
        return jaakkola_jordan_bound(self._as_values(y, f_loc), f_loc, f_var, optimal_c(f_loc, f_var))

    def guide(self, qf, prefix="gp"):
        """Sample :math:`\\omega_n \\sim \\mathrm{PG}(1, c_n)` at ``<prefix>.omega``, shape ``[..., B]``, with
        the optimal :math:`c_n = \\sqrt{\\mathbb{E}_q f_n^2}` from ``qf()``'s marginals ``[..., B]`` (Wenzel et
        al. 2019, optimal local parameter of the augmented bound)."""
        with torch.no_grad():
            loc, var = qf()
            c = optimal_c(loc, var)
        pyro.sample(f"{prefix}.omega", PolyaGamma(torch.ones_like(c), c))
