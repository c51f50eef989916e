"""Natural gradients where they used to be off: non-conjugate likelihoods and every layer of a deep GP (issue #26,
items 3-4). Prints a table and writes JSON rows keyed by ``dataset``/``likelihood``/``method``.

    python benchmarks/natgrad_nonconjugate.py [--part digits|dgp|all] [--steps 100 300] [--dgp-steps 1000]
                                              [--dgp-seeds 0 1] [--dgp-models dgp2 dgp3]
                                              [--dgp-methods default nat_all nat_all_last nat_all_start
                                                             nat_all_80 default_avg nat_late] [--json PATH]
                                              [--stress-seeds 20] [--stress-steps 100] [--eval-samples 100]
                                              [--workers 1] [--time-limit SECONDS] [--progress-every 0]
    python benchmarks/natgrad_nonconjugate.py --summarize A.json [B.json ...] [--json PATH]

**Digits** (scikit-learn ``load_digits``: 1,797 8x8 images, 10 classes): one fixed split (``numpy`` permutation with
seed 0: the first 1,200 rows train, the other 597 test), inputs standardised on the training rows (constant pixels
left at 0). The model, the same for every method: ``SVGP(Sum(RBF(64), WhiteNoise(64)), Z, lik, num_outputs=10,
whiten=True)`` with ``Z`` [100, 64] a random subset of the training inputs (seed 0), kernel variance 1, white-noise
variance 1, length-scale sqrt(median pairwise distance) (``benchmarks/multiclass_table2.py``'s specification with
one set of inducing inputs shared by the classes); ``lik`` robust-max (epsilon 1e-3) or softmax. Methods:

* ``ep``: ``ps.infer.fit_ep`` (robust-max only; its defaults: 250 damped batch iterations with hyperparameter steps);
* ``adam``: ``fit(natgrad=None)``: Adam (lr 0.01) on everything (the default for these likelihoods before);
* ``nat_plain``: ``fit(natgrad=ps.infer.NaturalPolicy(lr=0.1, warmup=0, retraction=False))``: the plain natural step;
* ``nat_auto``: ``fit(natgrad="auto")``: length 0.1, the positive-definite step, a 5-step warm-up (the paper's);
* ``nat_auto_avg``: as ``nat_auto`` with ``average=0.25`` (the last quarter's iterates averaged);

all through ``fit`` on the full batch (1,200) with the closed-form bound for ``--steps`` steps. Metrics: test
accuracy and mean negative log-likelihood of the predictive class probabilities, training wall seconds.

**kin8nm** (``pyro_sparsegp/data/kin8nm``, split 0, 7,373 / 819): ``benchmarks/deepgp_uci.py``'s protocol
(Salimbeni & Deisenroth 2017: inputs and targets standardised on the training rows, M = 100 per layer, hidden width
min(30, D) = 8, hidden q(u) scaled by 1e-5, Adam 0.01, minibatch 1000, 5 samples) reduced to ``--dgp-steps`` steps
and the seeds ``--dgp-seeds`` (initialisation and minibatch order; only split 0 ships with the package). Methods:
``default`` (``fit``'s default: natural steps on the last layer only) and ``nat_all`` (``layers="all"``:
every layer, the hidden layers from half the steps on, ``hidden_start="auto"``, with Adam on them before,
and their iterates averaged over the last tenth of the steps before the exact finish of the last layer,
``average="auto"``; hidden layers take the positive-definite step); ``--dgp-methods`` adds ``nat_all_last``
(``nat_all`` without the average, ``average=None``), ``nat_all_start`` (every layer from the first step and no
average: what ``"all"`` did before), ``nat_all_80`` (the hidden layers from 80% of the steps, no average),
``default_avg`` (the default with the hidden layers' average: ``layers="all"`` with the hidden layers joining
at the last step, i.e. Adam on them throughout, ``average=0.1``) and ``nat_late`` (the default for the first half of
the steps, then every layer: two ``fit`` calls, so Adam's state restarts at the switch). Metrics: test log-likelihood
(100-sample predictive mixture) and RMSE in the original units, the training bound per point (Salimbeni's estimator
on the training set), wall seconds, and Cholesky/damping failures (a ``NonFiniteLossError`` or a
``NatGradDampingWarning``; "last iterate kept": an iterate average that could not average a family).
``--part stress``: ``nat_all`` on ``--stress-seeds`` seeds for ``--stress-steps`` steps (the hidden layers join at
half of them), counting failures. ``--eval-samples S`` (above 100) adds the test log-likelihood of the ``S``-sample
mixture (``test_ll_many``; the 100-sample one is biased low) and the largest per-point standard error (``se_max``). The
summary gives each method's mean over seeds with its standard error, and its paired difference from ``default``
over the seeds that ran both.

Runs of separate seeds are independent: ``--workers W`` runs them in ``W`` processes of this script (one thread each;
with ``--device cuda`` they share the GPU: docs/gpu.md; their logs go to ``--log-dir``), ``--progress-every K`` makes
each print a line per ``K`` steps, and ``--time-limit T`` stops the runs after ``T`` seconds, reporting each with the
steps it reached and ``failure`` "stopped" (a device's per-call limit). On an H100, DGP 3's 5,000 steps took about 250 s
with 6 workers. Each DGP row names its ``device``; ``--summarize`` trains nothing and prints the tables of the DGP rows
of earlier runs' JSON files together (several devices and sessions), pairing seeds only on the same device.
``benchmarks/records/natgrad_dgp_kin8nm.json`` holds the 5,000-step runs measured so far (its ``source`` field says
where each row came from).
"""

