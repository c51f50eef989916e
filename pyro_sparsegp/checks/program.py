r"""Shape mistakes are loud: :func:`check_model` traces a program around the layers and raises
:class:`ModelShapeError` where the ELBO would count the data wrongly.

Pyro's own check (``pyro.util.check_site_shape``) accepts any size at a batch dimension inside
``max_plate_nesting`` that no plate of the site covers, and ignores every dimension left of it. With a layer's
outputs plate (``dim=-2``) and 8 vectorised particles (their plate at ``dim=-3``), a one-output layer's ``f`` is
``[8, 1, B]``; ``f.squeeze()`` is ``[8, B]``, and the observed ``y`` under the particle plate gets the batch shape
``[8, 8, B]``; ``f.unsqueeze(-2)`` is ``[8, 1, 1, B]``, and ``y`` beside a two-output layer's ``[8, 2, B]`` gets
``[8, 8, 1, B]``: every observation counted 8 times, with no error. The rules checked here, on the traces of the guide
and of the model replayed on it (``docs/writing_programs.md`` has an example of each):

* **every sample site** (observed or latent, of the model and of the guide; not Pyro's subsample sites) has size 1 at
  every batch dimension left of the program's plate nesting, its particle plate included (an ``unsqueeze`` or
  ``expand`` that added a dimension on the left), and, inside the nesting, size 1 at every dimension that no plate of
  the site covers and its plate's (minibatch) size at every covered one;
* an **observed site** has one log-probability term per element of its plates: its batch shape broadcast with the
  observed value's, per particle, against the product of its plates' sizes (an observed value with more dimensions
  than the distribution; checked where the shape rule found nothing, so that one mistake gives one line);
* an observed site with a subsampled plate's minibatch size ``B < N`` along that plate's dimension is in a subsampled
  plate, or scaled otherwise: the minibatch estimate of the likelihood is scaled by ``N / B`` (Hensman, Fusi,
  Lawrence 2013, section 3.1);
* a **layer's sites** stand where the site contract puts them (``docs/conventions.md``): ``<name>.f`` (and
  ``<name>.f_perp``) under a plate at ``dim=-1`` (the layer's data plate or the user's own), the inducing sites
  ``<name>.u`` (``<name>.v``) in none.

Each problem is one line, ``site 'y': batch shape (...), expected (...) (...): <reason>; <fix>``. What no shape can
show is not caught: two dimensions of one size transposed, particles as many as a plate's size, a wrong factor.

**Automatic checks.** ``ps.infer.fit`` calls :func:`check_model` once, before its first step, when it trains with a
Pyro ELBO. :class:`~pyro_sparsegp.infer.NaturalGradient` is given no model: every layer's ``sample_u`` (its
first site) records the trace under construction with :func:`record_layer`, and the optimiser's first step checks the
last model and guide traces recorded (:class:`FirstStepCheck`). Pyro frees its traces before it calls the optimiser,
so a weak reference would not reach them: the record is a strong reference, kept only while an optimiser awaits its
first step (nothing is recorded otherwise, so a check costs nothing after the first step).
"""

from __future__ import annotations

import contextlib
import weakref

import pyro
import torch
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.trace_messenger import TraceMessenger

from .rules import PARTICLES, plates_of, problems

__all__ = ["ModelShapeError", "check_model", "check_traces", "record_layer", "FirstStepCheck"]

#: the vectorised particles of :func:`check_model`'s second pass without ``elbo=``
CHECK_PARTICLES = 3


class ModelShapeError(ValueError):
    """A program whose ELBO would count the data wrongly: a site's batch shape, a missing scale or a layer's site
    outside its plate (:mod:`pyro_sparsegp.checks.program`), so that ``Trace_ELBO`` would not estimate the bound of
    Hensman, Matthews, Ghahramani 2015, eq. 21. ``problems`` holds one line per problem, ``sites`` the names of the
    sites concerned."""

    def __init__(self, message: str, problems: list | None = None, sites: list | None = None):
        super().__init__(message)
        self.problems, self.sites = list(problems or []), list(sites or [])


# -- the record of the traces that contain a layer -------------------------------------------------------------------
_WAITING = weakref.WeakSet()  # FirstStepCheck objects whose first step has not come: recording is on while any waits
_RECORDS = [{}]  # the active records, {"model" | "guide": (trace, {layer name: inducing sites})}; check_model pushes


