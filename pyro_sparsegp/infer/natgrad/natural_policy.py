r"""The natural-gradient and finish policy that :func:`~pyro_sparsegp.infer.fit` and
:class:`~pyro_sparsegp.infer.NaturalGradient` share: :class:`NaturalPolicy`, one frozen object with one set of names,
checked when it is built. How ``fit`` resolves ``"auto"`` is :func:`~pyro_sparsegp.infer.natgrad.policy.resolve_natgrad`
(the measurements behind it are in :mod:`~pyro_sparsegp.infer.natgrad.policy`); how ``NaturalGradient`` does is in
:mod:`~pyro_sparsegp.infer.natgrad.optimizer`. Argument checks: no paper equation."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["NaturalPolicy", "as_policy"]

_LAYERS = ("auto", "last", "all")
_FINISHES = ("auto", "exact", "natural", None)


def _auto(v) -> bool:
    return isinstance(v, str) and v == "auto"


def _fraction(v, low_open: bool) -> bool:
    """Whether ``v`` is a real number (not a bool) in ``(0, 1]`` (``low_open``) or ``[0, 1]``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        return False
    return (0.0 < float(v) if low_open else 0.0 <= float(v)) and float(v) <= 1.0


def _step(v) -> bool:
    """Whether ``v`` is an integer (not a bool) >= 0."""
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= 0


def _check_lr(lr) -> None:
    if lr is None or _auto(lr) or callable(lr) or _fraction(lr, low_open=True):
        return
    raise ValueError(f"NaturalPolicy.lr must be a step length in (0, 1], a schedule step -> float, None (Adam trains "
                     f"q(u)) or 'auto', got {lr!r}")


