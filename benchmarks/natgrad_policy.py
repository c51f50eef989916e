"""Is ``fit``'s default safe off the papers' path? (issue #46, item 1.) For each task, ``fit`` with its defaults
(``auto``) against the fixed settings ``natgrad_lr`` 0.01, 0.03, 0.1 and Adam (``natgrad_lr=None``), over seeds,
with the task's error evaluated on the live model every ``--every`` steps. Prints a table and writes JSON rows.

    python benchmarks/natgrad_policy.py [--tasks poisson nb_nmes robust digits digits_b400 dgp]
                                        [--seeds 0 1 2 3 4] [--methods auto 0.01 0.03 0.1 adam]
                                        [--ep] [--steps TASK=N ...] [--quick] [--json PATH]

Tasks (the metric is an error: lower is better):

* ``poisson``: 1,000 simulated counts, ``x ~ U(-3, 3)``, rate ``exp(1.5 + 1.5 sin 2x)`` (1 to 20), data drawn from
  seed ``1000 + seed``; ``SVGP(RBF(1), Z = X[::20], ps.Poisson())`` (M = 50), 1,000 steps of 256, ``lr=0.02``;
  metric: RMSE of the fitted rate ``E_q[exp f]`` against the true rate at the training inputs.
* ``nb_nmes``: ``ps.NegativeBinomial()`` on ``nmes1988`` (doctor visits on the covariates; split ``seed`` of
  ``ps.datasets.load_nmes1988``), inputs standardised, M = 64 k-means-free random rows, 1,500 steps of 256,
  ``lr=0.01``; metric: test negative log predictive density per point.
* ``robust``: ``ps.StudentT()`` on the bundled power-plant data (split 0) with 5% of the training targets replaced
  by gross outliers (the target plus 10 standard deviations, sign at random; seed ``seed``), M = 64, 1,000 steps
  of 512, ``lr=0.01``; metric: test RMSE on the clean test targets (standardised units).
* ``digits`` / ``digits_b400``: ``benchmarks/natgrad_nonconjugate.py``'s robust-max classifier on scikit-learn's
  digits (1,200 train / 597 test), 300 steps on the full batch / on minibatches of 400 (a third of the data);
  metric: test error rate. ``--ep`` adds ``fit_ep`` (EP) on it, timed, for the "within 1 point of EP in at most EP's
  time" check of ``digits_b400``.
* ``dgp``: ``benchmarks/deepgp_uci.py``'s DGP 2 on kin8nm (split 0), 1,000 steps; metric: test RMSE (standardised).

``--steps TASK=N`` cuts a task's step budget (the evaluation every ``--every`` steps and the second-half check
follow it). The record ``benchmarks/records/natgrad_policy.json`` (issue #46's protocol on 2 shared CPU cores, one
process per task and seed, joined) was run as

    for t in poisson nb_nmes robust digits_b400; do for s in 0 1 2 3 4; do
        python benchmarks/natgrad_policy.py --threads 1 --tasks $t --seeds $s --ep --json /tmp/policy/${t}_s$s.json
    done; done
    for s in 0 1 2 3 4; do python benchmarks/natgrad_policy.py --threads 1 --tasks digits --steps digits=150 \\
        --seeds $s --json /tmp/policy/digits_s$s.json; done
    for s in 0 1 2 3 4; do python benchmarks/natgrad_policy.py --threads 1 --tasks dgp --steps dgp=200 \\
        --seeds $s --json /tmp/policy/dgp_s$s.json; done
    python benchmarks/natgrad_policy.py --join /tmp/policy/*_s?.json --json benchmarks/records/natgrad_policy.json

(``OMP_NUM_THREADS=1`` and ``PYTHONPATH=$PWD`` before each; ``--join`` recomputes the summary from earlier runs'
rows), with two cuts to fit the time it had: ``digits`` 150 steps instead of 300 (300 steps took about 50 s a run),
and ``dgp`` 200 steps instead of 1,000 (1,000 steps took about 160 s a run, 20 minutes a seed).

Summary per task: each method's mean error over seeds, ``auto / best fixed`` (the target: at most 1.10), and the
number of seeds on which some evaluation in the second half of the run exceeded twice the run's final error (the
target: none).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
from _common import parser, setup, table, write_json  # noqa: E402
from pyro.contrib.gp.kernels import RBF  # noqa: E402

import pyro_sparsegp as ps  # noqa: E402

METHODS = {"auto": "auto", "0.01": 0.01, "0.03": 0.03, "0.1": 0.1, "adam": None}


# -- tasks: each returns (module, X, y, fit kwargs, error(module) -> float) ---------------------------------------
def task_poisson(seed: int, quick: bool):
    g = torch.Generator().manual_seed(1000 + seed)
    X = torch.rand(1000, 1, generator=g) * 6 - 3
    rate = torch.exp(1.5 + 1.5 * torch.sin(2 * X[:, 0]))
    y = torch.poisson(rate, generator=g)
    gp = ps.SVGP(RBF(1), X[::20].clone(), ps.Poisson())

    def error(m):
        mean, var = m.predict(X)
        return float((torch.exp(mean + var / 2) - rate).pow(2).mean().sqrt())

    return gp, X, y, dict(num_steps=200 if quick else 1000, batch_size=256, lr=0.02), error


def _standardise(X, Xt):
    mu, sd = X.mean(0), X.std(0)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    return (X - mu) / sd, (Xt - mu) / sd


def task_nb_nmes(seed: int, quick: bool):
    data = ps.datasets.load_nmes1988(split=seed)
    X, Xt = _standardise(data.X_train, data.X_test)
    y, yt = data.y_train, data.y_test
    torch.manual_seed(seed)
    Z = X[torch.randperm(len(X))[:64]].clone()
    gp = ps.SVGP(RBF(X.shape[1], lengthscale=torch.full((X.shape[1],), float(X.shape[1]) ** 0.5)), Z,
                 ps.NegativeBinomial())

    def error(m):
        return float(-m.predict(Xt, full=True)[2].log_prob(yt).mean())

    return gp, X, y, dict(num_steps=300 if quick else 1500, batch_size=256, lr=0.01), error


def task_robust(seed: int, quick: bool):
    data = ps.datasets.load_powerplant()
    X, Xt = _standardise(data.X_train, data.X_test)
    mu, sd = data.y_train.mean(), data.y_train.std()
    y, yt = (data.y_train - mu) / sd, (data.y_test - mu) / sd
    g = torch.Generator().manual_seed(2000 + seed)
    bad = torch.randperm(len(y), generator=g)[: len(y) // 20]
    y = y.clone()
    y[bad] += 10 * torch.sign(torch.randn(len(bad), generator=g))
    torch.manual_seed(seed)
    Z = X[torch.randperm(len(X))[:64]].clone()
    gp = ps.SVGP(RBF(4, lengthscale=torch.ones(4)), Z, ps.StudentT())

    def error(m):
        return float((m.predict(Xt)[0] - yt).pow(2).mean().sqrt())

    return gp, X, y, dict(num_steps=200 if quick else 1000, batch_size=512, lr=0.01), error


def _digits(seed: int, quick: bool, batch: int):
    from natgrad_nonconjugate import build_classifier, load_digits_split

    X, y, Xt, yt = load_digits_split()
    gp = build_classifier(X, "robustmax", seed=seed)

    def error(m):
        return float((m.predict(Xt, full=True)[2].probs.argmax(-1) != yt.long()).double().mean())

    return gp, X, y, dict(num_steps=60 if quick else 300, batch_size=batch, lr=0.01), error


def task_digits(seed: int, quick: bool):
    return _digits(seed, quick, 1200)


def task_digits_b400(seed: int, quick: bool):
    return _digits(seed, quick, 400)


def task_dgp(seed: int, quick: bool):
    from natgrad_nonconjugate import _kin8nm

    from pyro_sparsegp.deep import build_deep_gp

    X, y, Xt, yt = _kin8nm()[:4]
    torch.manual_seed(seed)
    dgp = build_deep_gp(X, [min(30, X.shape[1])], ps.Gaussian(0.05), num_samples=5, seed=seed, num_inducing=100)

    def error(m):
        torch.manual_seed(10_000 + seed)  # the predictive samples, the same for every method
        return float((m.predict(Xt, 20)[0].mean(0) - yt).pow(2).mean().sqrt())

    return dgp, X, y, dict(num_steps=100 if quick else 1000, batch_size=1000, lr=0.01), error


TASKS = {name[5:]: f for name, f in globals().items() if name.startswith("task_")}


def run(task: str, method: str, seed: int, quick: bool, every: int, steps: int | None = None) -> dict:
    pyro.clear_param_store()
    module, X, y, kwargs, error = TASKS[task](seed, quick)
    if steps is not None:  # --steps TASK=N: a cut step budget
        kwargs["num_steps"] = steps
    evals = []

    def callback(step, _loss):
        if step % every == 0:
            with torch.no_grad():
                evals.append((step, error(module)))

    t = time.perf_counter()
    failure = ""
    try:
        ps.infer.fit(module, X, y, natgrad=METHODS[method], seed=seed, progress=False, callback=callback,
                     **kwargs)
    except ps.infer.NonFiniteLossError as exc:
        failure = f"NonFiniteLossError at step {exc.step}"
    secs = time.perf_counter() - t
    with torch.no_grad():
        final = error(module)
    half = [e for s, e in evals if s > kwargs["num_steps"] // 2]
    return {"task": task, "method": method, "seed": seed, "error": final, "second_half_max": max(half, default=final),
            "unstable": bool(half) and max(half) > 2 * final, "time_s": secs, "steps": kwargs["num_steps"],
            "evals": [round(e, 5) for _, e in evals], "failure": failure}


def run_ep(seed: int, quick: bool) -> dict:
    from natgrad_nonconjugate import build_classifier, load_digits_split

    X, y, Xt, yt = load_digits_split()
    pyro.clear_param_store()
    gp = build_classifier(X, "robustmax", seed=seed)
    t = time.perf_counter()
    ps.infer.fit_ep(gp, X, y, progress=False, **({"num_iters": 30} if quick else {}))
    secs = time.perf_counter() - t
    with torch.no_grad():
        err = float((gp.predict(Xt, full=True)[2].probs.argmax(-1) != yt.long()).double().mean())
    return {"task": "digits_ep", "method": "ep", "seed": seed, "error": err, "second_half_max": err, "unstable": False,
            "time_s": secs, "steps": 0, "evals": [], "failure": ""}


def summary(rows) -> list:
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        means = {m: statistics.mean(r["error"] for r in mine if r["method"] == m)
                 for m in dict.fromkeys(r["method"] for r in mine)}
        fixed = {m: v for m, v in means.items() if m not in ("auto", "ep")}
        best = min(fixed, key=fixed.get) if fixed else None
        for m, v in means.items():
            runs = [r for r in mine if r["method"] == m]
            out.append({"task": task, "method": m, "mean_error": v, "seeds": len(runs),
                        "vs_best_fixed": v / fixed[best] if best and fixed[best] > 0 else math.nan,
                        "best_fixed": best or "", "unstable_seeds": sum(r["unstable"] for r in runs),
                        "mean_time_s": statistics.mean(r["time_s"] for r in runs),
                        "failures": sum(bool(r["failure"]) for r in runs)})
    return out


def join(paths, out) -> None:
    """Print and write (``out``) the rows of earlier ``--json`` files with their summary recomputed."""
    import json

    rows = [r for path in paths for r in json.loads(Path(path).read_text()) if r.get("kind") != "summary"]
    order = [*TASKS, "digits_ep"]
    rows.sort(key=lambda r: (order.index(r["task"]) if r["task"] in order else len(order), r["seed"]))
    summ = summary(rows)
    print(table(summ, list(summ[0])))
    write_json(out, rows + [dict(r, kind="summary") for r in summ])


def main():
    p = parser(__doc__)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--every", type=int, default=50, help="evaluate the live model every this many steps")
    p.add_argument("--ep", action="store_true", help="also fit_ep on digits (robust-max), timed")
    p.add_argument("--steps", nargs="+", default=[], metavar="TASK=N", help="a task's step budget instead of its own")
    p.add_argument("--join", nargs="+", metavar="JSON", help="no runs: the summary of these earlier runs' rows")
    args = p.parse_args()
    if args.join:
        return join(args.join, args.json)
    steps = {t: int(n) for t, n in (kv.split("=") for kv in args.steps)}
    setup(args)
    torch.set_default_dtype(torch.float64)
    if args.quick:
        args.tasks, args.seeds, args.every = [t for t in args.tasks if t in ("poisson", "digits_b400")], [0], 20
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            for method in args.methods:
                rows.append(run(task, method, seed, args.quick, args.every, steps.get(task)))
                print(table(rows[-1:], ["task", "method", "seed", "error", "second_half_max", "time_s", "failure"]),
                      flush=True)
            if args.ep and task == "digits_b400":
                rows.append(run_ep(seed, args.quick))
    summ = summary(rows)
    print(table(summ, list(summ[0])))
    write_json(args.json, rows + [dict(r, kind="summary") for r in summ])


if __name__ == "__main__":
    main()
