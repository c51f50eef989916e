r"""The plain :class:`torch.nn.Module` s that an exported program is traced from: a layer's marginals of ``q(f*)`` as a
few matrix products over constants computed once, at export (:class:`LayerPredictor`), the mean functions
(:class:`Affine`), a deep GP's propagation with fixed draws (:class:`DeepPredictor`) and the top-level
:class:`Predictor` that returns the requested quantities. Nothing here imports Pyro; every tensor is a buffer.

For ``G`` independent GPs (one output, ``L`` outputs, or an LMC layer's ``Q`` latents) with inducing inputs ``Z``
``[G, M, D]``, the lower factor ``Lj`` of their prior covariance and ``q`` in whitened coordinates ``N(m, C C^T)``
(:meth:`pyro_sparsegp.variational.Strategy.predictive_terms`), the marginals at ``x`` are (Hensman, Matthews,
Ghahramani 2015, eq. 19, whitened; Shi, Titsias, Mnih 2020, eqs. 37-38 over ``[Z; O]``)

.. math:: w = P\,k(Z, x),\quad P = L_j^{-1},\qquad \mu = w^\top m,\qquad
          \sigma^2 = k(x, x) + w^\top (C C^\top - I)\, w .

The variance keeps the projection ``w`` instead of folding ``P`` into one matrix
``B = P^\top (C C^\top - I) P`` (``k^\top B k``, one product fewer): the rounding error of the folded form grows with
``cond(Kuu)``, that of ``w`` with its square root, which keeps float32 programs usable. A mean-only program folds
``a = P^\top m`` (``\mu = k(x, Z)\, a``). An LMC layer mixes the latents' marginals, ``W \mu`` and ``W^2 \sigma^2``
(Álvarez, Rosasco, Lawrence 2012, section 4.2); an ODVGP adds ``k(x, O)\, a_O`` to the mean (Shi, Titsias, Mnih
2020, section 5).
"""

from __future__ import annotations

import torch

__all__ = ["Affine", "LayerPredictor", "DeepPredictor", "Predictor"]


class Affine(torch.nn.Module):
    """``m(x) = x A + b`` ``[..., N, L]`` (``A`` ``[D, L]`` or absent, ``b`` ``[L]`` or absent): every mean function
    of :mod:`pyro_sparsegp.mean_functions` (``Zero``, ``Constant``, ``Linear``, ``Identity``, ``FixedProjection``;
    the hidden layers' mean functions of Salimbeni & Deisenroth 2017, section 3)."""

    def __init__(self, A: torch.Tensor | None, b: torch.Tensor | None, out_dim: int):
        super().__init__()
        self.has_A, self.has_b, self.out_dim = A is not None, b is not None, out_dim
        self.register_buffer("A", A if A is not None else torch.zeros(()))
        self.register_buffer("b", b if b is not None else torch.zeros(()))

    def forward(self, X):
        out = X @ self.A if self.has_A else X.new_zeros(X.shape[:-1] + (self.out_dim,))
        return out + self.b if self.has_b else out


