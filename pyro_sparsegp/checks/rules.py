"""The rules of :mod:`pyro_sparsegp.checks.program`, read from Pyro traces: each returns the lines of its problems.
Sites' batch shapes ``[..., L, B]`` are read, never their values (only their shapes); the scale rule is the minibatch
estimate of Hensman, Fusi, Lawrence 2013, section 3.1."""

from __future__ import annotations

import math

import torch
from pyro.poutine.subsample_messenger import _Subsample

__all__ = ["PARTICLES", "plates_of", "problems"]

PARTICLES = "num_particles_vectorized"  # the name Pyro's ELBOs give the plate of vectorised particles


def _frames(site) -> list:
    return [f for f in site["cond_indep_stack"] if f.dim is not None]


def plates_of(traces) -> dict:
    """Every vectorised plate of the program, ``{name: CondIndepStackFrame}`` (``size`` the minibatch, ``full_size``
    the data). Reads the traces' plates, no tensors, so shapes do not apply; program checking: implements no paper
    equation."""
    out = {}
    for trace in traces:
        for site in trace.nodes.values():
            if site["type"] == "sample":
                for f in _frames(site):
                    out.setdefault(f.name, f)
    return out


def _checked(site) -> bool:
    """A sample site whose log-probability enters the ELBO (not a subsample site nor ``pyro.deterministic``)."""
    return (site["type"] == "sample" and not isinstance(site["fn"], _Subsample)
            and not site["infer"].get("_deterministic"))


def problems(model_trace, guide_trace, layers: dict) -> list[tuple[str, str]]:
    """``(site, line)`` for every problem of the program (model trace and the guide trace it replayed): every sample
    site's batch shape ``[..., L, B]`` against its plates and the particles, the number of log-probability terms of an
    observed site against its plates' sizes, the scale of a minibatch (Hensman, Fusi, Lawrence 2013, section 3.1)
    and the places of the layers' sites."""
    traces = [t for t in (model_trace, guide_trace) if t is not None]
    plates = plates_of(traces)
    nesting = max((-f.dim for f in plates.values()), default=0)
    enumerated = {s["infer"]["_enumerate_dim"] for t in traces for s in t.nodes.values()
                  if s["type"] == "sample" and s["infer"].get("_enumerate_dim") is not None}
    out, seen = [], set()
    for kind, trace in (("model", model_trace), ("guide", guide_trace)):
        for name, site in (trace.nodes.items() if trace is not None else ()):
            if not _checked(site) or name in seen:
                continue
            observed = site["is_observed"] and kind == "model"
            line = _batch(name, site, plates, nesting, kind, enumerated)
            if line is None and observed:
                line = _count(name, site, enumerated)
            lines = [line, _unscaled(name, site, plates) if observed else None]
            out += [(name, x) for x in lines if x]
            seen.update([name] if line else [])
    for kind, trace in (("model", model_trace), ("guide", guide_trace)):
        if trace is not None:
            out += _layer_sites(trace, layers, kind)
    return out


def _batch(name: str, site, plates: dict, nesting: int, kind: str, enumerated=frozenset()) -> str | None:
    """A site's batch dimensions: size 1 left of the program's plate nesting (particles included; not at the
    dimensions of ``enumerated`` sites, as ``TraceEnum_ELBO`` puts them) and, inside it, where no plate of the site
    covers the dimension; the plate's (minibatch) size where one does."""
    fn = site["fn"]
    batch, covered = tuple(fn.batch_shape), {f.dim: f for f in _frames(site)}
    expected, reasons = list(batch), []
    for d in range(-len(batch), 0):
        n, f = batch[d], covered.get(d)
        if d < -nesting and n > 1 and d not in enumerated:
            expected[d] = 1
            reasons.append(f"dim {d} (size {n}) is left of the program's plates{_and_particles(plates)} (they reach "
                           f"dim {-nesting}){_repeated(site, d, n)}; " + _left_hint(d, n, plates))
        elif d >= -nesting and f is None and n > 1:
            expected[d] = 1
            reasons.append(f"dim {d} (size {n}) belongs to no plate of the site{_repeated(site, d, n)}; "
                           + _hint(d, n, plates, len(fn.event_shape), site["is_observed"]))
        elif f is not None and n != f.size:
            expected[d] = f.size
            minibatch = f" (a minibatch of {f.full_size})" if f.size < f.full_size else ""
            rows = ("observe the plate's rows, y[idx] with the indices the plate yields" if site["is_observed"] else
                    "sample one value per index of the plate, loc[idx] with the indices the plate yields")
            reasons.append(f"dim {d} has size {n} but its plate {f.name!r} has size {f.size}{minibatch}: {rows}")
    if not reasons:
        return None
    while len(expected) > nesting and expected[0] == 1:  # dimensions left of the plates are not due at all
        expected.pop(0)
    which = "" if kind == "model" else " (guide)"
    return (f"site {name!r}{which}: batch shape {batch}, expected {tuple(expected)} (the program's plates reach dim "
            f"{-nesting}): " + "; ".join(reasons))


