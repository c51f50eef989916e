"""Shared helpers of the benchmarks: argument parsing, alternating timing, tables and JSON rows."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a reduced run that finishes in under two minutes")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list of flat objects")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    return p


def setup(args) -> None:
    import pyro

    # every model keeps its own parameters (Pyro's global store would share same-named ones between models)
    pyro.settings.set(module_local_params=True)
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu")


def time_alternating(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Median wall time in ms of each callable, measured round-robin (a, b, c, a, b, c, ...) so that drifts in the
    machine's speed affect every contender alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(1000 * (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in times.items()}


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(columns)]
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
        perm = torch.randperm(N, generator=g)
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


def gpytorch_svgp(Z, strategy=None, mean_inducing=None):
    """GPyTorch's SVGP (zero mean, ScaleKernel(RBF with ARD)) with ``strategy`` (default VariationalStrategy);
    with ``mean_inducing`` points, the OrthogonallyDecoupledVariationalStrategy around it."""
    import gpytorch

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            q = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
            s = (strategy or gpytorch.variational.VariationalStrategy)(self, Z, q, learn_inducing_locations=True)
            if mean_inducing is not None:
                s = gpytorch.variational.OrthogonallyDecoupledVariationalStrategy(
                    s, mean_inducing, gpytorch.variational.DeltaVariationalDistribution(mean_inducing.shape[0]))
            super().__init__(s)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=Z.shape[-1]))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return Model()
