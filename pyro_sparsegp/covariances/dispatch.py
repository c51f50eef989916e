"""The registry of covariance rules: one :class:`Rule` per (inducing type, kernel type), one diagonal per kernel type.

A rule says what ``Kuu`` ``[(L,) M, M']`` and ``Kuf`` ``[..., (L|1,) M, B]`` are for one kind of inducing variable
under one kind of kernel (GPflow keeps the same idea in ``covariances/kuus.py`` and ``kufs.py``, with one dispatcher
per function; here one rule holds both, and the check of the pair). :func:`lookup` walks the MRO of both types: the
rule of the most specific inducing type wins, and for it that of the most specific kernel type, so a subclass of
``RBF`` or of :class:`~pyro_sparsegp.inducing.InducingPoints` finds the rule of its parents. A pair without a rule
raises :class:`NoRuleError`, which names both types and lists the registered pairs.

Registering a rule (the methods are called on the class: write them as static methods)::

    @register(MyInducing, pyro.contrib.gp.kernels.RBF)
    class MyRule(Rule):
        @staticmethod
        def Kuu(inducing, kernel, other=None): ...   # [(L,) M, M'], no jitter
        @staticmethod
        def Kuf(inducing, kernel, X): ...            # X [..., B, D] -> [..., (L|1,) M, B]

The registry itself is bookkeeping: it implements no paper equation.
"""

from __future__ import annotations

__all__ = ["Rule", "NoRuleError", "register", "refuse", "hint", "lookup", "register_diag", "lookup_diag", "pairs"]

_RULES: dict[tuple[type, type], type] = {}
_DIAGS: dict[type, object] = {}
_HINTS: dict[type, str] = {}
_CACHE: dict[tuple[type, type], type] = {}


class NoRuleError(TypeError, ValueError):
    """No covariance rule for a pair (inducing type, kernel type), or no diagonal for a kernel type. A ``TypeError``
    (the types do not go together), and a ``ValueError`` like the layers' other argument errors."""


class Rule:
    """The covariances of one (inducing type, kernel type) pair. Subclass it and :func:`register` the subclass.

    * ``check(inducing, kernel)``: ``ValueError`` when the pair's shapes do not fit (e.g. ``Z`` ``[..., M, d]`` with
      the wrong ``d``); by default nothing.
    * ``Kuu(inducing, kernel, other=None)``: ``Cov(u, u')`` ``[(L,) M, M']`` (``other``: a second inducing set of the
      same kind, ``u'``), without jitter.
    * ``Kuf(inducing, kernel, X)``: ``Cov(u, f(X))`` ``[..., (L|1,) M, B]`` for ``X`` ``[..., B, D]``.
    """

    @staticmethod
    def check(inducing, kernel) -> None:
        """Shape checks that need both the inducing variable (``Z`` ``[..., M, d]``) and the kernel; none here."""

    @staticmethod
    def Kuu(inducing, kernel, other=None):
        """``Cov(u, u')`` ``[(L,) M, M']``."""
        raise NotImplementedError

    @staticmethod
    def Kuf(inducing, kernel, X):
        """``Cov(u, f(X))`` ``[..., (L|1,) M, B]`` for ``X`` ``[..., B, D]``."""
        raise NotImplementedError


def register(inducing_type: type, kernel_type: type):
    """Class decorator: make the decorated :class:`Rule` the covariances of ``(inducing_type, kernel_type)`` (and,
    through the MRO walk of :func:`lookup`, of their subclasses without a rule of their own). Registering a pair
    again replaces its rule. Returns the class, so one rule may be registered for several pairs. No tensors: shapes
    do not apply."""

    def decorate(rule):
        _RULES[(inducing_type, kernel_type)] = rule
        _CACHE.clear()
        return rule

    return decorate


def refuse(inducing_type: type, kernel_type: type, message: str) -> None:
    """Register a pair that must not be used, with the ``ValueError`` ``message`` that says what to use instead
    (e.g. inducing patches without locations under TICK). More specific pairs may still have rules. No tensors:
    shapes do not apply."""

    def fail(*args, **kwargs):
        raise ValueError(message)

    refused = type(f"Refused_{inducing_type.__name__}_{kernel_type.__name__}", (Rule,),
                   {"check": staticmethod(fail), "Kuu": staticmethod(fail), "Kuf": staticmethod(fail),
                    "refused": True})
    register(inducing_type, kernel_type)(refused)


def hint(inducing_type: type, text: str) -> None:
    """Advice added to the :class:`NoRuleError` of any pair whose inducing type is ``inducing_type`` (or a subclass
    without advice of its own): which kernels it goes with. No tensors: shapes do not apply."""
    _HINTS[inducing_type] = text


def pairs() -> list[tuple[type, type]]:
    """The registered (inducing type, kernel type) pairs that have rules (refused pairs left out), in registration
    order. No tensors: shapes do not apply."""
    return [p for p, rule in _RULES.items() if not getattr(rule, "refused", False)]


def _name(t: type) -> str:
    return t.__name__


def lookup(inducing_type: type, kernel_type: type) -> type:
    """The rule of ``(inducing_type, kernel_type)``: among the registered pairs ``(A, B)`` with ``A`` in the MRO of
    ``inducing_type`` and ``B`` in that of ``kernel_type``, the one whose ``A`` comes first in the MRO, then whose
    ``B`` does. :class:`NoRuleError` when there is none. No tensors: shapes do not apply."""
    key = (inducing_type, kernel_type)
    if key in _CACHE:
        return _CACHE[key]
    for a in inducing_type.__mro__:
        for b in kernel_type.__mro__:
            rule = _RULES.get((a, b))
            if rule is not None:
                _CACHE[key] = rule
                return rule
    advice = next((_HINTS[a] for a in inducing_type.__mro__ if a in _HINTS), None)
    registered = ", ".join(f"({_name(a)}, {_name(b)})" for a, b in pairs())
    raise NoRuleError(
        f"no covariance rule for the pair ({_name(inducing_type)}, {_name(kernel_type)})"
        + (f": {advice}" if advice else "")
        + f". Registered pairs: {registered}. Register a rule with pyro_sparsegp.covariances.register("
        f"{_name(inducing_type)}, {_name(kernel_type)})."
    )


def register_diag(kernel_type: type):
    """Function decorator: make ``fn(kernel, X)`` -> ``[..., B]`` (for ``X`` ``[..., B, D]``) the prior variances
    ``k(x_n, x_n)`` of ``kernel_type`` and its subclasses without one of their own. Returns ``fn``."""

    def decorate(fn):
        _DIAGS[kernel_type] = fn
        return fn

    return decorate


def lookup_diag(kernel_type: type):
    """The diagonal function of the first type in ``kernel_type``'s MRO that has one; :class:`NoRuleError` when none
    has. No tensors: shapes do not apply."""
    for b in kernel_type.__mro__:
        if b in _DIAGS:
            return _DIAGS[b]
    raise NoRuleError(
        f"no diagonal k(x, x) registered for the kernel {_name(kernel_type)}; registered kernel types: "
        f"{', '.join(_name(b) for b in _DIAGS)}. Register one with pyro_sparsegp.covariances.register_diag("
        f"{_name(kernel_type)})."
    )
