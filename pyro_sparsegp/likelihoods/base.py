r"""The likelihood base class: the distribution of ``y`` given latent ``f``, the expected log-likelihood under
:math:`q(f_n) = N(\mu_n, \sigma^2_n)` by Gauss-Hermite quadrature (Hensman, Matthews, Ghahramani 2015, section 4),
and the predictive distribution; the finite check on observations; the registry of live Gaussian likelihoods.

Shapes: element-wise likelihoods take ``f`` ``[..., B]`` and give ``y`` ``[..., B]``.
"""

from __future__ import annotations

import math
import numbers
import weakref

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch.distributions import constraints

from ..checks.inputs import _type_name
from ..context import deferred
from ..context.composition import seed_context
from ..linalg import gauss_hermite

__all__ = ["Likelihood", "live_gaussian_likelihoods", "check_likelihood"]

_LIVE_GAUSSIAN = weakref.WeakSet()  # every Gaussian likelihood alive: NaturalGradient's noise step finds them here


def live_gaussian_likelihoods() -> list:
    """The :class:`Gaussian` likelihoods alive in this process (weak references), each with a scalar ``()`` noise:
    those whose noise :class:`~pyro_sparsegp.infer.NaturalGradient` may step (Hensman, Fusi, Lawrence 2013, eq. 4)."""
    return list(_LIVE_GAUSSIAN)


def check_likelihood(likelihood) -> None:
    """A layer's ``likelihood`` argument: ``None`` or a :class:`Likelihood` that defines ``distribution(f)``; else
    ``TypeError`` naming what was given and the fix. No tensors, so shapes do not apply; argument checking:
    implements no paper equation."""
    if likelihood is not None and not isinstance(likelihood, Likelihood):
        raise TypeError(
            f"likelihood must be a pyro_sparsegp Likelihood (e.g. ps.Gaussian()) or None, got {_type_name(likelihood)}"
        )
    if likelihood is not None and type(likelihood).distribution is Likelihood.distribution:
        raise TypeError(f"{type(likelihood).__name__} must define distribution(f), the distribution of y given f "
                        "[..., B] with batch shape [..., B] (docs/extending.md: 'Your own kernel, likelihood or mean "
                        "function')")


def _check_finite(name, t):
    if deferred.skip_reads():  # fit checked the data once, or a compiler traces (context/deferred.py)
        return
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")


def _init_param(value, name: str, lower: float = 0.0, upper: float | None = None, example: str = "") -> torch.Tensor:
    """The initial value of a likelihood's parameter as a scalar ``()`` tensor of the default dtype, checked to be
    one finite number in ``(lower, upper)``; ``ValueError`` naming ``name``, the range and an example otherwise."""
    t = torch.as_tensor(value, dtype=torch.get_default_dtype()).detach()
    ok = t.numel() == 1 and bool(torch.isfinite(t).all()) and bool((t > lower).all())
    ok = ok and (upper is None or bool((t < upper).all()))
    if not ok:
        what = f"in ({lower:g}, {upper:g})" if upper is not None else f"greater than {lower:g}"
        raise ValueError(f"{name} must be one finite number {what}, got {value!r}" + (f"; e.g. {example}" if example
                                                                                       else ""))
    return t.reshape(()).clone()