from __future__ import annotations

import math
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import parser, setup, table, write_json  # noqa: E402
from pyro.contrib.gp.kernels import RBF, Sum, WhiteNoise  # noqa: E402

import pyro_sparsegp as ps  # noqa: E402
from pyro_sparsegp.deep import build_deep_gp  # noqa: E402
from pyro_sparsegp.infer.natgrad import NatGradDampingWarning  # noqa: E402

VI = {
    "adam": dict(lr=None),
    "nat_plain": dict(lr=0.1, warmup=0, retraction=False),
    "nat_auto": dict(lr="auto"),
    "nat_auto_avg": dict(lr="auto", average=0.25),
}
# a DGP method: its phases, (fraction of the steps, fit's options), each a fit call continuing from the last
DGP = {"default": [(1.0, {})], "nat_all": [(1.0, dict(layers="all"))],
       "nat_all_last": [(1.0, dict(layers="all", average=None))],  # no average of the hidden layers
       "nat_all_start": [(1.0, dict(layers="all", hidden_start=0, average=None))],
       "nat_all_80": [(1.0, dict(layers="all", hidden_start=0.8, average=None))],  # a fraction
       # the default with the hidden layers' average: they never join the natural steps (Adam throughout)
       "default_avg": [(1.0, dict(layers="all", hidden_start=1.0, average=0.1))],
       "nat_late": [(0.5, {}), (0.5, dict(layers="all", hidden_start=0, average=None))]}


