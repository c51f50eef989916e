"""Prediction of a layer from its strategy: marginals of ``q(f*)`` in bounded chunks, the full covariance, joint
draws (Hensman, Matthews, Ghahramani 2015, eq. 19 at test inputs, section 4; Shi, Titsias, Mnih 2020, eqs. 37-38
for SOLVE-GP)."""

from __future__ import annotations

import torch

from ..checks.validation import check_predict
from ..context.composition import layer_method
from ..kernels import kernel_matrix
from ..linalg import cholesky, solve_lower

__all__ = ["Prediction"]


class Prediction:
    """Mixin of the layers: :meth:`predict`, :meth:`qf_full` and :meth:`sample_posterior`, over the layer's
    ``strategy``, ``qf`` and mean function. The predictive ``q(f*) = ∫ p(f* | u) q(u) du`` of Hensman, Matthews,
    Ghahramani 2015, section 4 (eqs. 23-25; SOLVE-GP: Shi, Titsias, Mnih 2020, appendix D.2, eqs. 37-38). ``X``
    ``[..., N, D]``; marginals ``[..., N]`` or ``[..., N, L]``."""

    @layer_method
    @torch.no_grad()
    def predict(self, X: torch.Tensor, full: bool = False, batch_size: int | None = None,
                full_output_cov: bool = False):
        """Mean and variance of ``q(f*)`` at ``X`` ``[..., N, D]`` (no gradients); with ``full=True`` also the
        predictive distribution of ``y*`` from the likelihood, shaped like the training targets (``[..., N]``, or
        ``[..., N, L]``). ``X`` is processed in chunks of ``batch_size`` rows (default: as many as keep the
        ``[L, M, rows]`` projection within 2^24 elements), so memory is bounded. ``full_output_cov=True`` (a layer
        with ``L`` outputs) gives the covariance of the outputs at each point, ``[..., N, L, L]``, in place of the
        variances: ``W diag(v(x)) W^T`` for an LMC layer (Álvarez, Rosasco, Lawrence 2012, section 4.2), diagonal
        for independent outputs; the predictive of ``y*`` (``full=True``) stays that of the marginals."""
        X, _ = self.check_inputs(X, None, purpose="predict")
        batch_size = check_predict(self, full, batch_size, full_output_cov)
        multi = self.num_outputs is not None
        Xq = X.unsqueeze(-3) if multi and X.dim() > 2 else X
        qf = self._qf_output_cov if full_output_cov else self.qf
        if batch_size is None:  # a compiler traces: one chunk (checks.validation.check_predict)
            parts = [qf(Xq)]
        else:
            parts = [qf(Xq[..., i : i + batch_size, :]) for i in range(0, max(X.shape[-2], 1), batch_size)]
        self.strategy.clear()
        mean = torch.cat([p[0] for p in parts], -1)  # [..., (L,) N]
        var = torch.cat([p[1] for p in parts], -1 if not full_output_cov else -3)  # [..., (L,) N] or [..., N, L, L]
        out = (mean.movedim(-2, -1), var if full_output_cov else var.movedim(-2, -1)) if multi else (mean, var)
        if full:
            if self.likelihood is None:
                raise ValueError("predict(full=True) needs a likelihood; this layer has none (a hidden layer)")
            # an element-wise likelihood of L outputs predicts each output like y ([..., N, L]); one of K latent
            # functions (multi-class) takes them in dim -2 ([..., K, N]) and predicts y [..., N]
            elementwise = getattr(self.likelihood, "latent_dim", 1) == 1
            if full_output_cov:
                var = torch.diagonal(var, dim1=-2, dim2=-1).movedim(-1, -2)  # [..., L, N]
            marginals = (mean.movedim(-2, -1), var.movedim(-2, -1)) if elementwise and multi else (mean, var)
            return out + (self.likelihood.predictive(*marginals),)
        return out

    def _qf_output_cov(self, X):
        """``(mean [..., L, B], cov [..., B, L, L])``: the outputs' mean and covariance at each point of ``X``."""
        loc, var = self.strategy.latent_qf(X)  # the latent GPs' marginals [..., L|Q, B]
        mean, _ = self.strategy.mix(loc, var)
        return mean + self._mean(X), self.strategy.mix_cov(var)

    @layer_method
    def qf_full(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Mean ``[..., (L,) N]`` and full covariance ``[..., (L,) N, N]`` of :math:`q(f^*)` at ``X [N, D]``:
        :math:`K_{**} - W^T W + A^T S A` with :math:`W = L_{uu}^{-1} K_{u*}` and :math:`A = W` (whitened) or
        :math:`L_{uu}^{-T} W` (Hensman, Matthews, Ghahramani 2015, eq. 19, at test inputs), summed over the strategy's
        sets of inducing variables (SOLVE-GP: ``u`` and ``v⊥``, eqs. 37-38)."""
        mean, cov = self._latent_full(X)
        N = cov.shape[-1]
        mean, cov = self.strategy.mix(mean, cov.flatten(-2))  # an LMC's outputs: W m, sum_q W_lq^2 C_q
        return mean + self._mean(X), cov.unflatten(-1, (N, N))

    def _latent_full(self, X: torch.Tensor):
        """Mean ``[..., (Q,) N]`` and full covariance ``[..., (Q,) N, N]`` of the strategy's GPs (the outputs, or an
        LMC layer's latents) at ``X``, without the mean function."""
        Xk = self.strategy.align(X)
        terms, proj = self.strategy.full_terms(X)
        self.strategy.clear()
        cov = kernel_matrix(self.kernel, Xk) - sum(P.mT @ P for P in proj)  # [(L|1,) N, N]
        mean = 0.0
        for W, loc, tril, L in terms:
            A = W if L is None else solve_lower(L, W, transpose=True)
            mean = mean + (loc.unsqueeze(-2) @ A).squeeze(-2)
            SA = tril.mT @ A
            cov = cov + SA.mT @ SA
        return mean, cov

    @torch.no_grad()
    def sample_posterior(self, X: torch.Tensor, num_samples: int = 1) -> torch.Tensor:
        """Joint draws of ``f*`` from :math:`q(f^*)` at ``X [N, D]`` with its full covariance (smooth function
        draws, not independent marginals): ``[num_samples, N]`` or ``[num_samples, N, L]``. An LMC layer draws its
        latents jointly and mixes them (``f = W g + m(X)``), so its outputs are correlated as the model says."""
        X, _ = self.check_inputs(X, None)
        mean, cov = self._latent_full(X)
        # low-rank by nature: a raised jitter only adds a little independent noise to the draws
        L = cholesky(cov, self.jitter, warn_singular=False, warn_jitter=False, symmetrize=True)
        eps = torch.randn((num_samples,) + mean.shape, dtype=mean.dtype, device=mean.device)
        f = self.strategy.mix_sample(mean + (L @ eps.unsqueeze(-1)).squeeze(-1)) + self._mean(X)
        return f.movedim(-2, -1) if self.num_outputs is not None else f