@dataclass(frozen=True)
class NaturalPolicy:
    r"""The natural-gradient steps on the Gaussian variational families q(u) (Hensman, Fusi, Lawrence 2013, section
    3.2; the NGD + Adam hybrid of Salimbeni, Eleftheriadis, Hensman 2018) and how a run ends: one object for
    ``fit(module, X, y, natgrad=...)`` and ``NaturalGradient(optim, natgrad=...)``. Every field defaults to
    ``"auto"``; a float (or a schedule) passed where a policy is expected is ``NaturalPolicy(lr=that)``, and ``None``
    is ``NaturalPolicy(lr=None)``. Values are checked here: a wrong one raises ``ValueError`` naming the field.

    :param lr: the step length :math:`\rho` after the warm-up: a number in ``(0, 1]``, a schedule ``step -> float``
        (e.g. :class:`~pyro_sparsegp.infer.natgrad.schedules.LogLinearWarmup`; ``NaturalGradient`` only, ``fit``
        builds its own from ``warmup`` and ``cooldown``), or ``None``: no natural steps, Adam trains q(u) with the
        other parameters (``fit`` only: ``NaturalGradient`` needs steps). ``"auto"`` under ``fit``: 0.1 for a
        :class:`~pyro_sparsegp.Gaussian` or :class:`~pyro_sparsegp.PolyaGammaLogit` likelihood on the closed-form bound
        and :data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_NONCONJUGATE_LR` for the other likelihoods, except ``None``
        (Adam) for a Pyro ``elbo``, for robust-max on minibatches under
        :data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_MIN_BATCH_FRACTION` of the data and for robust-max on inducing
        patches. ``"auto"`` under ``NaturalGradient``: 0.1.
    :param warmup: a log-linear warm-up of the step length from ``1e-4`` over this many steps (an integer >= 0;
        Salimbeni et al. 2018). ``"auto"`` under ``fit``: none for a conjugate likelihood (a single layer's first steps
        are then the running average :math:`\max(\rho, 1/(k+1))` of
        :class:`~pyro_sparsegp.infer.natgrad.schedules.RunningAverageStart`; ``warmup=0`` gives the constant step),
        :data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_WARMUP` steps for the others. Under ``NaturalGradient``: 0.
    :param retraction: ``True``: the positive-definite precision step of Lin, Schmidt, Khan (2020), stable with Monte
        Carlo gradients and non-conjugate likelihoods; ``False``: the plain step, exact at length 1 for a Gaussian
        likelihood with a deterministic bound (it diverges with a sampled one); or (``NaturalGradient`` only) a
        function ``family -> bool``. ``"auto"`` under ``fit``: plain for a conjugate likelihood's own layer on the
        closed-form bound, positive-definite for every other family (a Pyro ELBO, a non-conjugate likelihood, a deep
        GP's hidden layers). Under ``NaturalGradient``: ``True``.
    :param layers: ``fit`` only (under ``SVI``, ``NaturalGradient(families=...)`` selects the families): ``"last"``, the
        module's own families (a DeepGP's last layer), or ``"all"``, every layer's q(u). ``"auto"``: ``"last"``.
    :param hidden_start: ``fit`` only: with ``layers="all"``, the step (an integer >= 0) from which the hidden layers'
        q(u) take natural steps (Adam trains them before, in the same Adam state). ``"auto"``: half the steps
        (:data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_HIDDEN_START`).
    :param average: the Polyak-Ruppert average of the natural parameters of the stepped families (and of a Gaussian
        noise's Fisher steps) over the last fraction ``average`` in ``(0, 1]`` of the steps, written into the module at
        the end (:class:`~pyro_sparsegp.infer.natgrad.averaging.IterateAverage`), or ``None``. ``"auto"`` under
        ``fit``: the last :data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_HIDDEN_AVERAGE` of the steps for a deep GP's
        hidden layers under ``layers="all"`` beside the exact finish of its last layer, else none. Under
        ``NaturalGradient`` (needs ``num_steps``): averaging from step ``num_steps - ceil(average * num_steps)`` on;
        call :meth:`~pyro_sparsegp.infer.NaturalGradient.write_average` at the end; ``"auto"``: none.
    :param cooldown: the last fraction in ``[0, 1]`` of the steps over which the natural step length and Adam's
        learning rate decay log-linearly to a tenth (:class:`~pyro_sparsegp.infer.natgrad.schedules.Cooldown`), so a
        run ends near the plateau's centre instead of on one noisy iterate; ``None`` or ``0``: none. ``"auto"`` under
        ``fit``: half the steps (:data:`~pyro_sparsegp.infer.natgrad.policy.AUTO_COOLDOWN`) for natural steps on a
        non-conjugate likelihood or a Pyro ELBO, else none. Under ``NaturalGradient``: 0.5 of ``num_steps`` when
        ``num_steps`` is given, else none (a cooldown given needs ``num_steps``).
    :param finish: ``fit`` only (a finish needs all the data): ``"exact"``, q(u) and the Gaussian noise set to their
        optimum on all the data in one pass (:mod:`~pyro_sparsegp.infer.training.exact_finish`); ``"natural"``, at
        most :data:`~pyro_sparsegp.infer.training.natural_finish.DEFAULT_PASSES` damped full-data natural steps, each
        kept only if it raises the bound (Khan and Lin 2017; :mod:`~pyro_sparsegp.infer.training.natural_finish`), for
        a non-conjugate likelihood; ``None``: the last iterate. ``"auto"``: exact for an SVGP or SOLVE-GP (a DeepGP's
        last layer) with a Gaussian likelihood trained by natural steps from ``X, y`` or a dataset for at least one
        epoch; else natural for a module trained by natural steps on the closed-form bound from ``X, y`` or a dataset,
        one pass per :data:`~pyro_sparsegp.infer.training.natural_finish.EPOCHS_PER_PASS` epochs (at most
        ``DEFAULT_PASSES``, none under that many epochs), without ``average``; else none.

    ``fit`` prints what ``"auto"`` chose on its first line (``progress=True``).
    """

    lr: object = "auto"
    warmup: object = "auto"
    retraction: object = "auto"
    layers: object = "auto"
    hidden_start: object = "auto"
    average: object = "auto"
    cooldown: object = "auto"
    finish: object = "auto"

    def __post_init__(self):
        _check_lr(self.lr)
        if not (_auto(self.warmup) or _step(self.warmup)):
            raise ValueError(f"NaturalPolicy.warmup must be an integer >= 0 (steps) or 'auto', got {self.warmup!r}")
        if not (_auto(self.retraction) or isinstance(self.retraction, bool) or callable(self.retraction)):
            raise ValueError("NaturalPolicy.retraction must be True, False, 'auto' or (NaturalGradient only) a "
                             f"function family -> bool, got {self.retraction!r}")
        if not (isinstance(self.layers, str) and self.layers in _LAYERS):
            raise ValueError(f"NaturalPolicy.layers must be one of {_LAYERS}, got {self.layers!r}")
        if not (_auto(self.hidden_start) or _step(self.hidden_start)):
            raise ValueError("NaturalPolicy.hidden_start must be an integer >= 0 (a step) or 'auto', got "
                             f"{self.hidden_start!r}")
        if not (self.average is None or _auto(self.average) or _fraction(self.average, low_open=True)):
            raise ValueError("NaturalPolicy.average must be a fraction in (0, 1] of the steps (the last ones are "
                             f"averaged), 'auto' or None, got {self.average!r}")
        if not (self.cooldown is None or _auto(self.cooldown) or _fraction(self.cooldown, low_open=False)):
            raise ValueError("NaturalPolicy.cooldown must be a fraction in [0, 1] of the steps (the last ones decay), "
                             f"'auto' or None, got {self.cooldown!r}")
        if not (self.finish is None or (isinstance(self.finish, str) and self.finish in _FINISHES)):
            raise ValueError(f'NaturalPolicy.finish must be "auto", "exact", "natural" or None, got {self.finish!r}')


def as_policy(natgrad) -> NaturalPolicy:
    """``natgrad`` as a :class:`NaturalPolicy`: a policy is returned as it is, ``"auto"`` is ``NaturalPolicy()``, a
    float or a schedule ``step -> float`` is ``NaturalPolicy(lr=natgrad)`` and ``None`` is ``NaturalPolicy(lr=None)``;
    anything else raises the ``ValueError`` of ``NaturalPolicy.lr``. No tensors, so shapes do not apply."""
    if isinstance(natgrad, NaturalPolicy):
        return natgrad
    return NaturalPolicy() if _auto(natgrad) else NaturalPolicy(lr=natgrad)