def load_digits_split():
    """``(X [1200, 64], y [1200], Xt [597, 64], yt [597])``, standardised on the training rows (module docstring)."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    perm = np.random.RandomState(0).permutation(len(X))
    tr, te = perm[:1200], perm[1200:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    t = torch.tensor
    return t((X[tr] - mu) / sd), t(y[tr]).double(), t((X[te] - mu) / sd), t(y[te]).double()


def build_classifier(X, lik: str, M: int = 100, seed: int = 0):
    """The shared model specification (module docstring) for ``X [N, D]`` and ``lik`` in robustmax/softmax."""
    torch.manual_seed(seed)
    N, D = X.shape
    Z = X[torch.randperm(N)[:M]].clone()
    med = torch.pdist(X).median()
    kern = Sum(RBF(D, lengthscale=torch.full((D,), float(med.sqrt()))), WhiteNoise(D, variance=torch.tensor(1.0)))
    likelihood = ps.RobustMax(10, epsilon=1e-3) if lik == "robustmax" else ps.Softmax(10)
    return ps.SVGP(kern, Z, likelihood, num_outputs=10, whiten=True)


def _run(train):
    """``(seconds, failure)``: run ``train(caught)``, recording a numerical failure, a damping warning or an iterate
    average that kept a family's last iterate (``caught``: the list of warnings recorded so far, for progress
    lines)."""
    t0, failure = time.perf_counter(), ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NatGradDampingWarning)
        warnings.filterwarnings("always", "iterate average", RuntimeWarning)
        try:
            train(caught)
        except ps.infer.NonFiniteLossError as exc:
            failure = f"NonFiniteLossError at step {exc.step}"
    damped = [w for w in caught if issubclass(w.category, NatGradDampingWarning)]
    kept = [w for w in caught if str(w.message).startswith("iterate average")]  # a family not averaged
    return time.perf_counter() - t0, failure or ("damped" if damped else "") or ("last iterate kept" if kept else "")


def digits_rows(args) -> list:
    X, y, Xt, yt = load_digits_split()
    jobs = [("robustmax", "ep", None)] + [(lik, m, s) for lik in ("robustmax", "softmax") for s in args.steps
                                          for m in VI]
    rows = []
    for lik, method, steps in jobs:
        pyro.clear_param_store()
        gp = build_classifier(X, lik)
        if method == "ep":
            secs, fail = _run(lambda _, gp=gp: ps.infer.fit_ep(gp, X, y, progress=False))
        else:
            secs, fail = _run(lambda _, gp=gp, m=method, s=steps: ps.infer.fit(
                gp, X, y, num_steps=s, batch_size=len(X), progress=False, natgrad=ps.infer.NaturalPolicy(**VI[m])))
        with torch.no_grad():
            pred = gp.predict(Xt, full=True)[2]
            acc = (pred.probs.argmax(-1) == yt.long()).double().mean().item()
            nll = -pred.log_prob(yt).mean().item()
        rows.append({"dataset": "digits", "likelihood": lik, "method": method, "steps": steps or "",
                     "accuracy": acc, "nll": nll, "wall_s": secs, "failure": fail})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _kin8nm():
    """kin8nm split 0 standardised on the training rows (on the default device, where ``load_kin8nm`` puts it):
    ``(X, y, Xt, yt, sy)`` with ``yt`` standardised too and ``sy`` the targets' scale (a float, for the JSON rows)."""
    d = ps.datasets.load_kin8nm()
    mx, sx, my, sy = d.X_train.mean(0), d.X_train.std(0), d.y_train.mean(), d.y_train.std()
    return (d.X_train - mx) / sx, (d.y_train - my) / sy, (d.X_test - mx) / sx, (d.y_test - my) / sy, float(sy)


