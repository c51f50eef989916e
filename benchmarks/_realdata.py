"""Shared parts of the real-data benchmarks against the peers (``counts_nmes.py``, ``heteroscedastic.py``,
``multioutput_weather.py``): the method table with its hooks, the training clock with test evaluations, the
Gauss-Hermite predictive densities every method is scored with, the rows, the time from which a run stays near its
peer's final NLPD (:func:`settle`) and the done-when conditions of issue 47 (:func:`condition`). The GPyTorch models,
their optimisers and training loop are in ``_gpytorch.py``, shared with the other benchmarks.

A method is a :class:`Method`: a function ``run(task, cfg) -> Trace``, its library, the method whose final test NLPD
is its target (``peer``) and ``needs``, which returns ``None`` when the method can run on this branch or a reason
(e.g. ``"ps.Poisson is not on this branch"``) when it cannot; such a method is reported, not run. Each script's
``METHODS`` table lists them; the models of ours that other branches add plug in as hooks there.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

ROW_KEYS = ("dataset", "split", "method", "library", "test_nlpd", "rmse", "time_s", "time_to_peer_s", "steps", "M")


@dataclass
class Task:
    """One split of a real-data set: training ``X [N, D]``, ``y [N]`` (or ``[N, L]``), test ``Xt``, ``yt``, the
    inducing inputs ``Z [M, D]`` and the targets' scale ``y_std`` (1 where the targets are not rescaled)."""

    name: str
    split: int
    X: torch.Tensor
    y: torch.Tensor
    Xt: torch.Tensor
    yt: torch.Tensor
    Z: torch.Tensor
    y_std: float = 1.0


@dataclass
class Method:
    run: object  # run(task, cfg) -> Trace
    library: str  # "gpytorch", "pyro_sparsegp", "torch" (the GLMs)
    peer: str | None = None  # the method whose final test NLPD this one is timed to
    needs: object = None  # () -> None when runnable here, else the reason it is not
    note: str = ""

    def missing(self) -> str | None:
        return None if self.needs is None else self.needs()


@dataclass
class Trace:
    """Training clock with test evaluations every ``every`` steps, whose time is excluded: ``points`` holds
    ``(step, seconds, metrics)`` with ``metrics`` a dict (``test_nlpd``, and ``rmse`` where it applies)."""

    evaluate: object
    every: int
    points: list = field(default_factory=list)
    step: int = 0
    excluded: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def tick(self, final: bool = False) -> None:
        self.step += 1
        if self.step % self.every == 0 or final:
            self.record()

    def record(self) -> None:
        """An evaluation now (at the current step), its time left off the clock."""
        t = time.perf_counter()
        clock = t - self.start - self.excluded
        with torch.no_grad():
            metrics = self.evaluate()
        self.points.append((self.step, clock, metrics))
        self.excluded += time.perf_counter() - t

    @property
    def final(self) -> dict:
        return self.points[-1][2]

    @property
    def seconds(self) -> float:
        return self.points[-1][1]


def settle(curve: list, target: float, tol: float) -> float | None:
    """Training seconds from which a run stays within ``tol`` nats of ``target``: the clock of the first evaluation
    of ``curve`` (``[[step, seconds, test_nlpd], ...]``) after which every test NLPD, its own included, is at most
    ``target + tol`` (``None``: the last one is above). A run that dips below the target early and climbs back (the
    Poisson's wide predictive at the prior q(u) scores well on over-dispersed counts) has not reached it."""
    t = None
    for _, clock, nlpd in reversed(curve):
        if nlpd > target + tol:
            break
        t = clock
    return t


def retime(rows: list[dict], tol: float) -> list[dict]:
    """``time_to_peer_s`` of every row recomputed from its curve and ``peer_nlpd`` with :func:`settle` (``tol``)."""
    for r in rows:
        if r.get("peer_nlpd") is not None:
            r["time_to_peer_s"] = settle(r["curve"], r["peer_nlpd"], tol)
    return rows


