r"""The exact last step of a conjugate layer: q(u) and the Gaussian noise set to their optimum on all the data, given
the kernel's hyperparameters and the inducing inputs.

A minibatch natural-gradient step of length :math:`\rho` leaves q(u) and the noise fluctuating about the plateau: the
last iterate is one sample of that fluctuation, and on heavy-tailed data (flight delays) one outlier minibatch near
the end moves the noise and q(u) far from the plateau's centre for tens of steps. For a
:class:`~pyro_sparsegp.Gaussian` likelihood the step of length 1 on the *whole* data set is exact (Hensman, Fusi,
Lawrence 2013, section 3.2: the natural-gradient step of length 1 lands on the optimum of a conjugate bound), so one
pass over the data finishes the run deterministically. With :math:`A = L_{uu}^{-1}K_{uf}` (whitened; :math:`K_{uu}^{-1}
K_{uf}` otherwise), prior precision :math:`P` (:math:`I` whitened, :math:`K_{uu}^{-1}` otherwise), the pass gathers

.. math:: G = \sum_n a_n a_n^T,\quad b = \sum_n a_n y_n,\quad s = \sum_n y_n^2,\quad
          t = \sum_n \big(k_{nn} - q_{nn}\big),

and then alternates the two exact coordinate steps of the bound

.. math:: S = (P + G/\sigma^2)^{-1},\quad m = S\,b/\sigma^2; \qquad
          \sigma^2 = \tfrac1n\big(s - 2m^Tb + m^TGm + \mathrm{tr}(GS) + t\big)

(the first is Titsias 2009's optimal q(u); the second the noise's optimum given q(f), the fixed point of
:func:`~pyro_sparsegp.infer.natgrad.noise_step_from_grads_`). Each raises the full-data bound, so they converge to the
noise that maximises the collapsed bound of Titsias (2009) at the current hyperparameters, with q(u) its optimum: the
centre of the plateau, not a sample from it. The pass costs :math:`O(NM^2)` once (as :math:`N/B` forward passes
without gradients); the alternations :math:`O(M^3)` each, independent of :math:`N`.
"""

from __future__ import annotations

import torch

from ..likelihoods import Gaussian
from .natgrad.closed_forms import _A, _prior_natural, _squeeze_outputs, _targets
from .natgrad.families import noise_natgrad_likelihood
from .natgrad.from_grads import _set_constrained

__all__ = ["exact_finish_", "supports_exact_finish"]


def supports_exact_finish(module) -> bool:
    """Whether :func:`exact_finish_` applies to ``module``: an :class:`~pyro_sparsegp.SVGP` (one set of inducing
    variables, q(u) with a full covariance) with a :class:`~pyro_sparsegp.Gaussian` likelihood and no mean function,
    the layers whose bound is conjugate in q(u) (Titsias 2009; Hensman, Fusi, Lawrence 2013, section 3.2). No
    tensors, so shapes do not apply."""
    from ..layers import SVGP
    from ..layers.solvegp import OrthogonalInputs

    q = getattr(module, "q_u", None)
    return (isinstance(module, SVGP) and not isinstance(module, OrthogonalInputs)
            and isinstance(module.likelihood, Gaussian) and getattr(module, "mean_function", None) is None
            and q is not None and getattr(q, "learn_scale", False))


@torch.no_grad()
def _statistics(svgp, batches):
    """``(G [..., M, M], b [..., M], s [...], t [...], n, Luu [..., M, M])``: the sums of the module docstring in
    float64 over the ``(X [B, D], y [B] or [B, L])`` of ``batches``, the number of rows ``n`` and ``chol(Kuu)``."""
    G = b = s = t = Luu = None
    n = 0
    for X, y in batches:
        X, y = svgp.check_inputs(X, y)
        Luu, W, kdiag = _squeeze_outputs(svgp, *svgp.strategy.factors(X, consume=True))
        A = _A(svgp, Luu, W)  # [(L,) M, B]
        yt = _targets(svgp, y).to(A.dtype)  # [(L,) B]
        parts = (A @ A.mT, (A @ yt.unsqueeze(-1)).squeeze(-1), yt.pow(2).sum(-1),
                 (kdiag - W.pow(2).sum(-2)).clamp(min=0).sum(-1))
        parts = [p.double() for p in parts]
        G, b, s, t = parts if G is None else [old + new for old, new in zip((G, b, s, t), parts, strict=True)]
        n += X.shape[-2]
    if G is None:
        raise ValueError("exact_finish_ got no batches")
    return G, b, s, t, n, Luu