def dgp_row(args, model: str, seed: int, method: str, steps: int) -> dict:
    """One DGP run of the kin8nm protocol (module docstring): train, then the metrics. With ``--progress-every K``
    a line per ``K`` steps says how far the run is and whether a step was damped (for runs cut off by a time limit)."""
    X, y, Xt, yt, sy = _kin8nm()
    pyro.clear_param_store()
    torch.manual_seed(seed)
    hidden = [min(30, X.shape[1])] * {"dgp2": 1, "dgp3": 2}[model]
    dgp = build_deep_gp(X, hidden, ps.Gaussian(0.05), num_samples=5, seed=seed, num_inducing=100)
    every, t0 = args.progress_every, time.perf_counter()

    def callback(caught, done):
        def progress(step, loss):
            step += done
            if every and step % every == 0:
                damped = sum(issubclass(w.category, NatGradDampingWarning) for w in caught)
                print(f"# progress {model} {method} seed {seed}: step {step}, loss {float(loss):.1f}, "
                      f"damped steps {damped}, {time.perf_counter() - t0:.0f} s", flush=True)
        return progress

    kept = []  # the families whose iterate average could not be used (FitState.not_averaged)

    def train(caught):
        done = 0
        for i, (fraction, options) in enumerate(DGP[method]):
            n = steps - done if i == len(DGP[method]) - 1 else round(fraction * steps)
            if isinstance(options.get("hidden_start"), float):  # a fraction of the phase's steps
                options = options | {"hidden_start": round(options["hidden_start"] * n)}
            kept[:] = ps.infer.fit(dgp, X, y, num_steps=n, batch_size=1000, lr=0.01, elbo="analytic",
                                   seed=seed + done, progress=False, callback=callback(caught, done),
                                   natgrad=ps.infer.NaturalPolicy(**options)).not_averaged
            done += n

    secs, fail = _run(train)
    row = {"dataset": "kin8nm", "likelihood": model, "method": method, "seed": seed, "steps": steps}
    with torch.no_grad():
        torch.manual_seed(10_000 + seed)  # the predictive samples, the same for every method
        row["test_ll"] = (dgp.predictive_log_prob(Xt, yt, 100) - math.log(sy)).mean().item()
        if args.eval_samples > 100:  # the 100-sample mixture is biased low (DeepGP.predictive_log_prob)
            lp, se = dgp.predictive_log_prob(Xt, yt, args.eval_samples, return_se=True, batch_size=100)
            row["test_ll_many"], row["se_max"] = (lp - math.log(sy)).mean().item(), se.max().item()
        row["rmse"] = (dgp.predict(Xt, 100)[0].mean(0) - yt).pow(2).mean().sqrt().item() * sy
        row["train_elbo"] = sum(dgp.analytic_elbo(X[i:i + 2000], y[i:i + 2000], num_data=len(X)).item()
                                * len(X[i:i + 2000]) for i in range(0, len(X), 2000)) / len(X) ** 2
    return row | {"noise": float(dgp.likelihood.noise.detach()), "wall_s": secs, "failure": fail,
                  "not_averaged": " ".join(kept), "device": _device_name(args.device)}


def _device_name(device: str) -> str:
    """``"cpu"`` or the GPU's name (``"cuda: NVIDIA H100 80GB HBM3"``): runs on different devices draw different
    numbers, so the summary pairs a seed's methods only on the same device."""
    d = torch.device(device)
    return f"cuda: {torch.cuda.get_device_name(d)}" if d.type == "cuda" else d.type


def _child_command(args, model, seed, method, steps, path) -> list:
    return [sys.executable, __file__, "--part", "dgp", "--threads", "1", "--device", args.device,
            "--dgp-models", model, "--dgp-seeds", str(seed), "--dgp-methods", method, "--dgp-steps",
            str(steps), "--eval-samples", str(args.eval_samples), "--progress-every",
            str(args.progress_every), "--json", str(path)]


