r"""Multi-class likelihoods over ``K`` latent functions: robust-max and softmax.

Both observe a label ``y`` in ``{0, ..., K-1}`` that depends on all ``K`` latent values of its input
(``latent_dim == K``): with ``SVGP(kernel, Z, RobustMax(K), num_outputs=K)`` the layer's outputs are the classes.

Shapes. Latent values ``f`` are ``[..., K, B]``: the classes stand in the outputs dimension of a multi-output
:class:`~pyro_sparsegp.SVGP` (dim ``-2``, the outputs plate), to the left of the data dimension (dim ``-1``, the
data plate). Everything that has the shape of the observed site keeps the classes' dimension as a **singleton**:

===============================================  =====================
``distribution(f)``                               batch ``[..., 1, B]``
``y_shape(f.shape)``                              ``[..., 1, B]``
``expected_log_prob(y, f_loc, f_var)``            ``[..., 1, B]``
``predictive(f_loc, f_var)``                      batch ``[..., B]``
===============================================  =====================

Why a singleton rather than dropping the classes' dimension: under Pyro's vectorised particles (or any plate left
of the outputs plate) the latent values are ``[P, K, B]`` with the particle plate at dim ``-3``; a ``y`` site of
batch shape ``[P, B]`` would put the particles at dim ``-2`` and fail Pyro's plate-shape check, while
``[P, 1, B]`` lines up. :class:`~pyro_sparsegp.distributions.MarginalizedLikelihood` (``SVGP(...,
integrate_f=True)``) builds its batch shape from :meth:`y_shape` and relies on this convention. The predictive
distribution is not a Pyro site of the model and drops the dimension. Labels may be passed as ``[B]``, shaped like
the site ``[..., 1, B]``, or shaped like ``f`` without its classes' dimension ``[..., B]`` (then a singleton is
inserted).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import constraints

from ..linalg import gauss_hermite
from .base import _check_finite
from .multilatent import _MultiLatent

__all__ = ["RobustMax", "Softmax"]

# variances of q(f) below this are raised to it (a standard deviation of 1e-10) in the robust-max quadrature, so
# that its gradients stay finite; q(f) from an SVGP never gets that small in practice
_VAR_FLOOR = 1e-20
_Z_MAX = 1e4


class _MultiClass(_MultiLatent):
    """Shared parts of the ``K``-class likelihoods: label checks; shapes and site-shaped labels from
    :class:`~.multilatent._MultiLatent` (``f [..., K, B]``, the site ``[..., 1, B]``)."""

    def __init__(self, num_classes: int, num_gh: int = 20):
        if int(num_classes) != num_classes or num_classes < 2:
            raise ValueError(f"num_classes must be an integer of at least 2, got {num_classes}")
        super().__init__(int(num_classes), num_gh)
        self.num_classes = int(num_classes)
        self.support = constraints.integer_interval(0, self.num_classes - 1)

    def check_y(self, y):
        """Raise ``ValueError`` unless every label is an integer in ``0..K-1`` (NaN and inf included)."""
        if y.is_complex() or y.dtype == torch.bool:
            raise ValueError(f"labels must be integers in 0..{self.num_classes - 1}, got dtype {y.dtype}")
        _check_finite("y", y)
        bad = (y != y.round()) | (y < 0) | (y > self.num_classes - 1)
        if bool(bad.any()):
            raise ValueError(
                f"labels must be integers in 0..{self.num_classes - 1} for {type(self).__name__}"
                f"({self.num_classes}); got e.g. {y[bad].flatten()[0].item()!r}"
            )

    def _site_labels(self, y, f_loc):
        """Long labels broadcastable to the site shape ``[..., 1, B]`` (``[..., B]`` gets its singleton)."""
        y = self._site_shaped(y, f_loc)
        return y.long() if y.is_floating_point() else y.to(torch.long)

    def quadrature_expected_log_prob(self, y, f_loc, f_var):
        """Not available: the base class integrates one scalar ``f`` per observation, and these likelihoods
        depend on ``K`` latent values jointly. Use :meth:`expected_log_prob` (robust-max: one-dimensional
        quadrature over the true class's latent; softmax: Monte Carlo)."""
        raise NotImplementedError(
            f"{type(self).__name__} depends on {self.num_classes} latent values per observation; the base class's "
            "one-dimensional quadrature does not apply. Use expected_log_prob."
        )


class RobustMax(_MultiClass):
    r"""Robust-max likelihood (Hernández-Lobato, Hernández-Lobato and Dupont 2011, "Robust multi-class Gaussian
    process classification"; used with sparse variational GPs by Hensman, Matthews, Filippone and Ghahramani 2015,
    "MCMC for variationally sparse Gaussian processes", and as the VI baseline of Villacampa-Calvo and
    Hernández-Lobato 2017, "Scalable multi-class Gaussian process classification using expectation propagation",
    eq. 13):

    .. math:: p(y = k \mid f) = \begin{cases} 1 - \epsilon & k = \arg\max_j f_j \\
              \epsilon / (K - 1) & \text{otherwise,} \end{cases}

    ``epsilon`` being the probability of a labelling error (then ``y`` is drawn uniformly from the other classes).
    Ties in the argmax have probability zero under Gaussian ``f``; :meth:`distribution` gives them to the first
    maximal class.

    **Expected log-likelihood** (the data term of the VI objective, Villacampa-Calvo and Hernández-Lobato 2017,
    eq. 15: :math:`\sum_n \mathbb{E}_q[\log p(y_n|f_n)] - \sum_k \mathrm{KL}[q(u_k)\|p(u_k)]`) under independent
    :math:`q(f_j) = N(m_j, v_j)`:

    .. math:: \mathbb{E}_q \log p(y|f) = \log(1-\epsilon)\,P_y + \log\tfrac{\epsilon}{K-1}\,(1 - P_y), \qquad
              P_k = \mathbb{E}_{f_k \sim N(m_k, v_k)} \prod_{j \ne k} \Phi\Big(\frac{f_k - m_j}{\sqrt{v_j}}\Big),

    :math:`P_k` being the probability that class ``k``'s latent is the largest, computed by one-dimensional
    Gauss-Hermite quadrature over :math:`f_k` with ``num_gh`` nodes (their appendix, eq. 68). It is exact up to the
    quadrature error, smooth in :math:`(m, v)`, and so gives gradients to every parameter of an SVGP.

    **Training an SVGP.** The likelihood is piecewise constant in ``f``: a *sampled* ``f`` site (the SVGP default)
    estimates the bound without bias but carries no pathwise gradient through ``y``'s term. Train with
    ``SVGP(..., integrate_f=True)`` (the ``y`` site then scores :meth:`expected_log_prob`) or
    ``fit(..., elbo="analytic")``. Robust-max depends on ``f`` only through its argmax, so the bound is invariant
    to a common scaling of the latent functions: with ``whiten=True`` it does not depend on the kernel's variance at
    all (zero gradient); with ``whiten=False`` only the KL term does.

    Shapes: ``f`` and the marginals ``f_loc``, ``f_var`` are ``[..., K, B]``; labels ``y`` are ``[..., 1, B]`` (or
    ``[..., B]``); :meth:`expected_log_prob` returns ``[..., 1, B]``.

    :param int num_classes: ``K`` (at least 2).
    :param float epsilon: labelling-error probability in ``(0, 1)``, a fixed float (not learnt); default ``1e-3``
        (Villacampa-Calvo and Hernández-Lobato fix it at the value Hensman et al. 2015 suggest; the number is lost
        from our copy of their text, and ``1e-3`` is the usual choice).
    :param int num_gh: Gauss-Hermite nodes of :math:`P_k`.
    """

    #: piecewise constant in ``f``: layers integrate ``f`` out for it (a sampled ``f`` gives no gradient)
    piecewise_constant = True

    def __init__(self, num_classes: int, epsilon: float = 1e-3, num_gh: int = 20):
        super().__init__(num_classes, num_gh)
        epsilon = float(epsilon)
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    @property
    def _log_right(self):
        return math.log1p(-self.epsilon)

    @property
    def _log_wrong(self):
        return math.log(self.epsilon / (self.num_classes - 1))

    def probs(self, f: torch.Tensor) -> torch.Tensor:
        """:math:`p(y = k | f)` for ``f`` ``[..., K, B]``, returned ``[..., B, K]``."""
        self._check_f(f)
        top = torch.nn.functional.one_hot(f.argmax(-2), self.num_classes).to(f.dtype)  # [..., B, K]
        wrong = self.epsilon / (self.num_classes - 1)
        return top * (1.0 - self.epsilon - wrong) + wrong

    def distribution(self, f):
        """Categorical over the ``K`` classes, batch shape ``[..., 1, B]``."""
        return dist.Categorical(probs=self.probs(f).unsqueeze(-3))

    def _prob_max_of(self, k, f_loc, f_var):
        """:math:`P_k` for class indices ``k`` (long, broadcastable to ``[..., 1, B]``) -> ``[..., 1, B]``."""
        K = self.num_classes
        shape = torch.broadcast_shapes(k.shape, f_loc.shape[:-2] + (1,) + f_loc.shape[-1:])
        k = k.expand(shape)
        f_loc = f_loc.expand(shape[:-2] + (K,) + shape[-1:])
        sd = f_var.clamp(min=_VAR_FLOOR).sqrt().expand_as(f_loc)
        x, w = gauss_hermite(self.num_gh, f_loc.dtype, f_loc.device)
        x = x.reshape((-1,) + (1,) * len(shape))
        fk = f_loc.gather(-2, k) + sd.gather(-2, k) * x  # [n, ..., 1, B]: the nodes of f_k
        # z beyond +-1e4 changes no value (Phi(-1e4) underflows to 0, Phi(1e4) rounds to 1); clamping it keeps
        # log_ndtr's backward finite (it overflows from |z| ~ 1e10)
        z = ((fk - f_loc) / sd).clamp(-_Z_MAX, _Z_MAX)
        logphi = torch.special.log_ndtr(z)  # [n, ..., K, B]: log Phi((f_k - m_j) / s_j)
        own = torch.arange(K, device=k.device)[:, None] == k  # [..., K, B]: j == k
        log_prod = logphi.masked_fill(own, 0.0).sum(-2, keepdim=True)  # [n, ..., 1, B]
        return torch.tensordot(w, log_prod.exp(), dims=1).clamp(0.0, 1.0)

    def prob_max(self, f_loc: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
        r""":math:`P_k = P(f_k > f_j\ \forall j \ne k)` under independent :math:`N(m_j, v_j)` for every class, by
        Gauss-Hermite quadrature, ``[..., K, B]``. Exactly integrated they sum to one over ``k``. The quadrature
        error grows with the spread of the variances at a point (the factors :math:`\Phi(\cdot / \sqrt{v_j})`
        get sharp on the scale of :math:`\sqrt{v_k}`): measured as the worst :math:`|\sum_k P_k - 1|` over 2000
        random points with ``K`` = 3 to 10, it is below ``5e-4`` with 20 nodes (``4e-6`` with 40) when the
        :math:`v_j` lie within a factor 3 of each other, ``3e-3`` (``1e-4``) within a factor 7.5, ``1.5e-2``
        (``1.5e-3``) within a factor 20. Raise ``num_gh`` when the classes' variances differ widely."""
        self._check_f(f_loc)
        k = torch.arange(self.num_classes, device=f_loc.device)
        return torch.cat([self._prob_max_of(k[c].expand(f_loc.shape[-1:]), f_loc, f_var)
                          for c in range(self.num_classes)], -2)

    def expected_log_prob(self, y, f_loc, f_var):
        """:math:`\\log(1-\\epsilon) P_y + \\log(\\epsilon/(K-1))(1 - P_y)` (see the class), ``[..., 1, B]``."""
        self._check_f(f_loc)
        P = self._prob_max_of(self._site_labels(y, f_loc), f_loc, f_var)
        return self._log_right * P + self._log_wrong * (1.0 - P)

    def predictive(self, f_loc, f_var):
        r"""Categorical with :math:`p_k = (1-\epsilon)\bar P_k + \frac{\epsilon}{K-1}(1-\bar P_k)`, batch
        ``[..., B]``, where :math:`\bar P_k = P_k / \sum_j P_j` (:meth:`prob_max` renormalised: this removes only
        the quadrature error, and makes the :math:`p_k` sum to one exactly)."""
        P = self.prob_max(f_loc, f_var)
        P = (P / P.sum(-2, keepdim=True).clamp(min=torch.finfo(P.dtype).tiny)).movedim(-2, -1)  # [..., B, K]
        wrong = self.epsilon / (self.num_classes - 1)
        return dist.Categorical(probs=(1.0 - self.epsilon - wrong) * P + wrong)


class Softmax(_MultiClass):
    r""":math:`p(y = k \mid f) = \mathrm{softmax}(f)_k = e^{f_k} / \sum_j e^{f_j}`, for comparison with
    :class:`RobustMax` (the softmax multi-class GP likelihood; e.g. Chai 2012, cited by Villacampa-Calvo and
    Hernández-Lobato 2017, section 3).

    Its expected log-likelihood has no closed form: :meth:`expected_log_prob` averages
    :math:`\log \mathrm{softmax}(f)_y` over ``num_samples`` reparameterised draws :math:`f = m + \sqrt{v}\,z`,
    :math:`z \sim N(0, I)` (fresh draws from torch's global generator on each call). The estimate is unbiased for
    the expectation (so the bound it enters is estimated without bias) and differentiable in :math:`(m, v)`.
    :meth:`predictive` averages :math:`\mathrm{softmax}(f)` over ``num_samples`` draws, which is unbiased for the
    predictive probabilities (its log, the test log-likelihood, is biased low by Jensen's inequality, less so for
    more samples). Unlike robust-max, softmax is smooth in ``f``, so a sampled ``f`` site also trains the kernel.

    Shapes: ``f`` and the marginals ``f_loc``, ``f_var`` are ``[..., K, B]``; labels ``y`` are ``[..., 1, B]`` (or
    ``[..., B]``); :meth:`expected_log_prob` returns ``[..., 1, B]``.

    :param int num_classes: ``K`` (at least 2).
    :param int num_samples: Monte-Carlo draws per evaluation.
    """

    def __init__(self, num_classes: int, num_samples: int = 100):
        super().__init__(num_classes)
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = int(num_samples)

    def distribution(self, f):
        """Categorical over the ``K`` classes with logits ``f``, batch shape ``[..., 1, B]``."""
        self._check_f(f)
        return dist.Categorical(logits=f.movedim(-2, -1).unsqueeze(-3))

    def _draws(self, f_loc, f_var):
        z = torch.randn((self.num_samples,) + f_loc.shape, dtype=f_loc.dtype, device=f_loc.device)
        return f_loc + f_var.clamp(min=_VAR_FLOOR).sqrt() * z  # [S, ..., K, B]

    def expected_log_prob(self, y, f_loc, f_var):
        """Monte-Carlo estimate (unbiased, reparameterised) of :math:`E_q \\log \\mathrm{softmax}(f)_y`,
        ``[..., 1, B]``."""
        self._check_f(f_loc)
        f_loc, f_var = torch.broadcast_tensors(f_loc, f_var)
        y = self._site_labels(y, f_loc)
        logp = torch.log_softmax(self._draws(f_loc, f_var), dim=-2)  # [S, ..., K, B]
        shape = torch.broadcast_shapes(y.shape, logp.shape[1:-2] + (1,) + logp.shape[-1:])
        logp = logp.expand((self.num_samples,) + shape[:-2] + logp.shape[-2:])
        idx = y.expand(shape).expand((self.num_samples,) + shape)
        return logp.gather(-2, idx).mean(0)

    def predictive(self, f_loc, f_var):
        """Categorical with the Monte-Carlo average of :math:`\\mathrm{softmax}(f)`, batch ``[..., B]``."""
        self._check_f(f_loc)
        with torch.no_grad():
            probs = torch.softmax(self._draws(f_loc, f_var), dim=-2).mean(0)
        return dist.Categorical(probs=probs.movedim(-2, -1))
