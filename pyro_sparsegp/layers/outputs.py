r"""A layer's outputs: ``L`` independent outputs, or ``L`` outputs mixed from ``Q`` latent GPs by the linear model of
coregionalisation (LMC: Álvarez, Rosasco, Lawrence 2012, "Kernels for vector-valued functions: a review", section
4.2), and outputs that are missing from some rows of ``y``.

**LMC.** ``SVGP(kernel, Z, likelihood, num_outputs=L, num_latents=Q)`` has ``Q`` independent latent GPs ``g_q``, each
with its own ``q(u_q)``, and outputs ``f = W g (+ m(X))`` with a learnt ``W`` ``[L, Q]``. The marginals of ``q(f_n)``
are ``sum_q W_lq m_q(x_n)`` and ``sum_q W_lq^2 v_q(x_n)``, all that the bound of an element-wise likelihood needs:
``sum_{n,l} E_q[log p(y_nl | f_nl)] - sum_q KL[q(u_q) || p(u_q)]``. Sites: ``<name>.u`` ``[..., Q, 1, M]`` and
``<name>.f`` (the latent values ``g`` ``[..., Q, B]``) in the latents plate ``<name>.latents`` (``dim=-2``), ``y``
observed from ``W g`` in the outputs plate ``<name>.outputs`` (``dim=-2``): model and guide sample ``g`` from the same
``p(g | u)``, which cancels, so ``Trace_ELBO`` estimates that bound without bias.

**Missing outputs.** ``y`` ``[N, L]`` may hold ``NaN`` where an output is not observed: those entries are masked out
of the bound (``poutine.mask`` on the ``y`` site, with an observed value in their place so that no ``NaN`` reaches a
gradient; the closed-form bound sums the observed entries only). A row with no observed output is refused; a
``NaN`` where nothing can be masked (one output, a multi-class label, ``X``) stays an error.
"""

from __future__ import annotations

import contextlib
import math

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroParam
from torch.distributions import constraints

from ..checks.inputs import as_tensor, check_missing, fill_missing
from ..checks.validation import check_positive_int
from ..context import deferred
from ..context.composition import BoundModule, check_plate_alignment, layer_method
from ..context.composition import plate as data_plate
from ..distributions import MarginalizedLikelihood
from ..kernels import Separate

__all__ = ["Outputs", "as_kernel", "check_outputs", "mixing_matrix", "targets", "masked", "masked_sum",
           "check_targets"]


def as_kernel(kernel):
    """A list (or tuple) of kernels, one per latent GP or output, as a :class:`~pyro_sparsegp.kernels.Separate`
    kernel; any other kernel as it is. A module, not a tensor, so shapes do not apply (Álvarez, Rosasco, Lawrence
    2012, section 4.2: a covariance per latent function)."""
    return Separate(kernel) if isinstance(kernel, (list, tuple)) else kernel


def check_outputs(kernel, likelihood, num_outputs, num_latents) -> None:
    """``ValueError`` unless ``num_latents`` (``Q``) comes with ``num_outputs`` (``L``) and an element-wise
    likelihood, and a :class:`~pyro_sparsegp.kernels.Separate` kernel has one part per latent GP (``Q``) or, without
    ``num_latents``, per output (``L``). Argument checks of the LMC (Álvarez, Rosasco, Lawrence 2012, section 4.2);
    no tensors, so shapes do not apply."""
    check_positive_int(num_latents, "num_latents")
    if num_latents is not None and num_outputs is None:
        raise ValueError(f"num_latents={num_latents} mixes latent GPs into num_outputs=L outputs (f = W g, W [L, Q]): "
                         f"give num_outputs too (e.g. num_outputs=3, num_latents={num_latents}), or drop num_latents "
                         "for a single output")
    if num_latents is not None and getattr(likelihood, "latent_dim", 1) != 1:
        raise ValueError(f"num_latents needs an element-wise likelihood (one y per output): "
                         f"{type(likelihood).__name__} couples its {likelihood.latent_dim} latent functions, whose "
                         "expected log-likelihood assumes independent ones; drop num_latents")
    if isinstance(kernel, Separate):
        gps = num_outputs if num_latents is None else num_latents
        which = "num_outputs" if num_latents is None else "num_latents"
        if gps != len(kernel):
            raise ValueError(f"{len(kernel)} kernels (one per latent GP or output) but {which} = {gps}: give "
                             f"{which}={len(kernel)}, or one kernel per {'latent GP' if num_latents else 'output'}")