def parallel_rows(args, jobs: list, steps: int) -> list:
    """``jobs`` (model, seed, method) in ``--workers`` processes of this script, one thread each (runs of separate
    seeds are independent). ``--time-limit T``: jobs still running after ``T`` seconds are stopped and reported with
    the last step their progress reached (``failure`` then covers only those steps)."""
    import json
    import subprocess
    import tempfile

    tmp = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp())
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"# the runs' logs and rows: {tmp}", flush=True)
    t0, queue, running, rows = time.time(), list(jobs), {}, []
    while queue or running:
        while queue and len(running) < args.workers and time.time() - t0 < args.time_limit:
            job = queue.pop(0)
            path = tmp / ("_".join(map(str, job)) + ".json")
            log = open(path.with_suffix(".log"), "w")
            running[job] = (subprocess.Popen(_child_command(args, *job, steps, path), stdout=log,
                                             stderr=subprocess.STDOUT), path, log)
        for job, (proc, path, log) in list(running.items()):
            late = time.time() - t0 > args.time_limit
            if proc.poll() is None and not late:
                continue
            if late:
                proc.kill()
            proc.wait()
            log.close()
            running.pop(job)
            text = path.with_suffix(".log").read_text()
            if path.exists():
                rows += json.loads(path.read_text())
            else:  # stopped (or crashed): the steps its progress reached
                done = [int(m) for m in re.findall(r"step (\d+),", text)]
                damped = any(int(m) for m in re.findall(r"damped steps (\d+),", text))
                why = ("stopped, damped" if damped else "stopped") if late else text[-300:]
                rows.append(_stopped(job, max(done, default=0), why))
            print(table(rows[-1:], list(rows[-1])), flush=True)
        if time.time() - t0 > args.time_limit:
            rows += [_stopped(job, 0, "stopped") for job in queue]  # never started
            queue = []
        time.sleep(1 if running else 0)
    return rows


def _stopped(job, steps: int, failure: str) -> dict:
    return {"dataset": "kin8nm", "likelihood": job[0], "method": job[2], "seed": job[1], "steps": steps,
            "failure": failure}


def kin8nm_rows(args, jobs: list, steps: int) -> list:
    """The DGP runs ``jobs`` (model, seed, method) of ``steps`` steps each, in ``--workers`` processes if above 1."""
    if args.workers > 1:
        return parallel_rows(args, jobs, steps)
    rows = []
    for job in jobs:
        rows.append(dgp_row(args, *job, steps))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def stress_rows(args) -> list:
    """``--stress-seeds S``: DGP 2 and 3 with natural steps on every layer (``nat_all``: the hidden layers from half
    the steps on) for ``--stress-steps`` steps from seeds ``0 .. S-1``: one row per
    model counting the failures (and, under ``--time-limit``, the seeds stopped early and the fewest steps reached)."""
    runs = kin8nm_rows(args, [(m, seed, "nat_all") for m in args.dgp_models for seed in range(args.stress_seeds)],
                       args.stress_steps)
    rows = []
    for model in args.dgp_models:
        rs = [r for r in runs if r["likelihood"] == model]
        fails = [f"seed {r['seed']}: {r['failure']}" for r in rs if r["failure"] not in ("", "stopped")]
        rows.append({"dataset": "kin8nm", "likelihood": model, "method": "nat_all_stress", "seeds": len(rs),
                     "steps": args.stress_steps, "min_steps_reached": min((r["steps"] for r in rs), default=0),
                     "stopped": sum(r["failure"] == "stopped" for r in rs), "failures": len(fails),
                     "failure": "; ".join(fails)})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return runs + rows


def _mean_se(xs) -> tuple:
    n = len(xs)
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else math.nan)


def summary(rows) -> list:
    """Per (likelihood, method), the finished DGP runs on every device: their count, means (the test
    log-likelihood's with its standard error over seeds) and failures; then each method's paired difference from
    ``default`` over the seeds that finished both on the same device (rows without a ``device`` ran on the CPU)."""
    done = [r for r in rows if "test_ll" in r]
    out = {}
    for r in done:
        out.setdefault((r["likelihood"], r["method"]), []).append(r)
    res = []
    for (model, method), rs in out.items():
        ll, se = _mean_se([r["test_ll"] for r in rs])
        # the mean of the runs that have each metric (a probe's rows may lack RMSE and time)
        mean = {k: sum(v) / len(v) for k in ("rmse", "train_elbo", "wall_s") if (v := [r[k] for r in rs if k in r])}
        res.append({"model": model, "method": method, "seeds": len(rs), "test_ll": ll, "test_ll_se": se, **mean,
                    "failures": sum(bool(r["failure"]) for r in rs)})
    for model, method in sorted({(r["likelihood"], r["method"]) for r in done if r["method"] != "default"}):
        by = {(r["method"], (r["seed"], r.get("device", "cpu"))): r for r in done if r["likelihood"] == model}
        keys = sorted(k for (m, k) in by if m == method and ("default", k) in by)  # (seed, device)
        if keys:
            d_ll = _mean_se([by[method, k]["test_ll"] - by["default", k]["test_ll"] for k in keys])
            d_b = _mean_se([by[method, k]["train_elbo"] - by["default", k]["train_elbo"] for k in keys])
            res.append({"model": model, "method": f"{method} - default", "seeds": len(keys), "test_ll": d_ll[0],
                        "test_ll_se": d_ll[1], "train_elbo": d_b[0]})
    return res