def _and_particles(plates: dict) -> str:
    return " and particles" if PARTICLES in plates else ""


def _repeated(site, d: int, n: int) -> str:
    """Whether the site's value itself has dimension ``d`` of the batch (else it is broadcast: counted ``n``
    times)."""
    value, event = site["value"], len(site["fn"].event_shape)
    shape = tuple(value.shape)[: value.dim() - event] if torch.is_tensor(value) else ()
    if len(shape) < -d or shape[d] == 1:
        what = "observed value" if site["is_observed"] else "value"
        return f", and the {what} (shape {tuple(getattr(value, 'shape', ()))}) lacks it: each term is counted {n} " \
               "times"
    return ""


def _left_hint(d: int, n: int, plates: dict) -> str:
    """The likely fix for a dimension ``d`` of size ``n`` left of the plates and particles."""
    particles = plates.get(PARTICLES)
    if particles is None:
        return (f"the ELBO sums over it: an unsqueeze or expand added a dimension left of the plates. Remove it, or "
                f"declare it with a plate, pyro.plate('name', {n}, dim={d}) (and max_plate_nesting={-d} if you set "
                "it), or move it into the event shape (.to_event(1))")
    same = (f"; it has the size of the {n} vectorised particles: particles broadcast against particles"
            if n == particles.size else "")
    return (f"an unsqueeze or expand added a dimension left of the particle dimension (plate {PARTICLES!r} at dim "
            f"{particles.dim}){same}. Keep f's layout [particles, (L,) B] as the layer returns it (its plates' "
            "singletons included): broadcasting lines a one-output f up with an [..., L, B] from the right, so it "
            "needs no f.unsqueeze(-2), f[..., None, :] or expand to a new left dimension; never squeeze or unsqueeze "
            "across the particle dimension")


def _hint(d: int, n: int, plates: dict, event_dims: int, observed: bool = True) -> str:
    """The likely fix for an uncovered dimension ``d`` of size ``n`` inside the plate nesting."""
    verb = "observe y" if observed else "sample it"
    particles = plates.get(PARTICLES)
    outputs = [f.name[: -len(".outputs")] for f in plates.values() if f.name.endswith(".outputs") and f.dim == d]
    inside = (f"{verb} inside the outputs plate of layer {outputs[0]!r} (with layer.outputs_plate(): ...)"
              if outputs else f"{verb} inside a plate at dim {d}")
    if particles is not None and particles.size == n and d > particles.dim:
        moved = (f"it has the size of the {n} vectorised particles, whose plate is at dim {particles.dim}: the "
                 "particle dimension has moved right")
        if event_dims:  # e.g. an LMC's [..., L, B] mixed into [..., B, P] and observed with .to_event(1)
            return (f"{moved}, as when a dimension of the loc goes into the event shape. Keep a singleton at dim {d} "
                    f"of the batch, loc.unsqueeze({d - event_dims}) before .to_event({event_dims}), or observe that "
                    f"dimension in a plate of its own, pyro.plate('outputs', K, dim={d}), instead of .to_event()")
        return (f"{moved}. Do not squeeze the outputs dimension: f of a layer with an outputs plate is [..., L, B]; "
                f"{inside} with f as it is, or keep a singleton at dim {d} (f[..., :1, :], not f.squeeze() or "
                "f[..., 0, :])")
    same = [f for f in plates.values() if f.dim == d and f.size == n and f.name != PARTICLES]
    if same:
        where = (f" (with layer.outputs_plate(): ... for layer {same[0].name[: -len('.outputs')]!r})"
                 if same[0].name.endswith(".outputs") else "")
        return f"{verb.split()[0]} it inside plate {same[0].name!r} (dim {d}, size {n}){where}"
    return (f"declare that dimension with a plate, pyro.plate('name', {n}, dim={d}), or move it into the event shape "
            "(.to_event(1))")


