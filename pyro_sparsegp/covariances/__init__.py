r"""Covariances of inducing variables, registered per (inducing type, kernel type) (the idea of GPflow's
``covariances/kuus.py`` and ``kufs.py``): :func:`Kuu` ``[(L,) M, M']``, :func:`Kuf` ``[..., (L|1,) M, B]`` and the
prior variances :func:`Kdiag` ``[..., B]`` are :math:`K_{mm}`, :math:`K_{mn}` and the diagonal of :math:`K_{nn}` of
Hensman, Matthews, Ghahramani 2015, eq. 19, whatever ``u`` is. Every layer reads them here, so every layer takes every
kind of inducing variable without special cases.

Rules (:mod:`~pyro_sparsegp.covariances.dispatch` walks the MRO of both types, most specific pair first):

* :mod:`~pyro_sparsegp.covariances.points`: inducing points under any Pyro kernel (and under a convolutional kernel
  or a sum, as images): ``k(Z, Z')``, ``k(Z, X)``.
* :mod:`~pyro_sparsegp.covariances.patches`: inducing patches under a convolutional kernel, indexed patches under
  TICK (van der Wilk et al. 2017, eqs. 12-13; Dutordoir et al. 2020, sec. 3).
* :mod:`~pyro_sparsegp.covariances.sums`: an inducing sum under a sum kernel: block-diagonal ``Kuu``, stacked
  ``Kuf``.
* :mod:`~pyro_sparsegp.covariances.separate`: inducing points under a ``Separate`` kernel (one GP per latent):
  ``Kuu`` ``[Q, M, M]``, ``Kuf`` ``[..., Q, M, B]``.

A new pair: subclass :class:`Rule` and :func:`register` it; a new kernel type: :func:`register_diag` its diagonal.
"""

from . import patches, points, separate, sums  # noqa: F401  (the rules register themselves on import)
from .dispatch import NoRuleError, Rule, lookup, lookup_diag, pairs, register, register_diag
from .functions import Kdiag, Kuf, Kuu, check

__all__ = [
    "Kuu",
    "Kuf",
    "Kdiag",
    "check",
    "Rule",
    "NoRuleError",
    "register",
    "register_diag",
    "lookup",
    "lookup_diag",
    "pairs",
]
