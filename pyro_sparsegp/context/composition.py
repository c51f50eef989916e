r"""What makes a layer compose with any Pyro program: hyperparameters drawn once per program execution, cache keys
that see the values actually used, and a loud error where inputs would broadcast against particles or plates.

**Hyperpriors.** A kernel or likelihood attribute set to ``PyroSample(prior)`` is a sample site named after the
module (``gp.kernel.lengthscale``). A layer reads it in :meth:`~pyro_sparsegp.SVGP.sample_u`, its first site, which
stands outside the data plate, so the site has the prior's own shape. Pyro's ``PyroModule`` forgets a drawn value
when the outermost module call returns; a hand-written program calls ``sample_u`` and then ``sample_f`` as two calls,
and the second would draw the hyperparameter again (two sites of one name). :func:`layer_method` therefore seeds the
module's context, on entry, with the value that the program being traced already holds for each such site: the
model reuses its own draw, and the layer's guide uses the draw of an autoguide that ran before it (``AutoGuideList``
with the autoguide first). A guide that reaches a layer whose hyperparameter no guide has drawn raises, rather than
silently drawing it from the prior.

**Cache keys.** :func:`values_key` keys the guide-to-model cache by the parameters' storage and version *and* by the
identity of every sampled hyperparameter value, so a factor computed with one draw is never served for another.

**Plates.** :func:`check_plate_alignment` checks a layer's ``f`` against the active plates: every batch dimension
that no plate owns (and that is not the layer's outputs dimension) must have size 1, and none may stand left of the
outermost plate. Inputs whose leading dimensions are laid out differently (e.g. a hidden layer's ``[P, L, B]``
transposed to ``[P, B, L]``, which puts the particles where the outputs plate is) fail here instead of silently
broadcasting particles against each other.
"""

from __future__ import annotations

import functools

import pyro
import torch
from pyro.poutine.plate_messenger import PlateMessenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.trace_messenger import TraceMessenger

from . import deferred
from .naming import check_not_superseded
from .reporting import in_layer

__all__ = [
    "plate",
    "layer_method",
    "sampled_attributes",
    "current_trace",
    "seed_context",
    "draw_hyperparameters",
    "values_key",
    "check_plate_alignment",
    "BoundModule",
]


def sampled_attributes(module, names: bool = True) -> list[tuple[object, str, str | None]]:
    """``(submodule, attribute, site name)`` for every ``PyroSample`` attribute of ``module`` and its
    PyroModule children (the kernel, the likelihood, mean functions); ``names=False`` leaves the site names out
    (they are defined only once the module has been called). With names, only the submodules that share
    ``module``'s Pyro context count: a nested module with a context of its own (the layers of a ``DeepGP``) seeds
    its own attributes in its own layer methods. Takes and returns no tensor, so shapes do not apply."""
    out = []
    ctx = module.__dict__.get("_pyro_context")
    for sub in module.modules():
        samples = sub.__dict__.get("_pyro_samples")
        if not samples:
            continue
        if names and sub.__dict__.get("_pyro_context") is not ctx:
            continue  # a nested module with a context of its own (a DeepGP's layer) seeds itself in its own methods
        for name in samples:
            out.append((sub, name, sub._pyro_get_fullname(name) if names else None))
    return out


def current_trace():
    """The trace being recorded by the innermost ``poutine.trace`` (``None`` outside any). Takes and returns no
    tensor, so shapes do not apply."""
    for frame in reversed(_PYRO_STACK):
        if isinstance(frame, TraceMessenger):
            return frame.trace
    return None


def seed_context(module) -> None:
    """Inside ``module``'s context (e.g. a likelihood's ``forward``), take the traced program's values of its
    ``PyroSample`` attributes, if it has drawn them already (see the module docstring). The values keep the shapes
    the trace holds (``[P, 1, ...]`` under vectorised particles); returns nothing."""
    trace = current_trace()
    if trace is not None and module._pyro_context.active:
        for _, _, fullname in sampled_attributes(module):
            node = trace.nodes.get(fullname)
            if node is not None and node["type"] == "sample":
                module._pyro_context.set(fullname, node["value"])


