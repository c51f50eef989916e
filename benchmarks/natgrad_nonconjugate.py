"""Natural gradients where they used to be off: non-conjugate likelihoods and every layer of a deep GP (issue #26,
items 3-4). Prints a table and writes JSON rows keyed by ``dataset``/``likelihood``/``method``.

    python benchmarks/natgrad_nonconjugate.py [--part digits|dgp|all] [--steps 100 300] [--dgp-steps 1000]
                                              [--dgp-seeds 0 1] [--dgp-models dgp2 dgp3]
                                              [--dgp-methods default nat_all nat_all_avg] [--json PATH]
                                              [--stress-seeds 20] [--stress-steps 100]

**Digits** (scikit-learn ``load_digits``: 1,797 8x8 images, 10 classes): one fixed split (``numpy`` permutation with
seed 0: the first 1,200 rows train, the other 597 test), inputs standardised on the training rows (constant pixels
left at 0). The model, the same for every method: ``SVGP(Sum(RBF(64), WhiteNoise(64)), Z, lik, num_outputs=10,
whiten=True)`` with ``Z`` [100, 64] a random subset of the training inputs (seed 0), kernel variance 1, white-noise
variance 1, length-scale sqrt(median pairwise distance) (``benchmarks/multiclass_table2.py``'s specification with
one set of inducing inputs shared by the classes); ``lik`` robust-max (epsilon 1e-3) or softmax. Methods:

* ``ep``: ``ps.infer.fit_ep`` (robust-max only; its defaults: 250 damped batch iterations with hyperparameter steps);
* ``adam``: ``fit(natgrad_lr=None)``: Adam (lr 0.01) on everything (the default for these likelihoods before);
* ``nat_plain``: ``fit(natgrad_lr=0.1, natgrad_warmup=0, natgrad_retraction=False)``: the plain natural step;
* ``nat_auto``: ``fit(natgrad_lr="auto")``: length 0.1, the positive-definite step, a 5-step warm-up (the paper's);
* ``nat_auto_avg``: as ``nat_auto`` with ``average=0.25`` (the last quarter's iterates averaged);

all through ``fit`` on the full batch (1,200) with the closed-form bound for ``--steps`` steps. Metrics: test
accuracy and mean negative log-likelihood of the predictive class probabilities, training wall seconds.

**kin8nm** (``pyro_sparsegp/data/kin8nm``, split 0, 7,373 / 819): ``benchmarks/deepgp_uci.py``'s protocol
(Salimbeni & Deisenroth 2017: inputs and targets standardised on the training rows, M = 100 per layer, hidden width
min(30, D) = 8, hidden q(u) scaled by 1e-5, Adam 0.01, minibatch 1000, 5 samples) reduced to ``--dgp-steps`` steps
and the seeds ``--dgp-seeds`` (initialisation and minibatch order; only split 0 ships with the package). Methods:
``default`` (``fit``'s default: natural steps on the last layer only) and ``nat_all`` (``natgrad_layers="all"``:
every layer; hidden layers take the positive-definite step); ``--dgp-methods`` adds ``nat_all_avg`` (every layer,
and the iterate average of the last quarter of the steps, ``average=0.25``). Metrics: test log-likelihood
(100-sample predictive mixture) and RMSE in the original units, the training bound per point (Salimbeni's estimator
on the training set), wall seconds, and Cholesky/damping failures (a ``NonFiniteLossError`` or a
``NatGradDampingWarning``). ``--part stress``: ``nat_all`` on ``--stress-seeds`` seeds for the first
``--stress-steps`` steps (where the hidden q(u), started at 1e-5 of the prior scale, is most fragile), counting
failures.
"""

from __future__ import annotations

import math
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
    "adam": dict(natgrad_lr=None),
    "nat_plain": dict(natgrad_lr=0.1, natgrad_warmup=0, natgrad_retraction=False),
    "nat_auto": dict(natgrad_lr="auto"),
    "nat_auto_avg": dict(natgrad_lr="auto", average=0.25),
}
DGP = {"default": dict(), "nat_all": dict(natgrad_layers="all"),
       "nat_all_avg": dict(natgrad_layers="all", average=0.25)}


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
    """``(seconds, failure)``: run ``train()``, recording a numerical failure or a damping warning."""
    t0, failure = time.perf_counter(), ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NatGradDampingWarning)
        try:
            train()
        except ps.infer.NonFiniteLossError as exc:
            failure = f"NonFiniteLossError at step {exc.step}"
    damped = [w for w in caught if issubclass(w.category, NatGradDampingWarning)]
    return time.perf_counter() - t0, failure or ("damped" if damped else "")