def _trace_under_construction():
    """The trace of the innermost recording ``poutine.trace`` (not SVI's parameter capture), or ``None``."""
    for frame in reversed(_PYRO_STACK):
        if isinstance(frame, TraceMessenger) and not frame.param_only:
            return frame.trace
    return None


def record_layer(layer, guide: bool) -> None:
    """Note that ``layer`` runs in the trace under construction (called by each layer's ``sample_u``, its first site),
    the guide's (``guide=True``) or the model's: the traces of the sites of Hensman, Matthews, Ghahramani 2015,
    eq. 21. Does nothing unless a check awaits (module docstring); takes and returns no tensor, so shapes do not
    apply."""
    if not _WAITING and len(_RECORDS) == 1:
        return
    trace = _trace_under_construction()
    if trace is None:
        return
    records, key = _RECORDS[-1], "guide" if guide else "model"
    if key not in records or records[key][0] is not trace:
        records[key] = (trace, {})
    records[key][1][layer.name] = tuple(layer.strategy.sites)


@contextlib.contextmanager
def _own_records():
    """Records of :func:`check_model`'s own traces, apart from those an optimiser awaits; yields the dict."""
    _RECORDS.append({})
    try:
        yield _RECORDS[-1]
    finally:
        _RECORDS.pop()


def _belongs(traces, params) -> bool:
    """Whether any parameter of ``traces`` is among ``params`` (unconstrained tensors, as SVI hands them over)."""
    ids = {id(p) for p in params}
    for trace in traces:
        for site in trace.nodes.values():
            if site["type"] == "param":
                raw = getattr(site["value"], "unconstrained", None)
                if raw is not None and id(raw()) in ids:
                    return True
    return False


def _replayed(model_trace, guide_trace) -> bool:
    """Whether the model trace replayed the guide trace: a latent site of the model holds the guide's value."""
    for name, site in guide_trace.nodes.items():
        node = model_trace.nodes.get(name)
        if site["type"] == "sample" and not site["is_observed"] and node is not None and node["value"] is site["value"]:
            return True
    return False


class FirstStepCheck:
    """What an optimiser holds to check, at its first step, the program that SVI has just run: created, it turns the
    record on (:func:`record_layer`); called with SVI's parameters, it checks the last model and guide traces that
    contained a layer (:func:`check_traces`) and turns its part of the record off. Skips silently when no layer was
    recorded, or when the recorded traces hold none of the parameters (another program's). Returns ``None`` so that
    ``self._check = self._check and self._check(params)`` runs it once. Reads shapes only (sites' ``[..., B]``), no
    values; the rules are those of :func:`check_traces` (the scale of Hensman, Fusi, Lawrence 2013, section 3.1)."""

    def __init__(self):
        _WAITING.add(self)

    def __call__(self, params) -> None:
        _WAITING.discard(self)
        records = dict(_RECORDS[0])
        if not _WAITING:
            _RECORDS[0].clear()
        if "model" not in records:
            return None
        model_trace, layers = records["model"]
        guide_trace, guide_layers = records.get("guide", (None, {}))
        if guide_trace is not None and not _replayed(model_trace, guide_trace):
            guide_trace, guide_layers = None, {}  # another program's guide
        traces = [t for t in (model_trace, guide_trace) if t is not None]
        if _belongs(traces, params):
            check_traces(model_trace, guide_trace, {**guide_layers, **layers},
                         where="at NaturalGradient's first step (the program SVI ran)")
        return None


def check_traces(model_trace, guide_trace=None, layers=None, where: str = "") -> None:
    """Raise :class:`ModelShapeError` listing every problem of a model trace (and of the guide trace it replayed) by
    the rules of :mod:`pyro_sparsegp.checks.program`; ``layers`` maps each layer's name to its inducing sites
    (``("u",)``, SOLVE-GP ``("u", "v")``), ``where`` says which run it was. Reads the sites' batch shapes
    (``[..., L, B]``), no values; the scale rule is the minibatch estimate of Hensman, Fusi, Lawrence 2013, section
    3.1."""
    found = problems(model_trace, guide_trace, layers or {})
    if found:
        sites = list(dict.fromkeys(site for site, _ in found))
        lines = [line for _, line in found]
        head = f"the program would count the data wrongly{' ' + where if where else ''}"
        raise ModelShapeError(head + ":\n- " + "\n- ".join(lines), lines, sites)