class Likelihood(PyroModule):
    """Base class. Subclasses define :meth:`distribution` and ``support``; may override
    :meth:`expected_log_prob` and :meth:`predictive` with closed forms. Element-wise likelihoods take ``f`` and the
    marginals ``f_loc``, ``f_var`` of shape ``[..., B]`` and observations ``y`` ``[..., B]``. The expected
    log-likelihood is the data term of the bound of Hensman, Matthews, Ghahramani 2015, eq. 21, integrated by
    Gauss-Hermite quadrature (their section 4).

    :param int num_gh: number of Gauss-Hermite nodes of the generic expected log-likelihood.
    """

    support = constraints.real
    #: number of latent function values each observation depends on (``1``: element-wise)
    latent_dim = 1
    #: what a valid ``y`` is and how to fix one that is not, appended to :meth:`check_y`'s error
    _y_fix = ""
    #: the standard deviation of ``q(f)`` up to which :meth:`num_nodes` keeps ``num_gh`` nodes (then it grows them
    #: in proportion); 1 for likelihoods whose log-density bends faster than ``log sigmoid`` (Beta, zero inflation)
    _node_sd = 2.0

    def __init__(self, num_gh: int = 20):
        super().__init__()
        if isinstance(num_gh, bool) or not isinstance(num_gh, numbers.Integral) or num_gh < 1:
            raise ValueError(f"num_gh (Gauss-Hermite nodes) must be a positive integer, got {num_gh!r}")
        self.num_gh = int(num_gh)

    def __getattr__(self, name: str):
        """Pyro's attribute look-up, except that a ``PyroSample`` attribute (e.g. a hyperprior on the noise) read
        outside a Pyro program raises instead of returning a fresh draw from its prior: outside the module's context
        (a layer method, SVI, ``Predictive``) Pyro ignores ``poutine.condition``/``replay`` and samples the prior at
        every read, so ``var + gp.likelihood.noise`` after training would add a random prior draw. A ``PyroSample``
        of a fixed tensor is returned as Pyro does."""
        samples = self.__dict__.get("_pyro_samples")
        if samples is not None and name in samples and not isinstance(samples[name], torch.Tensor):
            context = self.__dict__.get("_pyro_context")
            if context is not None and not context.active:
                raise RuntimeError(
                    f"{type(self).__name__}.{name} is a PyroSample (a prior), and read outside a Pyro program Pyro "
                    "draws it from the prior at every read, ignoring poutine.condition/replay. Take its value from "
                    "your guide (e.g. guide.median()), or predict y with gp.predict(X, full=True) under "
                    "poutine.condition(data=...) or poutine.replay(trace=...): that predictive distribution uses the "
                    "conditioned value.")
        return super().__getattr__(name)

    def num_nodes(self, f_var: torch.Tensor) -> int:
        """Gauss-Hermite nodes for q(f) of variance ``f_var``: ``num_gh`` while every standard deviation is at most
        2, else ``num_gh * sd_max / 2`` (at most ``max(100, num_gh)``; a subclass may set ``_node_sd`` in place of
        2). Likelihoods with a kink on the scale of 1
        (``log sigmoid``, ``log Phi``) make the quadrature converge slowly in the width of q(f): measured for
        Bernoulli (worst over means within 3 sd), 20 nodes err by 1.4e-6 nats at sd 2, 6.7e-4 at sd 4, 2.5e-3 at
        sd 5, 1.8e-2 at sd 8; the rule keeps it to 3e-5 at sd 4, 1e-4 at sd 5, 3e-4 at sd 8, 1.4e-3 at sd 12
        (capped at 100 nodes, 1e-2 at sd 20). Inside :func:`~pyro_sparsegp.context.deferred.deferred_checks` (``fit`` on
        a GPU), where ``sd_max`` is not read back, the cap (never fewer nodes than the rule would take). ``f_var`` has
        any shape (``[..., B]``); returns an ``int``.
        Implements no paper equation: a numerical rule for the quadrature of Hensman et al. 2015, section 4."""
        if f_var.numel() == 0:
            return self.num_gh
        if deferred.skip_reads():
            return max(100, self.num_gh)
        sd = float(f_var.detach().max().clamp(min=0).sqrt()) * 2.0 / self._node_sd
        if not sd > 2.0:  # also NaN: the likelihood's own checks report it
            return self.num_gh
        return min(max(100, self.num_gh), max(self.num_gh, math.ceil(self.num_gh * min(sd, 1e6) / 2)))

    def _as_values(self, y, f):
        """Observations as floats of ``f``'s dtype (integer or boolean labels of a real-valued support)."""
        y = torch.as_tensor(y, device=f.device)
        return y if y.dtype == f.dtype else y.to(f.dtype)

    # -- the observation model ---------------------------------------------------------------------------------
    def distribution(self, f: torch.Tensor) -> dist.Distribution:
        """Distribution of ``y`` given ``f`` ``[..., B]``; batch shape ``[..., B]``. The factor
        :math:`p(y_n | f_n)` of the factorising likelihood (Hensman et al. 2015, section 4)."""
        raise NotImplementedError(f"{type(self).__name__} must define distribution(f)")

    def y_shape(self, f_shape: torch.Size) -> torch.Size:
        """Batch shape of ``y`` for latent values of shape ``f_shape`` (``[..., B]`` gives ``[..., B]`` for
        element-wise likelihoods). Shape bookkeeping only: implements no paper equation."""
        return torch.Size(f_shape)

    def check_y(self, y: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``y`` (any shape, e.g. ``[..., B]``) is not finite or outside the support.
        An argument check: implements no paper equation (see the class docstring for the section it serves)."""
        _check_finite("y", y)
        ok = self.support.check(y)
        if not bool(ok.all()):
            bad = torch.unique(y.detach()[~ok].reshape(-1).cpu())
            shown = ", ".join(f"{v:g}" for v in bad[:5].tolist()) + (", ..." if len(bad) > 5 else "")
            extra = ("; binary labels are 0 and 1 (map -1/1 labels with y = (y > 0), 1/2 labels with y - 1)"
                     if str(self.support) == "Boolean()" else self._y_fix)
            raise ValueError(f"y has values outside the support of {type(self).__name__} ({self.support}): "
                             f"{shown}{extra}")

    def forward(self, f: torch.Tensor, y: torch.Tensor | None = None, name: str = "y", prefix: str = "gp"):
        """Model side: register the observed site ``name`` with ``y ~ distribution(f)`` (call inside the data
        plate). ``prefix`` names any auxiliary site a likelihood adds (``<prefix>.omega``)."""
        if y is not None:
            if not deferred.skip_reads():  # else fit checked y once (context/deferred.py)
                self.check_y(y)
            y = self._as_values(y, f)
        seed_context(self)
        return pyro.sample(name, self.distribution(f), obs=y)

    def guide(self, qf, prefix: str = "gp") -> None:
        """Guide side, inside the data plate: sample the variational distributions of auxiliary sites, if any.
        ``qf()`` returns the marginals ``(f_loc, f_var)``, each ``[..., B]``, of q(f) on the minibatch (Hensman et
        al. 2015, eq. 19). The default has none."""

    # -- expectations under q(f) -----------------------------------------------------------------------------
    def quadrature_expected_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        r""":math:`\int N(f; \mu, \sigma^2) \log p(y|f) df \approx \sum_i w_i \log p(y | \mu + \sigma x_i)`
        with :meth:`num_nodes` nodes (Hensman, Matthews, Ghahramani 2015, section 4: the one-dimensional integrals
        of the expected log-likelihood in eq. 21). ``y``, ``f_loc``, ``f_var`` broadcast to ``[..., B]``; returns
        ``[..., B]``."""
        component, w = self._at_nodes(f_loc, f_var)
        logp = component.log_prob(self._as_values(y, f_loc).unsqueeze(-1))  # [..., B, n]
        return (logp * w).sum(-1)

    def expected_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        """:math:`E_{N(f; f_{loc}, f_{var})}[\\log p(y|f)]`, shape ``y_shape(f_loc.shape)``: the per-point
        expected log-likelihood of Hensman, Matthews, Ghahramani 2015, eq. 21 (by quadrature, section 4)."""
        return self.quadrature_expected_log_prob(y, f_loc, f_var)

    def predictive(self, f_loc, f_var) -> dist.Distribution:
        """Predictive distribution of ``y*`` given ``q(f*) = N(f_loc, f_var)``, ``f_loc``, ``f_var`` ``[..., B]``;
        batch shape ``[..., B]``. :math:`p(y_*) = \\int p(y_*|f_*) q(f_*) df_*` with :math:`q(f_*)` the marginal
        of Hensman et al. 2015, eqs. 18-19. The default is that integral by Gauss-Hermite quadrature (as
        :meth:`quadrature_expected_log_prob`): a mixture of ``distribution(f_i)`` at the nodes
        :math:`f_i = \\mu + \\sigma x_i` with the weights :math:`w_i`, whose ``log_prob``, ``mean`` and ``sample``
        work for any element-wise likelihood; subclasses override it with a closed form."""
        component, w = self._at_nodes(f_loc, f_var)
        return dist.MixtureSameFamily(dist.Categorical(probs=w.expand(component.batch_shape)), component)

    def _at_nodes(self, f_loc, f_var):
        """``(distribution(f) [..., B, n], w [n])`` at the Gauss-Hermite nodes ``f = f_loc + sqrt(f_var) x`` of
        :meth:`num_nodes` points; ``ValueError`` for a distribution with event dimensions (these defaults integrate
        element-wise factors)."""
        x, w = gauss_hermite(self.num_nodes(f_var), f_loc.dtype, f_loc.device)
        component = self.distribution(f_loc.unsqueeze(-1) + f_var.sqrt().unsqueeze(-1) * x)  # [..., B, n]
        if component.event_shape != torch.Size():
            raise ValueError(f"{type(self).__name__}.distribution(f) must have batch shape [..., B] and no event "
                             f"dimensions (got event shape {tuple(component.event_shape)}): the default "
                             "expected_log_prob and predictive integrate element-wise factors; override them for "
                             "another layout")
        return component, w

    def predictive_log_prob(self, y, f_loc, f_var) -> torch.Tensor:
        """:math:`\\log \\int p(y|f) N(f; f_{loc}, f_{var}) df` (test log-likelihood), with :math:`q(f)` the
        marginal of Hensman et al. 2015, eq. 19; ``y``, ``f_loc``, ``f_var`` ``[..., B]``, returns ``[..., B]``."""
        return self.predictive(f_loc, f_var).log_prob(y)
