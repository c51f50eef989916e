r"""``Kuu``, ``Kuf`` and ``Kdiag``: the covariances every layer reads, dispatched on the pair (inducing variable,
kernel) through the registry of :mod:`pyro_sparsegp.covariances.dispatch`.

Shapes (``M`` inducing variables, ``B`` inputs, ``L`` outputs when each has its own set):

==================  =====================================  ========================
function            input                                  output
==================  =====================================  ========================
``Kuu(u, k)``       ``Z [(L,) M, d]``                      ``[(L,) M, M]``
``Kuu(u, k, v)``    ``Z [(L,) M, d]``, ``O [(L,) M2, d]``  ``[(L,) M, M2]``
``Kuf(u, k, X)``    ``X [..., (L|1,) B, D]``               ``[..., (L|1,) M, B]``
``Kdiag(k, X)``     ``X [..., B, D]``                      ``[..., B]``
==================  =====================================  ========================

They are :math:`K_{mm}`, :math:`K_{mn}` and the diagonal of :math:`K_{nn}` of Hensman, Matthews, Ghahramani 2015,
eq. 19 (SOLVE-GP's :math:`K_{uv}`: Shi, Titsias, Mnih 2020, algorithm 1).
"""

from __future__ import annotations

import torch

from .dispatch import lookup, lookup_diag

__all__ = ["Kuu", "Kuf", "Kdiag", "check"]


def check(inducing, kernel) -> None:
    """``ValueError`` when ``inducing`` cannot be used with ``kernel``: :class:`~.dispatch.NoRuleError` (a
    ``TypeError`` and a ``ValueError``) for a pair without a rule or a kernel without a diagonal, else the rule's own
    shape checks (e.g. ``Z`` ``[..., M, d]`` with the ``d`` the kernel reads): whether :func:`Kuu` and :func:`Kuf`
    (Hensman, Matthews, Ghahramani 2015, eq. 19) exist for the pair. The layers call it at construction."""
    rule = lookup(type(inducing), type(kernel))
    rule.check(inducing, kernel)
    lookup_diag(type(kernel))


def Kuu(inducing, kernel, other=None, jitter: float = 0.0) -> torch.Tensor:
    """``Cov(u, u')`` ``[(L,) M, M']`` of the pair's rule: :math:`K_{mm}` (Hensman, Matthews, Ghahramani 2015,
    eq. 19) for ``other=None``, else the cross-covariance with a second inducing set ``other`` of the same kind
    (SOLVE-GP's :math:`K_{uv}`, Shi, Titsias, Mnih 2020, algorithm 1). ``jitter`` is added to the diagonal of a copy
    (only when ``other`` is ``None``); :func:`pyro_sparsegp.linalg.cholesky` adds its own."""
    if other is not None and type(other) is not type(inducing):
        raise ValueError(f"cross-covariance between {type(inducing).__name__} and {type(other).__name__}: the two "
                         "inducing sets must be of the same kind")
    K = lookup(type(inducing), type(kernel)).Kuu(inducing, kernel, other)
    if jitter and other is None:
        K = K + jitter * torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    return K


def Kuf(inducing, kernel, X: torch.Tensor) -> torch.Tensor:
    """``Cov(u, f(X))`` ``[..., (L|1,) M, B]`` for inputs ``X`` ``[..., (L|1,) B, D]`` of the pair's rule:
    :math:`K_{mn}` of Hensman, Matthews, Ghahramani 2015, eq. 19."""
    return lookup(type(inducing), type(kernel)).Kuf(inducing, kernel, X)


def Kdiag(kernel, X: torch.Tensor) -> torch.Tensor:
    """Prior variances ``k(x_n, x_n)`` ``[..., B]`` for ``X`` ``[..., B, D]``, dispatched on the kernel's type (Pyro
    kernels; convolutional kernels: the ``O(B P^2 d)`` patch double sum of
    :meth:`~pyro_sparsegp.kernels.ConvKernel.Kdiag`; sums: the sum of the parts'): the diagonal of :math:`K_{nn}`
    in Hensman, Matthews, Ghahramani 2015, eq. 19."""
    return lookup_diag(type(kernel))(kernel, X)