def mixing_matrix(W, num_outputs: int, num_latents: int | None, like) -> PyroParam | None:
    """The LMC's mixing ``W`` ``[L, Q]`` as a ``PyroParam`` (``f = W g``: the coefficients ``a_{d,q}`` of Álvarez,
    Rosasco, Lawrence 2012, section 4.2), in the dtype and device of ``like`` (the inducing variables). ``None``:
    entries drawn ``N(0, 1/Q)`` (each output starts with the latents' prior variance on average, and no two latents
    start interchangeable); else the given tensor, array or list, which must be finite and ``[L, Q]``. ``None``
    without ``num_latents`` (a ``W`` then raises)."""
    L, Q = num_outputs, num_latents
    if Q is None:
        if W is not None:
            raise ValueError("W is the LMC's mixing [L, Q]: give num_latents=Q (and num_outputs=L) with it")
        return None
    if W is None:
        W = torch.randn(L, Q, dtype=like.dtype, device=like.device) / math.sqrt(Q)
    else:
        W = as_tensor(W, "W", like.dtype, like.device)
        if tuple(W.shape) != (L, Q):
            raise ValueError(f"W must be [L, Q] = [{L}, {Q}] (num_outputs x num_latents: output l is sum_q W[l, q] "
                             f"g_q), got shape {tuple(W.shape)}")
        if not bool(torch.isfinite(W).all()):
            raise ValueError("W contains NaN or inf; give finite mixing weights")
    return PyroParam(W.detach().clone(), constraints.real)


def targets(y, per_output: bool):
    """The observations laid out like ``f``, with their mask: ``y`` ``[..., B, L]`` of ``L`` element-wise outputs
    becomes ``[..., L, B]`` filled where missing (:func:`~pyro_sparsegp.checks.inputs.fill_missing`), with ``mask``
    ``[..., L, B]`` (``None`` when nothing is missing); other ``y`` (one output, class labels) as it is, mask
    ``None``. Input handling: implements no paper equation."""
    if y is None or not per_output:
        return y, None
    return fill_missing(y.mT)


def masked(mask):
    """``poutine.mask(mask=mask)`` (a ``[..., L, B]`` mask of observed entries), or a null context for ``None``: the
    masked entries of an observed site drop out of ``Trace_ELBO``'s estimate of the bound (the data term of Hensman,
    Matthews, Ghahramani 2015, eq. 21, summed over the observed entries)."""
    return contextlib.nullcontext() if mask is None else poutine.mask(mask=mask)


def masked_sum(t: torch.Tensor, mask) -> torch.Tensor:
    """``t`` ``[..., L, B]`` summed over the entries ``mask`` keeps (every entry for ``None``): the expected
    log-likelihood of the observed entries only, ``sum_{(n, l) observed} E_q[log p(y_nl | f_nl)]`` (the data term of
    Hensman, Matthews, Ghahramani 2015, eq. 21). Returns ``()``."""
    return (t if mask is None else torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))).sum()


def check_targets(likelihood, y: torch.Tensor, per_output: bool) -> None:
    """The checks of ``y`` (``[..., N, L]`` of ``per_output`` element-wise outputs, else ``[..., N]``): a ``NaN`` among
    ``L`` outputs marks a missing one (a row with none observed is refused); elsewhere it is an error that says
    so; then the likelihood's own checks (finite, in its support). Skipped inside ``fit`` on a GPU, which checked
    ``y`` once (:mod:`pyro_sparsegp.context.deferred`). Input checking: implements no paper equation."""
    if likelihood is None or deferred.skip_reads():
        return
    if per_output:
        y = check_missing(y)
    elif y.is_floating_point() and bool(torch.isnan(y).any()):
        raise ValueError("y contains NaN or inf: a NaN marks a missing output only among the L outputs of a layer with "
                         "num_outputs=L and an element-wise likelihood (y [N, L]); with one output (or class labels) "
                         "nothing can be masked, so drop the rows whose y is NaN (keep = ~y.isnan(); X[keep], y[keep])")
    likelihood.check_y(y)