def gauss_hermite(n: int = 64, dtype=None):
    """Nodes ``x [n]`` and weights ``w [n]`` (summing to 1) of ``E[g(x)], x ~ N(0, 1)``."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    dtype = dtype or torch.get_default_dtype()
    return torch.as_tensor(x, dtype=dtype), torch.as_tensor(w / w.sum(), dtype=dtype)


def predictive(make_dist, y, mean, var, n: int = 64):
    """Log predictive density ``log ∫ p(y|f) N(f; mean, var) df`` ``[T]`` and predictive mean ``E[y]`` ``[T]`` of an
    element-wise likelihood, ``make_dist(f [T, n])`` a torch distribution of ``y``, by ``n``-point Gauss-Hermite
    quadrature (the same for every library: each is scored by its own likelihood, not its own predictive code)."""
    x, w = gauss_hermite(n, mean.dtype)
    f = mean.unsqueeze(-1) + var.clamp_min(0).sqrt().unsqueeze(-1) * x  # [T, n]
    d = make_dist(f)
    lp = torch.logsumexp(d.log_prob(y.unsqueeze(-1)) + w.log(), -1)
    return lp, (d.mean * w).sum(-1)


def predictive2(make_dist, y, mean, var, n: int = 32):
    """:func:`predictive` for a likelihood of two latent functions with independent marginals ``mean``, ``var``
    ``[T, 2]``: the ``n x n`` product Gauss-Hermite rule, ``make_dist(f [T, 2, n * n])`` a torch distribution of
    ``y`` of batch ``[T, n * n]`` (or ``[T, 1, n * n]``, a multi-latent likelihood's site shape)."""
    x, w = gauss_hermite(n, mean.dtype)
    sd = var.clamp_min(0).sqrt()
    f0 = (mean[:, 0, None, None] + sd[:, 0, None, None] * x[:, None]).expand(-1, n, n)  # [T, n, n]
    f1 = (mean[:, 1, None, None] + sd[:, 1, None, None] * x[None, :]).expand(-1, n, n)
    f = torch.stack([f0.reshape(len(y), -1), f1.reshape(len(y), -1)], 1)  # [T, 2, n * n]
    d, W = make_dist(f), (w[:, None] * w[None, :]).reshape(-1)
    T = len(y)
    lp_nodes = d.log_prob(y.reshape((T,) + (1,) * (len(d.batch_shape) - 1))).reshape(T, -1)  # [T, n * n]
    return torch.logsumexp(lp_nodes + W.log(), -1), (d.mean.reshape(T, -1) * W).sum(-1)


def split_rows(runs: dict, methods: dict, info: dict, tol: float) -> list[dict]:
    """One row per run of a cell (``info``: ``dataset``, ``split``, ``M``): final test NLPD (and RMSE), training
    seconds, steps, and ``time_to_peer_s``, the training time from which the run stays within ``tol`` of its peer's
    final test NLPD (:func:`settle`; ``None``: never; the peer's own is its time to settle near its own final
    value); ``curve``: ``[[step, seconds, test_nlpd], ...]`` at every evaluation."""
    rows = []
    for name, tr in runs.items():
        m = methods[name]
        peer = runs.get(m.peer or name)
        target = None if peer is None else peer.final["test_nlpd"]
        curve = [[step, clock, m["test_nlpd"]] for step, clock, m in tr.points]
        row = {**info, "method": name, "library": m.library, "test_nlpd": tr.final["test_nlpd"],
               "rmse": tr.final.get("rmse"), "time_s": tr.seconds,
               "time_to_peer_s": None if target is None else settle(curve, target, tol), "steps": tr.points[-1][0],
               "peer": m.peer or name, "peer_nlpd": target, "curve": curve}
        rows.append({k: v for k, v in row.items() if v is not None or k in ROW_KEYS})
    return rows


def summarize(rows: list[dict], keys=("dataset", "method")) -> list[dict]:
    """Mean and standard error over splits of ``test_nlpd`` (and ``rmse``), mean ``time_s`` and the number of splits
    that reached the peer (``reached``), per ``keys``."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, rs in groups.items():
        s = dict(zip(keys, key, strict=True)) | {"library": rs[0]["library"], "splits": len(rs)}
        for k in ("test_nlpd", "rmse"):
            v = [r[k] for r in rs if r.get(k) is not None]
            if v:
                s[k] = float(np.mean(v))
                s[k + "_se"] = float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
        s["time_s"] = float(np.mean([r["time_s"] for r in rs]))
        reached = [r["time_to_peer_s"] for r in rs if r["time_to_peer_s"] is not None]
        s["reached"] = f"{len(reached)}/{len(rs)}"
        s["time_to_peer_s"] = float(np.median(reached)) if reached else None
        out.append(s)
    return out


def condition(rows: list[dict], label: str, a: str, b: str, rule: str = "beats", timed: bool = False,
              dataset: str | None = None, tol: float = 0.0) -> dict | None:
    """One done-when condition of issue 47 over the splits both ``a`` and ``b`` ran (``dataset``: only its rows):
    the paired differences of final test NLPD ``a - b`` (mean, standard error, splits on which ``a`` is lower).
    ``rule``: ``"beats"`` (met when the mean difference is below 0 and ``a`` is lower on most splits) or
    ``"no_worse"`` (met when it is at most one standard error above 0); a mean difference within one standard error
    of 0 is marked a tie. ``timed``: also the splits on which ``a`` settled within ``tol`` of ``b``'s final test NLPD
    (:func:`settle`) within ``b``'s training time, and the condition then needs that on a majority of splits.
    ``None`` when no split has both."""
    by = {}
    for r in rows:
        if dataset is None or r["dataset"] == dataset:
            by.setdefault((r["dataset"], r["split"]), {})[r["method"]] = r
    pairs = [(c[a], c[b]) for c in by.values() if a in c and b in c]
    if not pairs:
        return None
    d = np.array([ra["test_nlpd"] - rb["test_nlpd"] for ra, rb in pairs])
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    out = {"condition": label, "a": a, "b": b, "rule": rule, "splits": len(d), "nlpd_diff": float(d.mean()),
           "nlpd_diff_se": se, "a_lower": int((d < 0).sum())}
    if rule == "beats":
        met = out["nlpd_diff"] < 0 and 2 * out["a_lower"] > len(d)
    else:
        met = out["nlpd_diff"] <= se
    text = (f"{label}: {a} - {b} = {out['nlpd_diff']:+.4f} ± {se:.4f} nats (test NLPD), {a} lower on "
            f"{out['a_lower']}/{len(d)} splits")
    if timed:
        within = []
        for ra, rb in pairs:
            t = settle(ra["curve"], rb["test_nlpd"], tol)
            within.append(t is not None and t <= rb["time_s"])
        out["in_time"] = int(sum(within))
        met = met and 2 * out["in_time"] > len(d)
        text += f"; settled within {tol:g} of {b}'s final NLPD within {b}'s time on {out['in_time']}/{len(d)}"
    out["met"], out["tie"] = bool(met), bool(abs(out["nlpd_diff"]) <= se)
    out["text"] = text + f" -> {'met' if met else 'NOT met'} ({rule}{', a tie within 1 se' if out['tie'] else ''})"
    return out


def conditions(rows: list[dict], specs: list[tuple], tol: float, log=print) -> list[dict]:
    """The done-when conditions ``specs`` (each the arguments of :func:`condition` after ``rows``; ``tol`` for the
    timed ones) that have rows, printed one a line under the heading "Done when"."""
    out = [c for spec in specs if (c := condition(rows, *spec[:3], **{"tol": tol, **(spec[3] if len(spec) > 3
                                                                                      else {})}))]
    log("\nDone when (issue 47):")
    for c in out:
        log("  " + c["text"])
    return out


def run_methods(methods: dict, names: list[str], task, cfg, log=print) -> dict:
    """Run the runnable ``names`` of ``methods`` on ``task``; a method that cannot run here is reported once."""
    runs = {}
    for name in names:
        reason = methods[name].missing()
        if reason:
            if name not in run_methods.reported:
                log(f"# {name}: not run ({reason}); its hook is in METHODS")
                run_methods.reported.add(name)
            continue
        torch.manual_seed(cfg.seed)
        runs[name] = methods[name].run(task, cfg)
        m = runs[name].final
        log(f"#   {task.name} split {task.split} {name:18s} test NLPD {m['test_nlpd']:.4f}"
            + (f", RMSE {m['rmse']:.4f}" if m.get("rmse") is not None else "")
            + f", {runs[name].seconds:.1f} s, {runs[name].points[-1][0]} steps", flush=True)
    return runs


run_methods.reported = set()


def load_rows(paths: str) -> list[dict]:
    """The method rows of earlier runs' ``--json`` files (``paths`` comma-separated; their done-when entries, which
    have a ``condition`` key, are left out and recomputed)."""
    import json

    rows = []
    for path in paths.split(","):
        with open(path) as fh:
            rows += [r for r in json.load(fh) if "condition" not in r]
    return rows


def parse_splits(text: str) -> list[int]:
    """``"0-9"`` or ``"0,3,5"`` -> the list of split numbers."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def random_split(n: int, seed: int, test_fraction: float = 0.1):
    """``(train, test)`` index arrays of a random split of ``n`` rows (``numpy.random.default_rng(seed)``)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = max(1, round(test_fraction * n))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def inducing_subset(X: torch.Tensor, M: int, seed: int) -> torch.Tensor:
    """``M`` distinct training inputs ``[M, D]`` drawn at random (seed ``seed``): the same initial Z for everyone."""
    g = torch.Generator().manual_seed(seed)
    return X[torch.randperm(len(X), generator=g)[: min(M, len(X))]].clone()


# -- ours ---------------------------------------------------------------------------------------------------------
def ours_fit(gp, X, y, steps: int, batch_size: int, trace: Trace, lr: float = 0.01, **kw) -> Trace:
    """``pyro_sparsegp.infer.fit`` with its defaults (``lr``, natural gradients ``"auto"``, ``finish="auto"``), the
    trace ticking at every step; a last evaluation after ``fit`` returns (its exact finish, timed as training)."""
    from pyro_sparsegp.infer import fit

    fit(gp, X, y, num_steps=steps, batch_size=min(batch_size, len(X)), lr=lr, progress=False,
        callback=lambda step, loss: trace.tick(), **kw)
    trace.record()
    return trace


# -- the command line and start shared by the three real-data scripts ------------------------------------------------
def add_method_arguments(p, methods: dict) -> None:
    """``--summarize`` (join earlier runs' rows, run nothing) and ``--methods`` (names of ``methods``)."""
    p.add_argument("--summarize", default=None, metavar="A.json,B.json",
                   help="join the rows of earlier runs' --json files, print the tables and the done-when; run nothing")
    p.add_argument("--methods", default=",".join(methods), help="comma-separated names of METHODS")


def parse_methods(p, a, methods: dict):
    """``a.methods`` as a list, refused (by ``p.error``) where a name is not in ``methods``; returns ``a``."""
    a.methods = a.methods.split(",")
    unknown = set(a.methods) - set(methods)
    if unknown:
        p.error(f"--methods: unknown {sorted(unknown)}; choose from {list(methods)}")
    return a


def begin(cfg, reach_tol: float) -> list[dict]:
    """The run's set-up (threads, seed, float64, the machine's note, warnings off) and its starting rows: the
    ``--summarize`` files' rows re-timed with ``reach_tol``, or none."""
    import warnings

    from _common import machine_note, setup

    setup(cfg)
    torch.set_default_dtype(torch.float64)
    print(machine_note(torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    return retime(load_rows(cfg.summarize), reach_tol) if cfg.summarize else []