def _count(name: str, site, enumerated=frozenset()) -> str | None:
    """An observed site's log-probability terms per particle (its batch shape broadcast with the observed value's,
    enumerated dimensions left out) against the product of its plates' sizes: one term per observation."""
    fn, value = site["fn"], site["value"]
    if not torch.is_tensor(value):
        return None
    batch, event = tuple(fn.batch_shape), len(fn.event_shape)
    try:
        shape = tuple(torch.broadcast_shapes(batch, value.shape[: value.dim() - event]))
    except RuntimeError:
        return None
    frames = _frames(site)
    particles = math.prod(f.size for f in frames if f.name == PARTICLES)
    due = math.prod(f.size for f in frames if f.name != PARTICLES)
    terms = math.prod(n for d, n in zip(range(-len(shape), 0), shape, strict=True) if d not in enumerated) / particles
    if terms == due:
        return None
    expected = [1] * max([-f.dim for f in frames] or [0])
    for f in frames:
        expected[f.dim] = f.size
    names = ", ".join(f"{f.name!r} ({f.size})" for f in frames if f.name != PARTICLES) or "none"
    return (f"site {name!r}: batch shape {shape} (the distribution's {batch} broadcast with the observed value, shape "
            f"{tuple(value.shape)}), expected {tuple(expected)}: {terms:g} log-probability terms per particle where "
            f"its plates ({names}) give {due}; observe a value of the plates' shape (y[idx], with the indices the "
            "plate yields), not one with more or larger dimensions than the distribution's batch")


def _unscaled(name: str, site, plates: dict) -> str | None:
    """An observed site with a subsampled plate's minibatch size along that plate's dimension must be scaled by
    ``N / B`` (be in a subsampled plate, or under ``poutine.scale``)."""
    if any(f.size < f.full_size for f in _frames(site)):
        return None
    scale = site["scale"]
    if torch.is_tensor(scale) or scale != 1.0:
        return None
    batch, event = tuple(site["fn"].batch_shape), tuple(site["fn"].event_shape)
    for f in plates.values():
        if f.size >= f.full_size:
            continue
        d = f.dim
        along = batch[d] == f.size if len(batch) >= -d else bool(event) and event[0] == f.size
        if along:
            shape = f"batch shape {batch}" + (f", event shape {event}" if event else "")
            return (f"site {name!r}: {shape} has the minibatch size {f.size} of plate {f.name!r} (of {f.full_size} "
                    f"points, whose sites are scaled by N/B = {f.full_size}/{f.size}) but is in no subsampled plate "
                    "and has scale 1: its likelihood counts the minibatch as if it were the whole data set. Observe "
                    f"it inside a plate over all the data with the minibatch's indices, pyro.plate('data', "
                    f"{f.full_size}, subsample=idx), or inside {f.name!r}")
    return None


def _layer_sites(trace, layers: dict, kind: str) -> list[tuple[str, str]]:
    """A layer's ``f`` (``f_perp``) under a plate at dim -1, its inducing sites (``u``, ``v``) in none."""
    out = []
    for layer, inducing in layers.items():
        for suffix in ("f", "f_perp"):
            site = f"{layer}.{suffix}"
            node = trace.nodes.get(site)
            if node is None or node["type"] != "sample":
                continue
            frames = [f for f in _frames(node) if f.name != PARTICLES]
            if not any(f.dim == -1 for f in frames):
                names = ", ".join(f"{f.name!r} (dim {f.dim})" for f in frames) or "none"
                out.append((site, f"site {site!r} ({kind}, shape {tuple(node['value'].shape)}) is under no plate at "
                                  f"dim -1 (its plates: {names}): call {layer}'s sample_f inside the data plate, "
                                  "with pyro.plate('data', N, subsample_size=B) as i: f = layer.sample_f(X[i], u)"))
        for suffix in inducing:
            site = f"{layer}.{suffix}"
            node = trace.nodes.get(site)
            if node is None or node["type"] != "sample":
                continue
            data = [f for f in _frames(node) if f.dim == -1 and f.name != PARTICLES]
            if data:
                out.append((site, f"site {site!r} ({kind}, shape {tuple(node['value'].shape)}) is inside plate "
                                  f"{data[0].name!r} (dim -1, size {data[0].size}): the inducing variables are "
                                  f"shared by all the data; call {layer}'s sample_u() before entering the data "
                                  "plate, as the layer's own model does"))
    return out