def dgp_tables(rows) -> None:
    """Print the DGP runs ``rows`` and their :func:`summary`, log-likelihoods and bounds to four decimals (the
    differences between methods are in the third)."""
    def fine(rs):
        return [r | {k: f"{r[k]:.4f}" for k in ("test_ll", "test_ll_many", "test_ll_se", "train_elbo") if k in r}
                for r in rs]

    print("\n" + table(fine(rows), ["likelihood", "method", "seed", "steps", "test_ll", "test_ll_many", "rmse",
                                    "train_elbo", "noise", "wall_s", "failure", "device"]))
    print("\n" + table(fine(summary(rows)), ["model", "method", "seeds", "test_ll", "test_ll_se", "rmse", "train_elbo",
                                             "wall_s", "failures"]))


def main():
    p = parser(__doc__)
    p.add_argument("--part", choices=["digits", "dgp", "stress", "all"], default="all")
    p.add_argument("--stress-seeds", type=int, default=20)
    p.add_argument("--stress-steps", type=int, default=100)
    p.add_argument("--steps", type=int, nargs="+", default=[100, 300], help="fit steps for digits VI")
    p.add_argument("--dgp-steps", type=int, default=1000)
    p.add_argument("--dgp-seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--dgp-models", nargs="+", default=["dgp2", "dgp3"])
    p.add_argument("--dgp-methods", nargs="+", choices=list(DGP), default=["default", "nat_all"])
    p.add_argument("--eval-samples", type=int, default=100, help="also the test LL with this many samples")
    p.add_argument("--workers", type=int, default=1, help="DGP runs in this many processes (one thread each)")
    p.add_argument("--time-limit", type=float, default=math.inf, help="stop parallel DGP runs after this (s)")
    p.add_argument("--progress-every", type=int, default=0, help="a progress line per this many DGP steps")
    p.add_argument("--log-dir", help="where parallel DGP runs write their logs (default: a new temporary folder)")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="no runs: the DGP tables of these files' rows")
    args = p.parse_args()
    if args.summarize:  # the rows of several invocations (devices, sessions) together
        import json

        rows = [r for path in args.summarize for r in json.loads(Path(path).read_text()) if "seed" in r]
        dgp_tables(rows)
        return write_json(args.json, rows + summary(rows))
    if args.quick:
        args.steps, args.dgp_steps, args.dgp_seeds, args.dgp_models = [30], 50, [0], ["dgp2"]
        args.stress_seeds, args.stress_steps = 2, 10
    setup(args)
    torch.set_default_dtype(torch.float64)
    rows = []
    if args.part in ("digits", "all"):
        rows += digits_rows(args)
        print("\n" + table([r for r in rows if r["dataset"] == "digits"],
                           ["likelihood", "method", "steps", "accuracy", "nll", "wall_s", "failure"]))
    if args.part in ("dgp", "all"):
        jobs = [(model, seed, method) for model in args.dgp_models for seed in args.dgp_seeds
                for method in args.dgp_methods]
        dgp = kin8nm_rows(args, jobs, args.dgp_steps)
        rows += dgp
        dgp_tables(dgp)
    if args.part in ("stress", "all"):
        rows += stress_rows(args)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
