r"""Iterate averaging for q(u) and the Gaussian noise at the end of training.

With a noisy gradient (minibatches, a Monte Carlo ELBO) a constant step length leaves q(u) and the noise variance
fluctuating about the plateau: the last iterate is a sample from that fluctuation. Polyak and Juditsky (1992),
"Acceleration of stochastic approximation by averaging" (SIAM J. Control Optim. 30(4)), show that the average of
the iterates of a constant-step stochastic approximation converges at the optimal rate; :class:`IterateAverage`
keeps the arithmetic (Polyak-Ruppert) average over the steps from ``start`` on and writes it into the module at the
end, so that the final model is the centre of the plateau rather than one draw from it.

What is averaged: for each full-covariance :class:`~pyro_sparsegp.variational.GaussianQ`
:math:`q = N(m, LL^T)` its natural parameters :math:`(\Lambda m, \Lambda)`, :math:`\Lambda = (LL^T)^{-1}` (those
the natural-gradient step of Hensman, Fusi, Lawrence 2013, section 3.2, moves linearly; an average of precisions is
positive definite), written back as :math:`\bar\Lambda^{-1}\overline{\Lambda m}` and :math:`\mathrm{chol}
(\bar\Lambda^{-1})`; for each :class:`~pyro_sparsegp.Gaussian` likelihood with a learnable noise, its variance
:math:`\sigma^2` (the quantity the Fisher-scoring step moves linearly). The sums are kept in float64 whatever the
module's dtype. Hyperparameters trained by Adam are left as they are.
"""

from __future__ import annotations

import torch

from ...context.reporting import family_layer, warn
from .from_grads import _set_constrained

__all__ = ["IterateAverage", "MAX_CONDITION"]

MAX_CONDITION = 1e10  # an averaged precision worse conditioned than this (float64: 6 digits left) is not used