def _seed_context(module, guide: bool | None = None) -> None:
    """Put the traced program's value of each ``PyroSample`` site of ``module`` into its context's cache."""
    attrs = sampled_attributes(module)
    if not attrs:
        return
    trace = current_trace()
    if trace is None and not pyro.poutine.runtime.am_i_wrapped():
        raise ValueError(
            f"{', '.join(a[2] for a in attrs)}: PyroSample hyperparameter(s) need a Pyro program to take their "
            "values from: run the layer under SVI or Predictive, or under poutine.replay(trace=guide_trace) / "
            "poutine.condition(data={...}) to predict with given values (a bare call would draw them from the prior "
            "anew at each read)."
        )
    ctx = module._pyro_context
    missing = []
    for _, _, fullname in attrs:
        node = None if trace is None else trace.nodes.get(fullname)
        if node is not None and node["type"] == "sample":
            ctx.set(fullname, node["value"])
        elif guide and trace is not None:
            missing.append(fullname)
    if missing:
        raise ValueError(
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} a PyroSample prior but no guide has drawn "
            "it before this layer's guide. Put a guide for it first, e.g. AutoGuideList with "
            "AutoNormal(poutine.block(model, expose=[...])) added before the layer's guide, or make it a PyroParam."
        )


def layer_method(fn=None, *, guide_arg: str | None = None, owner: str | None = None):
    """Like :func:`pyro.nn.pyro_method`, and seeds the module's context with the values that the traced program
    already drew for its ``PyroSample`` attributes (see the module docstring). ``guide_arg``: name of a boolean
    argument that says the call is the guide's (then a missing draw is an error). ``owner``: the name of the
    attribute that holds the module, for a method of a helper object that computes with a layer's modules (a
    variational strategy: :mod:`pyro_sparsegp.variational`). A decorator: it leaves the wrapped method's argument
    and return shapes unchanged."""

    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            module = self if owner is None else getattr(self, owner)
            check_not_superseded(module)
            with module._pyro_context, in_layer(getattr(module, "name", None)):
                guide = kwargs.get(guide_arg, False) if guide_arg else None
                _seed_context(module, guide)
                return fn(self, *args, **kwargs)

        return method

    return wrap if fn is None else wrap(fn)


def draw_hyperparameters(module) -> None:
    """Read every ``PyroSample`` attribute once (inside the module's context), so that each is a site at the
    current plate level (call outside the data plate): each value has its prior's shape, with the particle
    dimensions on the left (``[P, 1, ...]``) under vectorised particles; returns nothing."""
    for sub, name, _ in sampled_attributes(module):
        getattr(sub, name)


class _Same:
    """Key item equal only to the same tensor object at the same version (holds a reference, so an ``id`` is
    never reused while the key lives)."""

    __slots__ = ("t", "v")

    def __init__(self, t):
        self.t, self.v = t, t._version

    def __hash__(self):
        return id(self.t)

    def __eq__(self, other):
        return isinstance(other, _Same) and self.t is other.t and self.v == other.v


def values_key(module) -> tuple:
    """Key of everything that enters a layer's covariances: each parameter's storage and version, each sampled
    hyperparameter's value (by identity), and the grad mode. Call inside the module's context. Returns a tuple
    of identities and versions, not a tensor, so shapes do not apply. While a compiler traces
    (:func:`~pyro_sparsegp.context.deferred.tracing`) a tensor has no storage to name: the key is then a fresh
    object, equal to no other, so nothing is taken from a cache."""
    if deferred.tracing():
        return (object(),)
    key = tuple((p.data_ptr(), p._version) for p in module.parameters())
    sampled = tuple(_Same(getattr(sub, name)) for sub, name, _ in sampled_attributes(module))
    return key + sampled + (torch.is_grad_enabled(),)


def check_plate_alignment(f: torch.Tensor, site: str, outputs_dim: int | None = None) -> None:
    """Raise ``ValueError`` if ``f`` has a batch dimension of size > 1 that no active plate owns (other than the
    layer's outputs dimension ``outputs_dim``), or more dimensions than the outermost plate reaches. ``f`` is a
    site's value or location, ``[..., B]`` or ``[..., L, B]`` (``outputs_dim=-2``)."""
    plates = {}
    for frame in _PYRO_STACK:
        if isinstance(frame, PlateMessenger) and frame.dim is not None:
            plates[frame.dim] = frame.subsample_size
    if not plates:
        return
    outer = min(plates)
    for d in range(-f.dim(), 0):
        size = f.shape[d]
        if d == outputs_dim or size == 1:
            continue
        if d < outer or d not in plates:
            raise ValueError(
                f"site {site!r}: f has shape {tuple(f.shape)}, whose dim {d} (size {size}) belongs to no plate "
                f"(plates at dims {sorted(plates)}). The inputs' leading dimensions must line up with the plates "
                "like any Pyro batch: X [..., B, D] with X's dim -3 at f's dim -2. Feed a hidden layer's output "
                "as layer.sample_hidden(...) returns it ([..., 1, B, L]), not f.transpose(-1, -2)."
            )


