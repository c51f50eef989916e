"""The rules of :mod:`pyro_sparsegp.checks.program`, read from Pyro traces: each returns the lines of its problems.
Sites' batch shapes ``[..., L, B]`` are read, never their values; the scale rule is the minibatch estimate of Hensman,
Fusi, Lawrence 2013, section 3.1."""

from __future__ import annotations

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


def problems(model_trace, guide_trace, layers: dict) -> list[tuple[str, str]]:
    """``(site, line)`` for every problem of the program (model trace and the guide trace it replayed): the sites'
    batch shapes ``[..., L, B]`` against their plates, and the scale of a minibatch (Hensman, Fusi, Lawrence 2013,
    section 3.1)."""
    traces = [t for t in (model_trace, guide_trace) if t is not None]
    plates = plates_of(traces)
    nesting = max((-f.dim for f in plates.values()), default=0)
    out = []
    for name, site in model_trace.nodes.items():
        if (site["type"] != "sample" or not site["is_observed"] or isinstance(site["fn"], _Subsample)
                or site["infer"].get("_deterministic")):
            continue
        for line in (_observed(name, site, plates, nesting), _unscaled(name, site, plates)):
            if line:
                out.append((name, line))
    for kind, trace in (("model", model_trace), ("guide", guide_trace)):
        if trace is not None:
            out += _layer_sites(trace, layers, kind)
    return out


def _observed(name: str, site, plates: dict, nesting: int) -> str | None:
    """An observed site's batch dimensions inside the plate nesting: size 1 where no plate covers it, the plate's
    (minibatch) size where one does."""
    fn = site["fn"]
    batch, covered = tuple(fn.batch_shape), {f.dim: f for f in _frames(site)}
    expected, reasons = list(batch), []
    for d in range(-min(len(batch), nesting), 0):
        n, f = batch[d], covered.get(d)
        if f is None and n > 1:
            expected[d] = 1
            reasons.append(f"dim {d} (size {n}) belongs to no plate of the site{_repeated(site, d, n)}; "
                           + _hint(d, n, plates, len(fn.event_shape)))
        elif f is not None and n != f.size:
            expected[d] = f.size
            minibatch = f" (a minibatch of {f.full_size})" if f.size < f.full_size else ""
            reasons.append(f"dim {d} has size {n} but its plate {f.name!r} has size {f.size}{minibatch}: observe "
                           "the plate's rows, y[idx] with the indices the plate yields")
    if not reasons:
        return None
    return (f"site {name!r}: batch shape {batch}, expected {tuple(expected)} (the program's plates reach dim "
            f"{-nesting}): " + "; ".join(reasons))


def _repeated(site, d: int, n: int) -> str:
    """Whether the observed value itself has dimension ``d`` of the batch (else it is broadcast: counted ``n``
    times)."""
    value, event = site["value"], len(site["fn"].event_shape)
    shape = tuple(value.shape)[: value.dim() - event] if torch.is_tensor(value) else ()
    if len(shape) < -d or shape[d] == 1:
        return f", and the observed value (shape {tuple(getattr(value, 'shape', ()))}) lacks it: each observation " \
               f"is counted {n} times"
    return ""


def _hint(d: int, n: int, plates: dict, event_dims: int) -> str:
    """The likely fix for an uncovered dimension ``d`` of size ``n``."""
    particles = plates.get(PARTICLES)
    outputs = [f.name[: -len(".outputs")] for f in plates.values() if f.name.endswith(".outputs") and f.dim == d]
    inside = (f"observe y inside the outputs plate of layer {outputs[0]!r} (with layer.outputs_plate(): ...)"
              if outputs else f"observe y inside a plate at dim {d}")
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
        return f"observe it inside plate {same[0].name!r} (dim {d}, size {n}){where}"
    return (f"declare that dimension with a plate, pyro.plate('name', {n}, dim={d}), or move it into the event shape "
            "(.to_event(1))")


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
