r"""Natural-gradient steps for q(u) (Hensman, Fusi, Lawrence 2013, section 3.2).

With natural parameters :math:`\theta = (S^{-1}m, -\tfrac12 S^{-1})` and expectation parameters
:math:`\eta = (m, S + mm^T)`, the natural gradient of the ELBO is its ordinary gradient with respect to
:math:`\eta`. Because :math:`\nabla_\eta(-\mathrm{KL}[q\|p]) = \theta_p - \theta`, a step of length :math:`\rho` is

.. math:: \theta \leftarrow (1-\rho)\,\theta + \rho\,(\theta_p + g), \qquad
          g = \tfrac{N}{B}\,\nabla_\eta \sum_{n \in \text{batch}} \mathbb{E}_{q(f_n)}[\log p(y_n|f_n)].

For a Gaussian likelihood :math:`g` is closed form (Hensman 2013 eqs. 5-6 with the minibatch scaling of section
3.2): :math:`g_1 = \beta\tfrac{N}{B} A y`, :math:`g_2 = -\tfrac{\beta}{2}\tfrac{N}{B} A A^T`, with
:math:`A = K_{uu}^{-1}K_{uf}` (or :math:`L_{uu}^{-1}K_{uf}` whitened), and a full-batch step of length 1 lands on
the optimal q(u). For other likelihoods :func:`natgrad_step` obtains :math:`g` by automatic differentiation of the
quadrature expected log-likelihood with respect to :math:`(m, S)`, using
:math:`\nabla_{\eta_1} = \nabla_m - 2(\nabla_S) m`, :math:`\nabla_{\eta_2} = \nabla_S`.

**Step length and damping.** ``lr`` must be a number in ``(0, 1]`` (``1``: the full step). For the Gaussian and
Pólya-Gamma steps :math:`g_2` is negative semi-definite, so the new precision
:math:`(1-\rho)S^{-1} + \rho(K^{-1} - 2g_2)` is positive definite for every such ``lr``. For a likelihood that is
not log-concave (robust-max), or with a large step on a non-conjugate one, :math:`-2 g_2` can be indefinite and the
step can leave the positive-definite cone. :func:`natgrad_step` therefore **damps**: it halves the step (separately
for each output) until the new precision has a Cholesky factor, at most 30 times (then that output is left
unchanged), and reports a damped step once per process with :class:`NatGradDampingWarning`. The positive-definite
step of Lin, Schmidt, Khan (2020) (``retraction=True`` in :func:`natgrad_from_grads_`; ``fit``'s
``NaturalPolicy.retraction``, on by default for non-conjugate likelihoods and deep GPs' hidden layers) never leaves the
cone, so for it damping is reserved for non-finite gradients.

One module per concept: :mod:`.closed_forms` (the steps from the likelihood's closed forms), :mod:`.from_grads` (the
steps from the ELBO's gradient, and the noise's), :mod:`.joint` (SOLVE-GP's joint step and its probes),
:mod:`.families` (which families and noise the steps train), :mod:`.damping` (the damping rule and its warning);
and around them :mod:`.optimizer` (:class:`NaturalGradient`, the Pyro optimiser that takes these steps in any ``SVI``
program), :mod:`.natural_policy` (:class:`NaturalPolicy`, the policy ``fit`` and ``NaturalGradient`` share),
:mod:`.policy` (``fit``'s ``"auto"`` natural-gradient policy), :mod:`.schedules` (step-length schedules) and
:mod:`.averaging` (the iterate average of the natural parameters).
"""

from .averaging import IterateAverage
from .closed_forms import gaussian_natgrad_step, natgrad_step, natgrad_step_for, polya_gamma_natgrad_step
from .damping import NatGradDampingWarning, check_natgrad_lr
from .families import natgrad_families, noise_natgrad_likelihood
from .from_grads import natgrad_from_grads_, noise_step_from_grads_
from .joint import (
    clear_natgrad_probes,
    natgrad_pairs,
    set_natgrad_probes,
    solvegp_joint_natgrad_from_grads_,
    solvegp_natgrad_step,
)
from .natural_policy import NaturalPolicy
from .optimizer import NaturalGradient
from .policy import NatGradPlan, resolve_natgrad
from .schedules import LogLinearWarmup, RunningAverageStart

__all__ = [
    "NaturalGradient",
    "NaturalPolicy",
    "LogLinearWarmup",
    "RunningAverageStart",
    "IterateAverage",
    "NatGradPlan",
    "resolve_natgrad",
    "natgrad_step",
    "gaussian_natgrad_step",
    "polya_gamma_natgrad_step",
    "natgrad_step_for",
    "natgrad_from_grads_",
    "natgrad_families",
    "noise_step_from_grads_",
    "noise_natgrad_likelihood",
    "solvegp_natgrad_step",
    "solvegp_joint_natgrad_from_grads_",
    "natgrad_pairs",
    "set_natgrad_probes",
    "clear_natgrad_probes",
    "check_natgrad_lr",
    "NatGradDampingWarning",
]