def digits_rows(args) -> list:
    X, y, Xt, yt = load_digits_split()
    jobs = [("robustmax", "ep", None)] + [(lik, m, s) for lik in ("robustmax", "softmax") for s in args.steps
                                          for m in VI]
    rows = []
    for lik, method, steps in jobs:
        pyro.clear_param_store()
        gp = build_classifier(X, lik)
        if method == "ep":
            secs, fail = _run(lambda gp=gp: ps.infer.fit_ep(gp, X, y, progress=False))
        else:
            secs, fail = _run(lambda gp=gp, m=method, s=steps: ps.infer.fit(
                gp, X, y, num_steps=s, batch_size=len(X), progress=False, **VI[m]))
        with torch.no_grad():
            pred = gp.predict(Xt, full=True)[2]
            acc = (pred.probs.argmax(-1) == yt.long()).double().mean().item()
            nll = -pred.log_prob(yt).mean().item()
        rows.append({"dataset": "digits", "likelihood": lik, "method": method, "steps": steps or "",
                     "accuracy": acc, "nll": nll, "wall_s": secs, "failure": fail})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def kin8nm_rows(args) -> list:
    d = ps.datasets.load_kin8nm()
    mx, sx, my, sy = d.X_train.mean(0), d.X_train.std(0), d.y_train.mean(), d.y_train.std()
    X, Xt = (d.X_train - mx) / sx, (d.X_test - mx) / sx
    y = (d.y_train - my) / sy
    rows = []
    for model in args.dgp_models:
        for seed in args.dgp_seeds:
            for method in args.dgp_methods:
                kw = DGP[method]
                pyro.clear_param_store()
                torch.manual_seed(seed)
                width = min(30, X.shape[1])
                hidden = [width] * {"dgp2": 1, "dgp3": 2}[model]
                dgp = build_deep_gp(X, hidden, ps.Gaussian(0.05), num_samples=5, seed=seed, num_inducing=100)
                secs, fail = _run(lambda dgp=dgp, kw=kw, seed=seed: ps.infer.fit(
                    dgp, X, y, num_steps=args.dgp_steps, batch_size=1000, lr=0.01, elbo="analytic", seed=seed,
                    progress=False, **kw))
                with torch.no_grad():
                    ll = (dgp.predictive_log_prob(Xt, d.y_test.sub(my).div(sy), 100) - math.log(sy)).mean().item()
                    mean = dgp.predict(Xt, 100)[0].mean(0) * sy + my
                    rmse = (mean - d.y_test).pow(2).mean().sqrt().item()
                    bound = sum(dgp.analytic_elbo(X[i:i + 2000], y[i:i + 2000], num_data=len(X)).item()
                                * len(X[i:i + 2000]) / len(X) for i in range(0, len(X), 2000)) / len(X)
                rows.append({"dataset": "kin8nm", "likelihood": model, "method": method, "seed": seed,
                             "steps": args.dgp_steps, "test_ll": ll, "rmse": rmse, "train_elbo": bound,
                             "wall_s": secs, "failure": fail})
                print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def stress_rows(args) -> list:
    """``--stress-seeds S``: DGP 2 and 3 with natural steps on every layer for ``--stress-steps`` steps from ``S``
    seeds (the first steps, where the hidden q(u) at 1e-5 of the prior scale is most fragile): failures only."""
    d = ps.datasets.load_kin8nm()
    X = (d.X_train - d.X_train.mean(0)) / d.X_train.std(0)
    y = (d.y_train - d.y_train.mean()) / d.y_train.std()
    rows = []
    for model in args.dgp_models:
        fails = []
        for seed in range(args.stress_seeds):
            pyro.clear_param_store()
            hidden = [min(30, X.shape[1])] * {"dgp2": 1, "dgp3": 2}[model]
            dgp = build_deep_gp(X, hidden, ps.Gaussian(0.05), num_samples=5, seed=seed, num_inducing=100)
            secs, fail = _run(lambda dgp=dgp, seed=seed: ps.infer.fit(
                dgp, X, y, num_steps=args.stress_steps, batch_size=1000, lr=0.01, elbo="analytic", seed=seed,
                progress=False, natgrad_layers="all"))
            fails += [f"seed {seed}: {fail}"] if fail else []
        rows.append({"dataset": "kin8nm", "likelihood": model, "method": "nat_all_stress", "seeds": args.stress_seeds,
                     "steps": args.stress_steps, "failures": len(fails), "failure": "; ".join(fails)})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def summary(rows) -> list:
    """Mean over seeds per (likelihood, method) for the DGP rows."""
    out = {}
    for r in rows:
        out.setdefault((r["likelihood"], r["method"]), []).append(r)
    res = []
    for (model, method), rs in out.items():
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("test_ll", "rmse", "train_elbo", "wall_s")}
        res.append({"model": model, "method": method, "seeds": len(rs), **mean,
                    "failures": sum(bool(r["failure"]) for r in rs)})
    return res


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
    args = p.parse_args()
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
        dgp = kin8nm_rows(args)
        rows += dgp
        print("\n" + table(dgp, ["likelihood", "method", "seed", "steps", "test_ll", "rmse", "train_elbo", "wall_s",
                                 "failure"]))
        print("\n" + table(summary(dgp), ["model", "method", "seeds", "test_ll", "rmse", "train_elbo", "wall_s",
                                          "failures"]))
    if args.part in ("stress", "all"):
        rows += stress_rows(args)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