class IterateAverage:
    r"""Running Polyak-Ruppert average (Polyak and Juditsky 1992) of q(u)'s natural parameters (those of Hensman,
    Fusi, Lawrence 2013, section 3.2) and of the noise variance (module docstring).

    :param families: the full-covariance ``GaussianQ`` modules (``u_loc [..., M]``, ``u_scale_tril [..., M, M]``).
    :param noises: :class:`~pyro_sparsegp.Gaussian` likelihoods whose learnable noise (a scalar ``()``) to average.
    :param int start: the first step (as counted by the caller of :meth:`update`) whose iterate enters the average.
    :param bool warn: a ``RuntimeWarning`` when a family keeps its last iterate (:meth:`averages`); either way its
        name goes to ``kept``.

    Call :meth:`update(step) <update>` after each step (with the number of the step just taken, from 0), then
    :meth:`write_` to put the average into the modules. :meth:`mark` and :meth:`rewind` let a caller that redoes a
    window of steps (``fit`` on an accelerator) drop the window's contributions.
    """

    def __init__(self, families, noises=(), start: int = 0, warn: bool = True):
        self.families, self.noises, self.start = list(families), list(noises), int(start)
        self.warn, self.kept = warn, []  # the names of families whose last iterate was kept (not averaged)
        self.count = 0
        self.sums = None  # [(sum Lambda m [..., M], sum Lambda [..., M, M]) per family] + [sum sigma^2 () per noise]
        self._mark = (0, None)

    @staticmethod
    @torch.no_grad()
    def natural(q) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(Lambda m [..., M], Lambda [..., M, M])`` of ``q`` in float64 (:math:`\Lambda = (LL^T)^{-1}`)."""
        m, L = q.u_loc.detach().double(), q.u_scale_tril.detach().double()
        prec = torch.cholesky_inverse(L)
        return (prec @ m.unsqueeze(-1)).squeeze(-1), 0.5 * (prec + prec.mT)

    @torch.no_grad()
    def _current(self) -> list:
        out = [t for q in self.families for t in self.natural(q)]
        return out + [lik.noise.detach().double().clone() for lik in self.noises]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Add the current iterate to the average if ``step >= start`` (``step``: the number of the step just taken;
        an ``int``, so shapes do not apply)."""
        if step < self.start:
            return
        cur = self._current()
        if self.sums is None:
            self.sums = [t.clone() for t in cur]
        else:
            torch._foreach_add_(self.sums, cur)
        self.count += 1

    def mark(self) -> None:
        """Remember the average as it is now (the start of a window of steps that may be redone; no tensors in or
        out, so shapes do not apply)."""
        self._mark = (self.count, None if self.sums is None else [t.clone() for t in self.sums])

    def rewind(self) -> None:
        """Back to the average at the last :meth:`mark` (a redone window's steps are counted once; no tensors in or
        out, so shapes do not apply)."""
        self.count, sums = self._mark
        self.sums = None if sums is None else [t.clone() for t in sums]

    @torch.no_grad()
    def averages(self) -> list:
        """The averages, in float64: per family ``(m [..., M], L [..., M, M])``, then per noise ``sigma^2 ()``
        (empty if no step was averaged). A family whose averaged precision is not positive definite in float64, or
        has a condition number above :data:`MAX_CONDITION` (estimated from its Cholesky factor's diagonal), keeps its
        last iterate, with a ``RuntimeWarning`` naming it (unless ``warn=False``), and its name goes to ``kept``."""
        if not self.count:
            return []
        mean = [t / self.count for t in self.sums]
        out = []
        for i, q in enumerate(self.families):
            eta1, prec = mean[2 * i], mean[2 * i + 1]
            Lp, info = torch.linalg.cholesky_ex(prec)
            d = Lp.diagonal(dim1=-2, dim2=-1).abs()
            # a lower bound on the condition number: above MAX_CONDITION the solve for the mean loses its digits
            ok = not bool((info > 0).any()) and bool(((d.amax(-1) / d.amin(-1)) ** 2 < MAX_CONDITION).all())
            if ok:
                S = torch.cholesky_inverse(Lp)
                m = torch.cholesky_solve(eta1.unsqueeze(-1), Lp).squeeze(-1)
                L, info = torch.linalg.cholesky_ex(0.5 * (S + S.mT))
                ok = not bool((info > 0).any()) and bool(torch.isfinite(L).all() and torch.isfinite(m).all())
            if not ok:
                self.kept.append(q._pyro_name or type(q).__name__)
                if self.warn:
                    warn(
                        f"iterate average: the averaged precision of {self.kept[-1]!r} is not positive definite, or "
                        f"too ill-conditioned, in float64 (its iterates' covariances are near singular, e.g. a deep "
                        f"GP's hidden q(u) still near its 1e-5 initial scale, trained by Adam); it keeps its last "
                        f"iterate. Average fewer, later steps (a smaller average) or train longer to average it",
                        RuntimeWarning, layer=family_layer(q))
                m, L = q.u_loc.detach().double(), q.u_scale_tril.detach().double()
            out.append((m, L))
        return out + mean[2 * len(self.families):]

    @torch.no_grad()
    def write_(self) -> bool:
        """Write the averages into the families and noises in place (their unconstrained tensors keep their identity,
        so an optimiser holding them stays valid; no tensors in or out, so shapes do not apply). Returns whether
        anything was averaged."""
        avg = self.averages()
        if not avg:
            return False
        for q, (m, L) in zip(self.families, avg, strict=False):
            dtype = q.u_loc.dtype
            _set_constrained(q, "u_loc", q.u_loc_unconstrained, m.to(dtype))
            _set_constrained(q, "u_scale_tril", q.u_scale_tril_unconstrained, L.to(dtype))
        for lik, var in zip(self.noises, avg[len(self.families):], strict=True):
            _set_constrained(lik, "noise", lik.noise_unconstrained, var.to(lik.noise.dtype))
        return True
