r"""The predictive moments of ``y*`` in an exported program, from the marginals ``N(mu, v)`` of ``q(f*)``
(``mu``, ``v`` ``[..., L, N]``), in closed form where the likelihood has one, with its parameters as buffers:

* :class:`~pyro_sparsegp.Gaussian`: ``E y = mu``, ``Var y = v + sigma^2``;
* :class:`~pyro_sparsegp.Bernoulli` (and :class:`~pyro_sparsegp.PolyaGammaLogit`): ``E y = p(y = 1)``,
  ``Var y = p (1 - p)``, with the probit's ``p = Phi(mu / sqrt(1 + v))`` or the logit's ``E sigma(f)`` by
  Gauss-Hermite quadrature on a fixed rule of ``max(100, num_gh)`` nodes, baked in as constants (the most
  :meth:`~pyro_sparsegp.Likelihood.num_nodes` takes, exact to 1e-10 for ``sd(f) <= 10``);
* :class:`~pyro_sparsegp.Poisson` and :class:`~pyro_sparsegp.NegativeBinomial` (log link): the log-normal moments
  ``E e^f = e^{mu + v/2}``, ``E e^{2f} = e^{2 mu + 2 v}``, so ``E y = e^{mu + v/2}`` and ``Var y`` is the mean of
  the conditional variance plus the variance of the conditional mean (Poisson: ``E e^f + Var e^f``; NB2: plus
  ``alpha E e^{2f}``; NB1: ``(1 + alpha) E e^f + Var e^f``);
* :class:`~pyro_sparsegp.StudentT` (``df > 2``): ``E y = mu``, ``Var y = v + sigma^2 df / (df - 2)``.

Any other likelihood raises ``ValueError`` listing these: export ``what=("mean", "var")`` of ``f`` and apply your
likelihood to them.
"""

from __future__ import annotations

import torch

from ..likelihoods import Bernoulli, Gaussian, NegativeBinomial, Poisson, StudentT
from ..linalg import gauss_hermite

__all__ = ["y_moments", "SUPPORTED"]

SUPPORTED = ("Gaussian, Bernoulli (probit, logit), PolyaGammaLogit, Poisson, NegativeBinomial (NB2, NB1), "
             "StudentT (df > 2)")


class _Moments(torch.nn.Module):
    """``(E y, Var y)`` ``[..., L, N]`` from ``(mu, v)`` ``[..., L, N]`` (module docstring); ``kind`` picks the
    family, ``c`` ``()`` holds its parameter (noise variance, dispersion, ``sigma^2 df / (df - 2)``), ``x``, ``w``
    ``[n]`` a fixed Gauss-Hermite rule (logit)."""

    def __init__(self, kind: str, c=None, nodes=None):
        super().__init__()
        self.kind = kind
        self.register_buffer("c", torch.zeros(()) if c is None else c.detach().clone())
        x, w = nodes if nodes is not None else (torch.zeros(1), torch.ones(1))
        self.register_buffer("x", x.clone())  # own storage each: torch.export.save packs buffers by storage
        self.register_buffer("w", w.clone())

    def forward(self, mu, v):
        if self.kind in ("gaussian", "studentt"):
            return mu, v + self.c
        if self.kind == "probit":
            p = 0.5 * (1 + torch.erf(mu / (2 * (1 + v)).sqrt()))  # Phi(mu / sqrt(1 + v))
            return p, p * (1 - p)
        if self.kind == "logit":
            p = (torch.sigmoid(mu.unsqueeze(-1) + v.sqrt().unsqueeze(-1) * self.x) * self.w).sum(-1)
            return p, p * (1 - p)
        m1, m2 = torch.exp(mu + 0.5 * v), torch.exp(2 * mu + 2 * v)  # E e^f, E e^{2f}
        spread = m2 - m1.square()  # Var e^f
        if self.kind == "nb2":
            return m1, m1 + self.c * m2 + spread
        if self.kind == "nb1":
            return m1, (1 + self.c) * m1 + spread
        return m1, m1 + spread  # poisson


def y_moments(likelihood, dtype) -> torch.nn.Module:
    """The :class:`_Moments` module of ``likelihood`` in ``dtype`` (it maps ``[..., L, N]`` to ``[..., L, N]``);
    ``ValueError`` naming the supported families."""
    if isinstance(likelihood, Gaussian):
        return _Moments("gaussian", likelihood.noise.detach().to(dtype))
    if isinstance(likelihood, Bernoulli):
        if likelihood.link == "probit":
            return _Moments("probit")
        x, w = gauss_hermite(max(100, likelihood.num_gh), dtype)
        return _Moments("logit", nodes=(x, w))
    if isinstance(likelihood, Poisson):
        return _Moments("poisson")
    if isinstance(likelihood, NegativeBinomial):
        return _Moments(likelihood.variance.lower(), likelihood.dispersion.detach().to(dtype))
    if isinstance(likelihood, StudentT):
        df = float(likelihood.df.detach())
        if df > 2:
            return _Moments("studentt", (likelihood.scale.detach().square() * df / (df - 2)).to(dtype))
        raise ValueError(f"export: a StudentT with df = {df:.3g} <= 2 has no predictive variance; export "
                         "what=('mean', 'var') of f instead")
    name = "None (a hidden layer)" if likelihood is None else type(likelihood).__name__
    raise ValueError(f"export: what='y_mean'/'y_var' needs closed-form predictive moments, and the likelihood is "
                     f"{name}; supported: {SUPPORTED}. Export what=('mean', 'var') of f and apply the likelihood "
                     "to them (its predictive(mean, var) in eager code)")