def _reduce_over_ranks(tensors, n):
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensors, n
    flat = torch.cat([x.reshape(-1) for x in tensors] + [torch.tensor([float(n)], dtype=torch.float64,
                                                                          device=tensors[0].device)])
    torch.distributed.all_reduce(flat)
    out, i = [], 0
    for x in tensors:
        out.append(flat[i: i + x.numel()].reshape(x.shape))
        i += x.numel()
    return out, int(round(flat[-1].item()))


def _optimal_q(P, G, b, noise):
    """Titsias's optimal ``(m [..., M], S [..., M, M])`` for the noise variance ``noise`` (float64)."""
    prec = P + G / noise
    Lp = torch.linalg.cholesky(0.5 * (prec + prec.mT))
    S = torch.cholesky_inverse(Lp)
    return (S @ b.unsqueeze(-1)).squeeze(-1) / noise, S


@torch.no_grad()
def exact_finish_(svgp, batches, num_data: int | None = None, max_iter: int = 500, tol: float = 1e-10) -> int:
    r"""Set q(u) and the learnable noise of ``svgp`` to their joint optimum on the data of ``batches`` (module
    docstring: Titsias 2009's optimal q(u) alternated with the noise's optimum, Hensman, Fusi, Lawrence 2013, eq. 4),
    in place. Under an initialised ``torch.distributed`` process group each rank passes its own share of
    the data and the statistics are summed over ranks.

    :param svgp: a module for which :func:`supports_exact_finish` holds.
    :param batches: an iterable of ``(X [B, D], y [B] or [B, L])`` covering the data once.
    :param num_data: the data set's size ``N`` if ``batches`` cover only part of it (a loader that drops its last
        batch): the statistics are scaled by ``N / n``, as the minibatch bound is. Default: the rows seen.
    :param max_iter: at most this many alternations (q(u), then the noise).
    :param tol: stop when the noise's relative change is below ``tol``.
    :returns: the number of alternations taken (0 for a fixed noise: q(u) alone is set, once).
    """
    if not supports_exact_finish(svgp):
        raise TypeError(f"exact_finish_ needs an SVGP with a Gaussian likelihood and no mean function, got "
                        f"{type(svgp).__name__} with {type(getattr(svgp, 'likelihood', None)).__name__}")
    G, b, s, t, n, Luu = _statistics(svgp, batches)
    (G, b, s, t), n = _reduce_over_ranks([G, b, s, t], n)
    scale = 1.0 if num_data is None else num_data / n
    G, b, s, t = G * scale, b * scale, s * scale, t * scale
    count = (num_data or n) * (b.shape[0] if b.dim() == 2 else 1)  # scalar observations sharing the noise
    P = -2 * _prior_natural(svgp, Luu.double())
    P = P.expand_as(G)
    lik = noise_natgrad_likelihood(svgp)
    noise = svgp.likelihood.noise.detach().double()
    m, S = _optimal_q(P, G, b, noise)
    steps = 0
    while lik is not None and steps < max_iter:
        resid = s - 2 * (m * b).sum(-1) + (m * (G @ m.unsqueeze(-1)).squeeze(-1)).sum(-1) + (G * S).sum((-2, -1))
        new = ((resid + t).sum() / count).clamp(min=torch.finfo(torch.float64).tiny)
        steps += 1
        change = float((new - noise).abs() / noise)
        noise = new
        m, S = _optimal_q(P, G, b, noise)
        if change < tol:
            break
    dtype = svgp.q_u.u_loc.dtype
    svgp.q_u.set(m.to(dtype), torch.linalg.cholesky(S).to(dtype))
    if lik is not None:
        _set_constrained(lik, "noise", lik.noise_unconstrained, noise.to(lik.noise_unconstrained.dtype))
    return steps
