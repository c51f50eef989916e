r"""The linear model of coregionalisation (LMC) as a strategy over latent GPs (Álvarez, Rosasco, Lawrence 2012,
"Kernels for vector-valued functions: a review", section 4.2): ``Q`` independent latent GPs ``g_q``, each with its
own inducing variables and ``q(u_q)``, computed by a base strategy (:class:`~pyro_sparsegp.variational.Strategy`,
or SOLVE-GP's :class:`~pyro_sparsegp.variational.OrthogonalStrategy`) as if they were ``Q`` independent outputs, and
``L`` outputs ``f = W g`` with the layer's ``W`` ``[L, Q]``. GPyTorch's ``LMCVariationalStrategy`` wraps a base
strategy the same way.

Given ``u`` the latents are independent, and so are they under ``q``, so the outputs' marginals are

.. math:: \mu_{nl} = \sum_q W_{lq}\, m_q(x_n), \qquad \sigma^2_{nl} = \sum_q W_{lq}^2\, v_q(x_n),

(:meth:`LinearMixing.mix`: the marginals of ``p(f | u)`` from those of ``p(g | u)``, of ``q(f)`` from those of
``q(g)``), and at one point the outputs' covariance is ``W diag(v(x_n)) W^T`` (:meth:`LinearMixing.mix_cov`). The
KL term is that of the latents, ``sum_q KL[q(u_q) || p(u_q)]`` (the base strategy's).

Shapes: latents ``g`` ``[..., Q, B]``, outputs ``f`` ``[..., L, B]``, ``W`` ``[L, Q]``; inputs ``X`` ``[B, D]`` or
``[..., 1, B, D]`` (the latents share their inputs).
"""

from __future__ import annotations

import torch

from .orthogonal import OrthogonalStrategy
from .strategy import Strategy

__all__ = ["LinearMixing", "LMCStrategy", "OrthogonalLMCStrategy"]


class LinearMixing:
    """Mixin before a strategy class: its GPs are the ``Q`` latents, and its outputs ``f = W g`` (module docstring;
    Álvarez, Rosasco, Lawrence 2012, section 4.2). Reads the layer's ``W`` ``[L, Q]`` when it runs."""

    def align(self, X: torch.Tensor) -> torch.Tensor:
        """Inputs laid out against ``g`` ``[..., Q, B]``: ``X`` ``[B, D]`` gets the latents' singleton
        (``[1, B, D]``); ``X`` ``[..., K, B, D]`` needs ``K = 1``: the latents share their inputs."""
        if X.dim() > 2 and X.shape[-3] != 1:
            raise ValueError(f"inputs of shape {tuple(X.shape)} for an LMC layer: its Q latent GPs share their inputs, "
                             "so X's dim -3 (which stands at the latents' dim -2) must be 1: pass X [B, D] or "
                             "[..., 1, B, D] (a hidden layer's sample_hidden gives that layout)")
        return super().align(X)

    def mix(self, loc: torch.Tensor, var: torch.Tensor):
        """``(W m, W^2 v)``: marginals ``[..., L, B]`` of the outputs from the latents' ``[..., Q, B]``."""
        W = self.layer.W  # [L, Q]
        return W @ loc, W.square() @ var

    def mix_sample(self, g: torch.Tensor) -> torch.Tensor:
        """``f = W g`` ``[..., L, B]`` from the latents' values ``g`` ``[..., Q, B]``."""
        return self.layer.W @ g

    def mix_cov(self, var: torch.Tensor) -> torch.Tensor:
        """``W diag(v_n) W^T`` ``[..., B, L, L]``: the outputs' covariance at each point, from the latents' variances
        ``var`` ``[..., Q, B]``."""
        W = self.layer.W
        return (W * var.movedim(-2, -1).unsqueeze(-2)) @ W.mT  # [..., B, L, Q] @ [Q, L]


class LMCStrategy(LinearMixing, Strategy):
    """The LMC over SVGP latents: :class:`~pyro_sparsegp.variational.Strategy` for ``Q`` latent GPs (Hensman, Fusi,
    Lawrence 2013), mixed by :class:`LinearMixing` (Álvarez, Rosasco, Lawrence 2012, section 4.2). ``q(u)``
    ``[Q, M]``, ``[Q, M, M]``; ``f`` ``[..., L, B]``."""


class OrthogonalLMCStrategy(LinearMixing, OrthogonalStrategy):
    """The LMC over SOLVE-GP latents: :class:`~pyro_sparsegp.variational.OrthogonalStrategy` for ``Q`` latent GPs
    (Shi, Titsias, Mnih 2020), mixed by :class:`LinearMixing` (Álvarez, Rosasco, Lawrence 2012, section 4.2).
    ``q(u)``, ``q(v⊥)`` ``[Q, M]``, ``[Q, M2]``; ``f`` ``[..., L, B]``."""