class LayerPredictor(torch.nn.Module):
    """The marginals of one layer's ``q(f*)`` (module docstring). Buffers: ``Z`` ``[G, M, D]``, ``P`` ``[G, M, M]``,
    ``m`` ``[G, M]``, ``D`` ``[G, M, M]`` (``C C^T - I``), ``a`` ``[G, M]`` (``P^T m``), optional ``W`` ``[L, G]``
    (LMC), ``O`` ``[M2, D]`` and ``a_O`` ``[M2]`` (ODVGP's mean). ``kernel``, ``mean`` (an :class:`Affine` or
    ``None``) are modules. ``single``: one output (``[..., N]`` rather than ``[..., N, L]``). The marginals of
    Hensman, Matthews, Ghahramani 2015, eq. 19 (Shi, Titsias, Mnih 2020, eqs. 37-38 over ``[Z; O]``)."""

    def __init__(self, kernel, Z, Lj, m, C, mean=None, W=None, O=None, a_O=None, single=False):
        super().__init__()
        G, M = m.shape
        P = torch.linalg.solve_triangular(Lj, torch.eye(M, dtype=Lj.dtype).expand(Lj.shape), upper=False)
        self.kernel, self.mean, self.single = kernel, mean, single
        self.register_buffer("Z", Z)
        self.register_buffer("P", P.expand(G, M, M).clone())
        self.register_buffer("m", m)
        self.register_buffer("D", C @ C.mT - torch.eye(M, dtype=C.dtype))
        self.register_buffer("a", (P.mT @ m.unsqueeze(-1)).squeeze(-1))
        self.mixed, self.odvgp = W is not None, O is not None
        self.register_buffer("W", W if W is not None else torch.zeros(()))
        self.register_buffer("O", O if O is not None else torch.zeros(()))
        self.register_buffer("a_O", a_O if a_O is not None else torch.zeros(()))

    @property
    def width(self) -> int:
        """``L``, the outputs (features handed to a next layer): an int, so shapes do not apply."""
        return self.W.shape[0] if self.mixed else self.m.shape[0]

    def latent(self, X, var: bool = True):
        """Marginals of the ``G`` GPs at ``X`` ``[..., N, D]``, each ``[..., G, N]`` (``var=False``: the mean and
        ``None``), without mixing or mean function."""
        K = self.kernel(X, self.Z)  # [..., G, N, M]
        if not var:
            mu = (K @ self.a.unsqueeze(-1)).squeeze(-1)
            v = None
        else:
            w = K @ self.P.mT  # [..., G, N, M]: rows of (P k(Z, x))^T
            mu = (w @ self.m.unsqueeze(-1)).squeeze(-1)
            v = (self.kernel.diag() + ((w @ self.D) * w).sum(-1)).clamp(min=torch.finfo(w.dtype).tiny ** 0.5)
        if self.odvgp:
            mu = mu + (self.kernel(X, self.O.unsqueeze(0)) @ self.a_O.unsqueeze(-1)).squeeze(-1)
        return mu, v

    def mix(self, g):
        """The outputs ``[..., L, N]`` from the GPs' values or means ``g`` ``[..., G, N]``."""
        return self.W @ g if self.mixed else g

    def mean_function(self, X):
        """``m(X)`` laid out like ``f`` ``[..., L, N]`` (``0`` without one)."""
        return 0.0 if self.mean is None else self.mean(X).movedim(-1, -2)

    def forward(self, X, var: bool = True):
        """Marginals of the outputs, each ``[..., L, N]`` (``var=False``: ``(mean, None)``)."""
        mu, v = self.latent(X, var)
        mu = self.mix(mu) + self.mean_function(X)
        if v is not None and self.mixed:
            v = self.W.square() @ v
        return mu, v


class DeepPredictor(torch.nn.Module):
    """A deep GP's predictive mixture with ``S`` fixed standard-normal draws per hidden layer, ``eps_l`` ``[S, L_l]``
    (buffers): the draw of sample ``s`` at every point is ``f = mu + sqrt(var) * eps_l[s]`` (common random numbers
    across points: each point's mixture is still ``S`` draws from its own marginals, Salimbeni & Deisenroth 2017,
    eq. 7 and section 3.3), so the program is deterministic. ``forward`` gives the last layer's components
    ``[S, L, N]``."""

    def __init__(self, hidden, last, eps):
        super().__init__()
        self.hidden, self.last = torch.nn.ModuleList(hidden), last
        for i, e in enumerate(eps):
            self.register_buffer(f"eps{i}", e)

    def forward(self, X, var: bool = True):
        h = X
        for i, layer in enumerate(self.hidden):
            mu, v = layer.latent(h)  # [(S,) G, N]
            g = mu + v.sqrt() * getattr(self, f"eps{i}").unsqueeze(-1)  # [S, G, N]
            h = (layer.mix(g) + layer.mean_function(h)).movedim(-1, -2)  # [S, N, L]
        return self.last(h, True)


class Predictor(torch.nn.Module):
    """The exported module: ``forward(X)`` ``X`` ``[N, D]`` -> a tuple of the quantities in ``what`` (each ``[N]``
    for one output, ``[N, L]`` for ``L``): ``"mean"``, ``"var"`` of ``q(f*)``, and ``"y_mean"``, ``"y_var"`` of the
    likelihood's predictive (``y_moments``, a module taking ``(mean, var)`` ``[..., L, N]``). A deep GP's ``core``
    gives ``S`` components ``[S, L, N]``, averaged as a mixture: ``E = avg_s mu_s``,
    ``Var = avg_s var_s + avg_s (mu_s - E)^2`` (the mixture of Salimbeni & Deisenroth 2017, section 3.3)."""

    def __init__(self, core, what, y_moments=None, deep=False, single=False):
        super().__init__()
        self.core, self.y_moments, self.what, self.deep, self.single = core, y_moments, tuple(what), deep, single

    def _mixture(self, mu, var):
        if not self.deep:
            return mu, var
        E = mu.mean(0)
        return E, var.mean(0) + (mu - E).square().mean(0)

    def forward(self, X):
        need_var = self.deep or any(w != "mean" for w in self.what)
        mu, var = self.core(X, need_var)
        out = {}
        out["mean"], out["var"] = self._mixture(mu, var)
        if self.y_moments is not None and ("y_mean" in self.what or "y_var" in self.what):
            out["y_mean"], out["y_var"] = self._mixture(*self.y_moments(mu, var))
        return tuple(out[w].squeeze(-2) if self.single else out[w].mT for w in self.what)
