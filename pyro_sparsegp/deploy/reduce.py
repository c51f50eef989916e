r"""From a trained module to the plain modules of :mod:`pyro_sparsegp.deploy.modules`: the constants of each layer's
prediction, computed once in eager code from the layer's strategy
(:meth:`~pyro_sparsegp.variational.Strategy.predictive_terms`), and the checks that a module is in a state that can be
exported (point-valued hyperparameters, inducing points, supported kernels and mean functions).

Reductions are looked up by the layer's class through :func:`register_layer` (the most derived registered class
wins): :class:`~pyro_sparsegp.SVGP` (and through it :class:`~pyro_sparsegp.SOLVEGP` and LMC layers) and
:class:`~pyro_sparsegp.ODVGP` are registered here. A new layer kind (e.g. a group layer) registers a function
``layer -> LayerPredictor`` (or any module with ``latent``, ``mix``, ``mean_function`` and ``forward(X, var)``) and
is then exported alone or inside a :class:`~pyro_sparsegp.DeepGP`. Shapes are given in
:mod:`pyro_sparsegp.deploy.modules`.
"""

from __future__ import annotations

import torch

from .. import inducing as ind
from .. import mean_functions as mf
from ..context.composition import sampled_attributes
from ..kernels.matvec import kernel_matvec
from .kernels import plain_kernel
from .modules import Affine, LayerPredictor

__all__ = ["register_layer", "reduce_layer", "check_exportable"]

_REDUCERS: dict = {}


def register_layer(cls, fn=None):
    """Register ``fn(layer) -> module`` as the reduction of layers of class ``cls`` (usable as a decorator,
    ``@register_layer(MyLayer)``). Returns ``fn``. Modules, not tensors, so shapes do not apply."""
    if fn is None:
        return lambda f: register_layer(cls, f)
    _REDUCERS[cls] = fn
    return fn


def check_exportable(module) -> None:
    """``ValueError`` naming what to do when ``module`` cannot be exported as it is: ``PyroSample``
    hyperparameters (a sampled lengthscale or noise has no single value to bake in). A module, not a tensor, so
    shapes do not apply."""
    sampled = sampled_attributes(module, names=False)
    if sampled:
        which = ", ".join(sorted({f"{type(sub).__name__}.{name}" for sub, name, _ in sampled}))
        raise ValueError(f"export: {which} {'is a PyroSample' if len(sampled) == 1 else 'are PyroSamples'} (a prior), "
                         "and an exported program needs point values: set the hyperparameters to point values (their "
                         "posterior means) first, e.g. kernel.lengthscale = PyroParam(guide.median()"
                         "['<name>.kernel.lengthscale']), then export")


def reduce_layer(layer) -> torch.nn.Module:
    """The plain module of ``layer`` from the reduction registered for its class (:func:`register_layer`);
    ``ValueError`` naming the class and the supported ones otherwise. Modules, not tensors, so shapes do not apply
    (:mod:`pyro_sparsegp.deploy.modules` gives the module's)."""
    for cls in type(layer).__mro__:
        if cls in _REDUCERS:
            return _REDUCERS[cls](layer)
    names = ", ".join(sorted(c.__name__ for c in _REDUCERS))
    raise ValueError(f"export: {type(layer).__name__} layers are not supported yet (supported: {names}, and DeepGP "
                     "stacks of them); predict with the module in eager code, or register a reduction with "
                     "pyro_sparsegp.deploy.register_layer")


def _mean(layer, dtype) -> Affine | None:
    """The layer's mean function as an :class:`Affine`, or ``None`` (zero)."""
    f, L = layer.mean_function, layer.num_outputs or 1
    if f is None or isinstance(f, mf.Zero):
        return None
    if isinstance(f, mf.Constant):
        return Affine(None, f.c.detach().to(dtype).clone(), L)
    if isinstance(f, mf.Linear):
        return Affine(f.A.detach().to(dtype).clone(), f.b.detach().to(dtype).clone(), L)
    if isinstance(f, mf.Identity):
        return Affine(torch.eye(layer.input_dim, dtype=dtype), None, L)
    if isinstance(f, mf.FixedProjection):
        return Affine(f.W.detach().to(dtype).clone(), None, L)
    raise ValueError(f"export: the mean function {type(f).__name__} has no plain-torch form; supported: Zero, "
                     "Constant, Linear, Identity, FixedProjection")


def _points(inducing) -> torch.Tensor:
    if type(inducing) is not ind.InducingPoints:
        raise ValueError(f"export: {type(inducing).__name__} (inducing patches of a convolutional layer) are not "
                         "supported yet; exported programs take layers with inducing points (Z [M, D] or [L, M, D])")
    return inducing.Z.detach()


@torch.no_grad()
def _svgp(layer, O=None, a_O=None, shift=None) -> LayerPredictor:
    """SVGP, SOLVE-GP (over ``[Z; O]``) and their LMC layers; ``O``, ``a_O``, ``shift``: ODVGP's mean."""
    check_exportable(layer)
    Z0 = _points(layer.inducing)
    # the kernel first: it refuses an unsupported one before any factorisation; inputs centred on the mean of Z
    kernel = plain_kernel(layer.kernel, Z0.reshape(-1, Z0.shape[-1]).mean(0))
    inducing, Lj, m, C = layer.strategy.predictive_terms()
    Z = torch.cat([_points(v) for v in inducing], -2)  # [(G,) M, D]
    if shift is not None:
        m = m - shift
    G = m.shape[0] if m.dim() == 2 else 1
    m, C = m.reshape(G, -1), C.expand(G, *C.shape[-2:])
    dtype = m.dtype
    Zg = Z.expand(G, *Z.shape[-2:]).clone()
    W = None if getattr(layer, "num_latents", None) is None else layer.W.detach().clone()
    return LayerPredictor(kernel, Zg, Lj, m.clone(), C.clone(), _mean(layer, dtype), W, O, a_O,
                          single=layer.num_outputs is None)


@torch.no_grad()
def _odvgp(layer) -> LayerPredictor:
    """ODVGP: the SVGP over ``Z`` with the mean's weights on ``O`` (its ``_terms``: ``m_u' - Luu^{-1} K_uv a`` on
    ``Z`` and ``a`` on ``O``; Shi, Titsias, Mnih 2020, section 5)."""
    check_exportable(layer)
    _, Luu = layer.strategy.kuu_chol(consume=False)
    layer.strategy.clear()
    a = layer.a.detach()
    b = torch.linalg.solve_triangular(Luu, kernel_matvec(layer.kernel, layer.Z, layer.O, a).unsqueeze(-1),
                                      upper=False).squeeze(-1)
    return _svgp(layer, O=layer.O.detach().clone(), a_O=a.clone(), shift=b)


def _register_builtin():
    from ..layers import ODVGP, SVGP

    register_layer(SVGP, _svgp)
    register_layer(ODVGP, _odvgp)


_register_builtin()
