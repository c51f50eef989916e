r"""The kernels of an exported program, in plain torch: each Pyro kernel a layer uses becomes a small
:class:`torch.nn.Module` holding its hyperparameters as buffers (point values read once, at export), so the exported
graph references no Pyro object.

Supported: Pyro's ``RBF``, ``Matern32``, ``Matern52``, ``Exponential``, ``RationalQuadratic`` (their ``variance``,
scalar or ARD ``lengthscale`` and ``active_dims``), ``Sum`` and ``Product`` of supported kernels, and
:class:`~pyro_sparsegp.kernels.Separate` (one kernel per latent GP). Any other kernel raises ``ValueError`` naming
its class (write its ``k(X, Z)`` in plain torch, or predict with ``gp.predict`` in eager code).

Squared distances are formed as ``|x|^2 + |z|^2 - 2 x.z`` (one matrix product) on inputs centred on a fixed reference
(the mean of the inducing inputs), as :mod:`pyro_sparsegp.kernels.batched` does on the training side, and clamped at
zero; the exponential kernel, which is not smooth in ``r^2`` at 0, takes the differences ``x - z`` instead.

Shapes: ``X`` ``[..., N, D]`` (leading sample dimensions of a deep GP included), ``Z`` ``[G, M, D]`` for ``G``
independent GPs -> ``K`` ``[..., G, N, M]``; :meth:`diag` gives ``k(x, x)`` ``[G, 1]``.
"""

from __future__ import annotations

import math

import torch
from pyro.contrib.gp import kernels as pk

from ..kernels import Separate
from ..kernels.batched import _active as _active_dims  # the feature indices a kernel reads (None: all)

__all__ = ["plain_kernel", "KERNELS"]

#: The kernel classes an exported program evaluates (besides ``Sum``, ``Product`` and ``Separate`` of them).
KERNELS = {pk.RBF: "rbf", pk.Matern32: "matern32", pk.Matern52: "matern52", pk.Exponential: "exponential",
           pk.RationalQuadratic: "rq"}


def _value(kernel, name: str) -> torch.Tensor:
    return getattr(kernel, name).detach().clone()


class _Stationary(torch.nn.Module):
    """``var * g(|x - z|^2 / l^2)`` for one kernel shared by the ``G`` GPs; buffers ``variance`` ``()``,
    ``lengthscale`` ``()`` or ``[D_active]``, ``centre`` ``[D_active]`` and ``dims`` (the active features)."""

    def __init__(self, kernel, centre: torch.Tensor):
        super().__init__()
        self.kind = KERNELS[type(kernel)]
        dims = _active_dims(kernel)
        self.select = dims is not None and dims != list(range(kernel.input_dim))
        self.register_buffer("dims", torch.tensor(dims if dims is not None else [], dtype=torch.long))
        self.register_buffer("variance", _value(kernel, "variance"))
        self.register_buffer("lengthscale", _value(kernel, "lengthscale"))
        self.register_buffer("centre", (centre[dims] if self.select else centre[: kernel.input_dim]).clone())
        self.register_buffer("alpha", _value(kernel, "scale_mixture") if self.kind == "rq" else torch.ones(()))
        self.width = kernel.input_dim

    def _inputs(self, X):
        X = X.index_select(-1, self.dims) if self.select else X[..., : self.width]
        return (X - self.centre) / self.lengthscale

    def sqdist(self, X, Z):
        """``|x - z|^2 / l^2`` ``[..., G, N, M]`` for ``X`` ``[..., N, D]``, ``Z`` ``[G, M, D]``."""
        Xs, Zs = self._inputs(X).unsqueeze(-3), self._inputs(Z)  # [..., 1, N, d], [G, M, d]
        if self.kind == "exponential":  # not smooth in r^2 at 0: from the differences
            return (Xs.unsqueeze(-2) - Zs.unsqueeze(-3)).square().sum(-1)
        x2 = Xs.square().sum(-1, keepdim=True)  # [..., 1, N, 1]
        z2 = Zs.square().sum(-1).unsqueeze(-2)  # [G, 1, M]
        return (x2 + z2 - 2.0 * (Xs @ Zs.mT)).clamp(min=0)

    def forward(self, X, Z):
        r2 = self.sqdist(X, Z)
        if self.kind == "rbf":
            return self.variance * torch.exp(-0.5 * r2)
        if self.kind == "rq":
            return self.variance * (1 + 0.5 / self.alpha * r2).pow(-self.alpha)
        r = r2.sqrt()
        if self.kind == "matern32":
            s = math.sqrt(3) * r
            return self.variance * (1 + s) * torch.exp(-s)
        if self.kind == "matern52":
            s = math.sqrt(5) * r
            return self.variance * (1 + s + s * s / 3) * torch.exp(-s)
        return self.variance * torch.exp(-r)

    def diag(self):
        """``k(x, x)`` ``[1, 1]``: the variance."""
        return self.variance.reshape(1, 1)


class _Combination(torch.nn.Module):
    """Pyro's ``Sum`` or ``Product`` of two plain kernels."""

    def __init__(self, product: bool, k0, k1):
        super().__init__()
        self.product, self.k0, self.k1 = product, k0, k1

    def forward(self, X, Z):
        a, b = self.k0(X, Z), self.k1(X, Z)
        return a * b if self.product else a + b

    def diag(self):
        a, b = self.k0.diag(), self.k1.diag()
        return a * b if self.product else a + b


class _Stack(torch.nn.Module):
    """:class:`~pyro_sparsegp.kernels.Separate`: kernel ``g`` for GP ``g`` (``Z`` ``[G, M, D]``)."""

    def __init__(self, parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, X, Z):
        return torch.cat([k(X, Z[g : g + 1]) for g, k in enumerate(self.parts)], -3)  # [..., G, N, M]

    def diag(self):
        return torch.cat([k.diag() for k in self.parts], -2)  # [G, 1]


def plain_kernel(kernel, centre: torch.Tensor) -> torch.nn.Module:
    """The plain-torch module of ``kernel`` (module docstring), centring inputs on ``centre`` ``[D]``; ``ValueError``
    naming the class of an unsupported kernel."""
    if isinstance(kernel, Separate):
        return _Stack([plain_kernel(k, centre) for k in kernel.kernels])
    if type(kernel) in (pk.Sum, pk.Product):
        return _Combination(type(kernel) is pk.Product, plain_kernel(kernel.kern0, centre),
                            plain_kernel(kernel.kern1, centre))
    if type(kernel) in KERNELS:
        return _Stationary(kernel, centre)
    names = ", ".join(sorted(c.__name__ for c in KERNELS))
    raise ValueError(f"export: the kernel {type(kernel).__name__} has no plain-torch form; exported programs support "
                     f"{names}, their Sum and Product, and Separate of them. Rebuild the model with one of these, or "
                     "predict in eager code with gp.predict")