def read_params(module) -> dict:
    """Values of ``module``'s ``PyroParam`` and ``PyroSample`` attributes, read now (inside its context, so that
    ``SVI`` sees them as parameters / sites of the program)."""
    names = list(module.__dict__.get("_pyro_params", {})) + list(module.__dict__.get("_pyro_samples", {}))
    return {n: getattr(module, n) for n in names}


class BoundModule:
    """A view of a PyroModule whose ``PyroParam``/``PyroSample`` attributes are fixed to values read once (inside
    the program), and whose methods see those values. Distributions that call their likelihood lazily, at
    ``log_prob`` time outside the module's context (:class:`~pyro_sparsegp.distributions.MarginalizedLikelihood`),
    hold a bound likelihood so that its parameters are the ones the program registered, and so trained by SVI.
    Attribute values keep their shapes (a sampled one its trace shape, e.g. ``[P, 1, 1]``)."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)
        with module._pyro_context:
            object.__setattr__(self, "_values", read_params(module))

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        module = object.__getattribute__(self, "_module")
        attr = getattr(type(module), name, None)
        if callable(attr) and not isinstance(attr, (staticmethod, classmethod, type)):
            return functools.partial(attr, self)
        return getattr(module, name)


def plate(name: str, size: int, subsample_size: int | None = None, dim: int | None = None, subsample=None,
          device=None) -> pyro.plate:
    """``pyro.plate`` that joins a plate of the same name already drawn in the program being traced.

    ``AutoGuideList`` creates, before its parts run, every plate of the model, subsampled ones included (a
    subsampled plate is a site: its minibatch indices). A guide part that then opens the same plate would record a
    second site of that name (``Multiple sample sites named 'data'``). This function opens the plate on the indices
    already drawn, without recording them again, so a guide written with it works alone and as a part of
    ``AutoGuideList`` (the layers' own ``model``/``guide`` use it; use it for a data plate you own in a guide that
    sits beside autoguides). A drawn plate of another size, or with another number of indices than asked for, is
    refused with a ``ValueError``: its indices belong to other data (AutoGuideList draws its plates from the first
    call's arguments unless given ``create_plates``).

    Entering it yields the minibatch indices, a long tensor of shape ``[subsample_size]`` (``[size]`` when not
    subsampled), as ``pyro.plate`` does."""
    trace = current_trace()
    node = None if trace is None else trace.nodes.get(name)
    if node is not None and node["type"] == "sample":
        drawn_size, drawn = getattr(node["fn"], "size", size), len(node["value"])
        want = len(subsample) if subsample is not None else size if subsample_size is None else subsample_size
        same = subsample is None or (drawn == want and bool((node["value"] == subsample.to(node["value"])).all()))
        if drawn_size != size or drawn != want or not same:
            raise ValueError(
                f"plate {name!r} of size {size} (subsample_size={subsample_size}) joins the plate of that name "
                f"already drawn in this program, which has size {drawn_size} and {drawn} indices. AutoGuideList "
                "draws the model's plates from its prototype trace, i.e. from the first call's data (the training "
                "set and minibatch size); a call on other inputs (Predictive on test points) needs plates drawn from "
                "its own arguments: AutoGuideList(gp.model, create_plates=gp.create_plates) for a layer's or deep "
                "model's own model, or for a model of yours AutoGuideList(model, create_plates=lambda X, *args, "
                f"subsample_size=None, **kw: pyro.plate({name!r}, X.shape[-2], subsample_size=subsample_size, dim=-1))."
            )
        with pyro.poutine.block(hide=[name]):
            return pyro.plate(name, size, dim=dim, subsample=node["value"], device=device)
    return pyro.plate(name, size, subsample_size=subsample_size, dim=dim, subsample=subsample, device=device)