class Outputs:
    """Mixin of :class:`~pyro_sparsegp.SVGP`: the latents plate and mixing of an LMC layer (Álvarez, Rosasco, Lawrence
    2012, section 4.2), and the observed ``y`` site with missing outputs masked (module docstring). Expects
    ``name``, ``num_outputs``, ``num_latents``, ``likelihood``, ``integrate_f`` and ``strategy`` on the layer.
    ``g`` ``[..., Q, B]``, ``f`` and ``y`` ``[..., L, B]``."""

    num_latents = None  # Q of an LMC layer (set by the layer); None: independent outputs (also for older pickles)

    @property
    def num_latent_gps(self):
        """The independent GPs the strategy computes: ``Q = num_latents`` (LMC) or ``L = num_outputs`` (``None``
        for a single output). An int, not a tensor, so shapes do not apply."""
        return self.num_outputs if self.num_latents is None else self.num_latents

    def latents_plate(self):
        """The LMC layer's latents plate (``<name>.latents``, ``dim=-2``, size ``Q``) as drawn in this program by
        :meth:`sample_u` (its outputs plate for independent outputs, a null context for a single output): the plate
        of the sites ``<name>.u`` ``[..., Q, 1, M]`` and ``<name>.f`` ``[..., Q, B]``."""
        return self._latents_plate()

    def _latents_plate(self, new: bool = False):
        if self.num_latents is None:
            return self._outputs_plate(new)
        if new:
            self._outputs_plate(new=True)  # both plates are built once per program, here (sample_u)
        if new or getattr(self, "_lplate", None) is None:
            self._lplate = data_plate(f"{self.name}.latents", self.num_latents, dim=-2)
        return self._lplate

    @layer_method
    def latent_qf(self, X: torch.Tensor, consume: bool = False):
        """Marginals ``(loc, var)`` of the GPs the strategy computes at ``X`` ``[..., B, D]``: an LMC layer's ``Q``
        latents ``[..., Q, B]`` (no mean function: it belongs to the outputs), else the same as :meth:`qf` without
        the mean function (Hensman, Matthews, Ghahramani 2015, eq. 19, diagonal)."""
        return self.strategy.latent_qf(X, consume)

    def _sample_site(self, X, u, guide):
        """``(site value, f)``: the latents ``g`` ``[..., Q, B]`` and ``W g + m(X)`` ``[..., L, B]`` for an LMC layer,
        ``(f, f)`` otherwise; the site ``<name>.f`` drawn from ``p(f | u)`` (``p(g | u)``) in the latents plate."""
        with self._latents_plate():
            fn = self.conditional(X, u, consume=not guide)
            check_plate_alignment(fn.loc, f"{self.name}.f", None if self.num_latent_gps is None else -2)
            g = pyro.sample(f"{self.name}.f", fn)
        return g, (g if self.num_latents is None else self.strategy.mix_sample(g) + self._mean(X))

    def _site_mean(self, X):
        """The mean function as the ``<name>.f`` site carries it: in ``f`` (``[..., L, B]``), not in an LMC's ``g``."""
        return self._mean(X) if self.num_latents is None else 0.0

    def _per_output(self) -> bool:
        return self.num_outputs is not None and self.likelihood is not None and self.likelihood.latent_dim == 1

    def _observe(self, f_or_q, y):
        """Model side: ``y`` (``[..., B, L]``, ``NaN`` where missing) observed from ``f`` ``[..., L, B]`` (or from the
        moments ``(loc, var)`` with ``integrate_f``) in the outputs plate, its missing entries masked out."""
        lik = self.likelihood
        if lik is None:
            return
        y, mask = targets(y, self._per_output())
        with self._outputs_plate() if lik.latent_dim == 1 else contextlib.nullcontext(), masked(mask):
            if self.integrate_f:
                pyro.sample("y", MarginalizedLikelihood(BoundModule(lik), *f_or_q), obs=y)
            else:
                lik(f_or_q, y, prefix=self.name)

    def _observe_guide(self, X, y):
        """Guide side: the likelihood's own sites (e.g. Pólya-Gamma ``omega``) at the minibatch ``X`` ``[..., B, D]``,
        masked where ``y`` ``[..., B, L]`` is missing as the model masks them."""
        if self.likelihood is None:
            return
        _, mask = targets(y, self._per_output())
        with self._outputs_plate() if self.likelihood.latent_dim == 1 else contextlib.nullcontext(), masked(mask):
            self.likelihood.guide(lambda: self.qf(X), prefix=self.name)
