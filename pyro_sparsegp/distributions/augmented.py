r"""The Pólya-Gamma augmented logistic observation factor (Polson, Scott, Windle 2013; Wenzel et al. 2019).

``PolyaGammaAugmentedBernoulli(f, omega)`` has, for labels ``y`` in ``{0, 1}`` and ``s = 2y - 1``,

.. math:: \log p(y | f, \omega) = \tfrac{s f}{2} - \tfrac{\omega f^2}{2} - \log 2,

the factor that, multiplied by the prior :math:`\mathrm{PG}(\omega | 1, 0)` and integrated over :math:`\omega`, gives
:math:`\sigma(s f)`. It is not normalised over ``y`` for fixed ``omega`` (the pair ``(y, omega)`` is); ``sample``
draws ``y`` from the exact conditional :math:`p(y | f) = \mathrm{Bernoulli}(\sigma(f))` so that ``Predictive`` works.
"""

import math

import torch
from pyro.distributions import Bernoulli
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import broadcast_all

__all__ = ["PolyaGammaAugmentedBernoulli"]


class PolyaGammaAugmentedBernoulli(TorchDistribution):
    """The augmented logistic factor :math:`p(y | f, \\omega)` of Polson, Scott, Windle (2013), as used by Wenzel et
    al. (2019) (module docstring): the ``y`` site of :class:`~pyro_sparsegp.likelihoods.PolyaGammaLogit`.

    :param f: latent values ``[...]``.
    :param omega: Pólya-Gamma variables, broadcastable with ``f``.

    Batch shape ``broadcast(f.shape, omega.shape)``, event shape ``()``; labels ``y`` in ``{0, 1}``."""

    arg_constraints = {"f": constraints.real, "omega": constraints.positive}
    support = constraints.boolean
    has_rsample = False

    def __init__(self, f, omega, validate_args=None):
        self.f, self.omega = broadcast_all(f, omega)
        super().__init__(self.f.shape, torch.Size(), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(PolyaGammaAugmentedBernoulli, _instance)
        batch_shape = torch.Size(batch_shape)
        new.f = self.f.expand(batch_shape)
        new.omega = self.omega.expand(batch_shape)
        super(PolyaGammaAugmentedBernoulli, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        s = 2 * value - 1
        return 0.5 * s * self.f - 0.5 * self.omega * self.f.pow(2) - math.log(2)

    def sample(self, sample_shape=torch.Size()):
        return Bernoulli(logits=self.f).sample(sample_shape)
