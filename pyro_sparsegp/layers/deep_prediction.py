"""Prediction of a deep GP: the mixture of ``S`` Gaussians reached by propagating samples through the hidden
layers' marginals (Salimbeni & Deisenroth 2017, section 3.3), in chunks of rows so that memory is bounded."""

from __future__ import annotations

import math

import torch

from .outputs import targets

__all__ = ["DeepPrediction"]


class DeepPrediction:
    """Mixin of :class:`~pyro_sparsegp.DeepGP`: the predictive mixture's components, its test
    log-likelihood and class probabilities. ``batch_size`` rows of ``X`` at a time (``None``: all at once). The
    mixture of ``S`` Gaussians of Salimbeni & Deisenroth 2017 (samples propagated through the hidden layers'
    marginals). ``X`` ``[N, D]``; components ``[S, N]`` or ``[S, N, L]``."""

    def _targets(self, y):
        """``(y, mask)`` laid out like the last layer's ``f``: ``[L, B]`` with missing outputs filled and masked
        (:func:`~pyro_sparsegp.layers.outputs.targets`), or ``y`` and ``None``."""
        return targets(y, self.last.num_outputs is not None and self.likelihood.latent_dim == 1)

    def clear_cache(self) -> None:
        """Drop every layer's cached factors. No tensors, so shapes do not apply."""
        for layer in self._stack:
            layer.clear_cache()

    def _components(self, X, num_samples, batch_size):
        """``(loc, var)`` of the mixture's ``S`` components at ``X`` ``[N, D]``: ``[S, N]`` or ``[S, L, N]``."""
        parts = []
        step = X.shape[-2] if batch_size is None else int(batch_size)
        for s in range(0, max(X.shape[-2], 1), max(step, 1)):
            _, loc, var = self.propagate(X[..., s : s + step, :], num_samples)
            self.clear_cache()  # no [S, K, B]-sized factors kept after prediction
            parts.append((loc, var))
        return tuple(torch.cat(t, -1) for t in zip(*parts, strict=True))

    @torch.no_grad()
    def predict(self, X: torch.Tensor, num_samples: int = 100, batch_size: int | None = None):
        """The predictive mixture's components: mean and variance of ``f*`` per sample, ``[S, N]`` or ``[S, N, L]``
        each (``q(f* | x*) ≈ 1/S sum_s N(mu_s, var_s)``, Salimbeni & Deisenroth 2017, section 3.3)."""
        X, _ = self.check_inputs(X)
        loc, var = self._components(X, num_samples, batch_size)
        if self.last.num_outputs is not None:
            return loc.mT, var.mT
        return loc, var

    @torch.no_grad()
    def predictive_log_prob(self, X: torch.Tensor, y: torch.Tensor, num_samples: int = 100,
                            return_se: bool = False, batch_size: int | None = None):
        """Test log-likelihood per point ``[N]``: ``log 1/S sum_s p(y_n | mu_s, var_s)`` (logsumexp over the mixture's
        ``S = num_samples`` components; a vector ``y_n`` of ``L`` outputs is scored jointly within each component,
        as the product of its observed outputs' marginal densities: missing outputs (``NaN``) are left out).

        How many samples suffice: the estimate is a log of a Monte Carlo mean, so it is biased low and its error is
        about ``se_n = std_s(w_s) / (sqrt(S) mean_s(w_s))`` with ``w_s = p(y_n | mu_s, var_s)`` (the delta method).
        Where the hidden layers put the point on either side of a sharp change (a step, a discontinuity), a few
        components carry all the mass and ``S = 100`` can be off by several nats for that point, which then dominates
        a mean over points. ``return_se=True`` also returns ``se`` ``[N]``: raise ``S`` until ``se`` is small (e.g.
        below 0.05) for the points you average, or report the median over points beside the mean."""
        X, y = self.check_inputs(X, y)
        loc, var = self._components(X, num_samples, batch_size)
        yt, mask = self._targets(y)
        lp = self.likelihood.predictive_log_prob(yt, loc, var)  # [S, (L,) N]
        if lp.dim() == 3:
            lp = (lp if mask is None else torch.where(mask, lp, 0.0)).sum(-2)
        out = torch.logsumexp(lp, 0) - math.log(lp.shape[0])
        if not return_se:
            return out
        w = (lp - lp.max(0).values).exp()  # weights relative to the largest, [S, N]
        se = w.std(0) / (w.mean(0) * math.sqrt(lp.shape[0]))
        return out, se

    @torch.no_grad()
    def predict_proba(self, X: torch.Tensor, num_samples: int = 100, batch_size: int | None = None) -> torch.Tensor:
        """Class probabilities, the mixture's average: ``[N]`` (``p(y=1)``, Bernoulli) or ``[N, K]`` (multi-class)."""
        X, _ = self.check_inputs(X)
        loc, var = self._components(X, num_samples, batch_size)
        d = self.likelihood.predictive(loc, var)
        if not hasattr(d, "probs"):
            raise ValueError(f"predict_proba needs a classification likelihood, not {type(self.likelihood).__name__}")
        p = d.probs.mean(0)
        return p.squeeze(-2) if p.dim() == 2 and self.likelihood.latent_dim == 1 and p.shape[-2] == 1 else p
