r"""A distribution over observations with the latent function integrated out under a Gaussian.

``MarginalizedLikelihood(likelihood, f_loc, f_var)`` has ``log_prob(y) = E_{N(f; f_loc, f_var)}[log p(y | f)]``
(the likelihood's expected log-likelihood, analytic or Gauss-Hermite). Observing ``y`` from it in place of sampling
``f ~ N(f_loc, f_var)`` and observing ``y ~ p(y | f)`` leaves the ELBO's expectation unchanged (same bound, Hensman
2015 eq. 21) and removes the Monte-Carlo noise of ``f``. It is not a normalised density of ``y``; ``sample`` draws
``f`` and then ``y`` so that ``Predictive`` works.
"""

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

__all__ = ["MarginalizedLikelihood"]


class MarginalizedLikelihood(TorchDistribution):
    """The observation ``y`` with ``f ~ N(f_loc, f_var)`` integrated out of its log-likelihood:
    ``log_prob(y) = E_{N(f; f_loc, f_var)}[log p(y | f)]``, the data term of Hensman, Matthews, Ghahramani (2015)
    eq. 21 (the ``y`` site of ``SVGP(..., integrate_f=True)``).

    :param likelihood: a :class:`pyro_sparsegp.likelihoods.Likelihood`.
    :param f_loc: ``[..., B]`` (``[..., K, B]`` for likelihoods of ``K`` latent functions).
    :param f_var: same shape as ``f_loc``.

    Batch shape: the shape of ``y`` given ``f`` (``likelihood.y_shape(f_loc.shape)``: ``[..., B]``, or
    ``[..., 1, B]`` for ``K`` latent functions); event shape ``()``."""

    arg_constraints = {"f_loc": constraints.real, "f_var": constraints.positive}
    has_rsample = False

    def __init__(self, likelihood, f_loc, f_var, validate_args=None):
        self.likelihood = likelihood
        self.f_loc, self.f_var = torch.broadcast_tensors(f_loc, f_var)
        super().__init__(likelihood.y_shape(self.f_loc.shape), torch.Size(), validate_args=validate_args)

    @property
    def support(self):
        return self.likelihood.support

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if self.likelihood.latent_dim == 1:
            f_shape = batch_shape
        else:  # the classes' dimension of f stands where y keeps a singleton (see likelihoods.multiclass)
            f_shape = batch_shape[:-2] + self.f_loc.shape[-2:-1] + batch_shape[-1:]
        new = self._get_checked_instance(MarginalizedLikelihood, _instance)
        new.likelihood = self.likelihood
        new.f_loc = self.f_loc.expand(f_shape)
        new.f_var = self.f_var.expand(f_shape)
        super(MarginalizedLikelihood, new).__init__(batch_shape, torch.Size(), validate_args=False)
        new._validate_args = self._validate_args
        return new

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        return self.likelihood.expected_log_prob(value, self.f_loc, self.f_var)

    def sample(self, sample_shape=torch.Size()):
        with torch.no_grad():
            shape = torch.Size(sample_shape) + self.f_loc.shape
            f = self.f_loc + self.f_var.sqrt() * torch.randn(shape, dtype=self.f_loc.dtype, device=self.f_loc.device)
            return self.likelihood.distribution(f).sample()