def _traces(model, guide, args, kwargs, particles: int = 0, dim: int | None = None):
    """The guide's trace and the model's replayed on it, both under a plate of ``particles`` vectorised particles at
    ``dim`` if ``particles > 1`` (as Pyro's ELBOs with ``vectorize_particles=True``)."""
    if particles > 1:
        model, guide = (pyro.plate(PARTICLES, particles, dim=dim)(fn) for fn in (model, guide))
    guide_trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    model_trace = pyro.poutine.trace(pyro.poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    return model_trace, guide_trace


def _nesting(traces) -> int:
    """The program's plate nesting: how far left of the right end its plates reach (Pyro's guess, as its ELBOs)."""
    return max((-f.dim for f in plates_of(traces).values()), default=0)


def _check_run(model, guide, args, kwargs, records, particles=0, dim=None) -> int:
    """Trace and check one run (``particles`` vectorised particles at ``dim``); returns its plate nesting."""
    records.clear()
    model_trace, guide_trace = _traces(model, guide, args, kwargs, particles, dim)
    layers = {**records.get("guide", (None, {}))[1], **records.get("model", (None, {}))[1]}
    where = f"under {particles} vectorised particles (plate at dim {dim})" if particles > 1 else "(traced plainly)"
    check_traces(model_trace, guide_trace, layers, where)
    return _nesting([model_trace, guide_trace])


def check_model(model, guide, *args, elbo=None, **kwargs) -> None:
    """Trace ``guide(*args, **kwargs)``, replay ``model`` on it and raise :class:`ModelShapeError` where the ELBO
    would count the data wrongly (the rules of :mod:`pyro_sparsegp.checks.program`): an observed site broadcast against
    particles or a plate (a batch shape ``[8, 8, B]`` where ``[8, 1, B]`` is due), a minibatch site without the scale
    ``N / B`` of Hensman, Fusi, Lawrence 2013, section 3.1, a layer's ``f`` outside a plate at ``dim=-1`` or its ``u``
    inside one. The error names each site, its shape, the expected shape and the likely fix.

    :param elbo: the Pyro ELBO you train with (e.g. ``Trace_ELBO(num_particles=8, vectorize_particles=True,
        max_plate_nesting=2)``): the program is checked in its configuration, under its vectorised particles if it
        has them. ``None``: checked once plainly and once under 3 vectorised particles, their plate left of the
        program's plates (the nesting taken from the first trace); pass your ELBO if you do not vectorise particles.

    Runs without gradients and restores every random number generator, so a correct program passes unchanged and
    nothing is trained; parameters that the guide creates at its first call (an autoguide's) are created, as SVI's
    first step would. Returns ``None``.
    """
    rng = pyro.util.get_rng_state()  # torch's CPU generator, Python's and numpy's
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with torch.no_grad(), _own_records() as records:
            num = getattr(elbo, "num_particles", 1) if elbo is not None else CHECK_PARTICLES
            vectorize = elbo is None or (getattr(elbo, "vectorize_particles", False) and num > 1)
            nesting = getattr(elbo, "max_plate_nesting", float("inf")) if elbo is not None else float("inf")
            if elbo is None or not vectorize or nesting == float("inf"):
                plain = _check_run(model, guide, args, kwargs, records)
                nesting = plain + 1 if nesting == float("inf") or elbo is None else nesting
            if vectorize:
                _vectorised_run(model, guide, args, kwargs, records, num, -int(nesting), own=elbo is None)
    finally:
        pyro.util.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _vectorised_run(model, guide, args, kwargs, records, num, dim, own: bool) -> None:
    """:func:`check_model`'s run under ``num`` vectorised particles at ``dim``; a failure of the pass that the check
    adds of its own (``own``: no ``elbo`` given) is reported as such, with the way out."""
    try:
        _check_run(model, guide, args, kwargs, records, num, dim)
    except ModelShapeError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the context of the pass
        if not own:
            raise
        raise ModelShapeError(
            f"the program runs when traced plainly but fails under {num} vectorised particles (plate "
            f"{PARTICLES!r} at dim {dim}), the pass that check_model adds without elbo=: {type(exc).__name__}: {exc}. "
            "Under vectorize_particles=True every tensor keeps the particle dimension left of the plates (f of a "
            "layer with L outputs is [..., L, B]); if you train without vectorised particles, pass your ELBO: "
            "check_model(model, guide, ..., elbo=Trace_ELBO())") from exc
