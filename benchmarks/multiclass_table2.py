"""Villacampa-Calvo and Hernández-Lobato (2017), "Scalable multi-class Gaussian process classification using
expectation propagation", table 2 (negative test log-likelihood) and supplementary table 3 (test error): EP, SEP
(``ps.infer.fit_ep``), GFITC (``ps.infer.fit_gfitc``) and VI (robust-max SVGP, eq. 15) on ONE model specification,
with M = 5 %, 10 %, 20 % of the training set, on the 20 train/test splits of ``shared/data/multiclass_splits`` (see
its SOURCE.txt), printed beside the paper's GFITC, EP, SEP and VI numbers, with the time per iteration and the
training time of each method.

    python benchmarks/multiclass_table2.py [--quick] [--json PATH] [--splits S] [--iters T] [--steps T]
                                           [--gfitc-iters T] [--datasets a,b] [--methods ep,sep,gfitc,vi]
                                           [--fracs 0.05,0.1]

``--quick``: wine, 1 split, M = 5 %, 40 EP/SEP iterations, 20 GFITC L-BFGS iterations, 60 VI steps (about a
minute).

Protocol (their section 4.1; brief ``shared/briefs/ep_sep.md`` sec. 10), and where we differ:

* data and splits: the 8 datasets and 20 splits of the first author's later repository (90/10; satellite 20/80;
  waveform 30/70); ``--splits S`` runs the first S splits (the paper: 20); inputs standardised with the training
  split's mean and standard deviation;
* model, the same for every method: ``SVGP(Sum(RBF(D), WhiteNoise(D)), Z, RobustMax(K, epsilon=1e-3),
  num_outputs=K, whiten=True)``; ``Z`` ``[K, M, D]``, M = round(frac * N_train), each class's inducing inputs an
  independent random subset of the training inputs; kernel variance 1, white-noise variance (the paper's sigma0) 1,
  squared length-scale = the median pairwise distance of the standardised training inputs (the paper's R scripts).
  Differences: one kernel shared by the classes (the paper: per-class sigma, sigma0, l), and the white noise is on
  ``k(x_i, x_i)`` only, not on ``K(Z, Z)`` (see :mod:`pyro_sparsegp.infer.ep`);
* EP and SEP: batch mode, ``--iters`` iterations (default 250, the paper's), each one parallel damped refinement
  (delta = 0.5 x 0.99^t) and one sign-adaptive hyper-parameter step on eq. 10 (as the paper);
* VI: the closed-form eq. 15 (``fit(..., elbo="analytic")``, 20-node Gauss-Hermite) with Adam (lr 0.1) for
  ``--steps`` full-batch steps (default 200; the paper: 250 L-BFGS iterations);
* GFITC (``fit_gfitc``): EP on the exact factors of eq. 1 with the FITC prior (inducing values marginalised), run
  to convergence (damping 0.5, relative tolerance 1e-4 on the sites' natural parameters, at most 1000 sweeps) at
  every objective evaluation, warm-started; ``--gfitc-iters`` L-BFGS iterations (default 250, the paper's; strong-Wolfe
  line search, so a few more objective evaluations, i.e. EP runs); same model and initial values as EP/SEP;
* metrics: mean negative log-likelihood per test point of the module's predictive distribution (robust-max
  Gauss-Hermite, eq. 11, with the epsilon floor) and the test error of its argmax; mean and standard error
  (std / sqrt(splits)) over the splits; seconds per iteration (median over a run) of EP, SEP and VI, and for GFITC
  the whole fit divided by its L-BFGS iterations (each holds several EP runs of many sweeps); training seconds of
  every method side by side with the paper's average training times (table 2, all datasets pooled).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from _common import parser, setup, table, write_json
from pyro.contrib.gp.kernels import RBF, Sum, WhiteNoise

import pyro_sparsegp as ps

# ``shared/`` sits beside the repository (``/work/main`` -> ``/work/shared``; a worktree ``/work/wt/x`` one level up)
SPLITS = next((p / "shared" / "data" / "multiclass_splits" for p in Path(__file__).resolve().parents[1:4]
               if (p / "shared" / "data" / "multiclass_splits").is_dir()), Path("shared/data/multiclass_splits"))
FRACS = (0.05, 0.10, 0.20)
DATASETS = ("glass", "new-thyroid", "satellite", "svmguide2", "vehicle", "vowel", "waveform", "wine")
METHODS = ("ep", "sep", "gfitc", "vi")
GFITC_KEYS = ("ep_runs", "ep_sweeps", "lbfgs_iters", "ep_not_converged")  # GFITC's extra JSON row entries

# Villacampa-Calvo and Hernández-Lobato (2017): per dataset, per M of FRACS, {method: (mean, error bar)}.
# NLL: table 2; error: table 3 of the supplementary material.
_G, _E, _S, _V = "gfitc", "ep", "sep", "vi"


def _rows(vals):
    return [dict(zip((_G, _E, _S, _V), zip(v[0::2], v[1::2], strict=True), strict=True)) for v in vals]


PAPER_NLL = {
    "glass": _rows([(.61, .05, .78, .06, .77, .07, 2.45, .14), (.58, .05, .74, .06, .79, .07, 2.18, .14),
                    (.60, .07, .75, .06, .81, .07, 2.30, .15)]),
    "new-thyroid": _rows([(.06, .01, .11, .03, .06, .01, .09, .02), (.07, .01, .06, .01, .06, .01, .05, .01),
                          (.07, .01, .06, .01, .05, .01, .05, .01)]),
    "satellite": _rows([(.33, .00, .31, .00, .33, .00, .61, .01), (.34, .00, .30, .00, .34, .00, .58, .01),
                        (.34, .01, .30, .00, .36, .00, .53, .01)]),
    "svmguide2": _rows([(.63, .06, .63, .06, .67, .06, 1.03, .08), (.67, .05, .67, .05, .74, .07, .90, .10),
                        (.67, .05, .65, .06, .74, .07, .94, .08)]),
    "vehicle": _rows([(.32, .01, .34, .02, .34, .02, .76, .05), (.33, .01, .33, .02, .34, .02, .72, .04),
                      (.33, .01, .33, .02, .34, .02, .63, .04)]),
    "vowel": _rows([(.16, .01, .25, .01, .25, .01, .41, .05), (.14, .01, .19, .01, .19, .01, .30, .04),
                    (.12, .01, .16, .01, .18, .01, .15, .03)]),
    "waveform": _rows([(.42, .01, .36, .00, .39, .01, .89, .02), (.42, .01, .36, .01, .41, .01, .85, .01),
                       (.43, .01, .37, .01, .45, .01, .80, .01)]),
    "wine": _rows([(.08, .02, .07, .01, .08, .01, .08, .02), (.07, .01, .06, .01, .07, .01, .07, .01),
                   (.07, .01, .05, .01, .06, .01, .06, .02)]),
}
PAPER_ERR = {
    "glass": _rows([(.23, .02, .31, .02, .31, .02, .35, .02), (.20, .01, .29, .02, .30, .02, .35, .02),
                    (.20, .02, .28, .02, .28, .02, .36, .02)]),
    "new-thyroid": _rows([(.02, .01, .04, .01, .02, .01, .03, .01), (.03, .01, .02, .01, .03, .01, .03, .01),
                          (.03, .00, .02, .01, .02, .01, .03, .01)]),
    "satellite": _rows([(.12, .00, .11, .00, .12, .00, .12, .00), (.11, .00, .11, .00, .12, .00, .12, .00),
                        (.11, .00, .11, .00, .12, .00, .11, .00)]),
    "svmguide2": _rows([(.20, .01, .20, .01, .20, .02, .19, .01), (.19, .02, .20, .02, .20, .02, .17, .02),
                        (.20, .01, .19, .01, .20, .02, .19, .02)]),
    "vehicle": _rows([(.17, .01, .17, .01, .16, .01, .17, .01), (.17, .01, .16, .01, .16, .01, .15, .01),
                      (.17, .01, .16, .01, .16, .01, .15, .01)]),
    "vowel": _rows([(.05, .01, .09, .01, .09, .01, .06, .01), (.03, .01, .05, .01, .06, .01, .06, .00),
                    (.03, .00, .03, .00, .05, .01, .03, .01)]),
    "waveform": _rows([(.17, .00, .15, .00, .16, .00, .17, .00), (.17, .00, .16, .00, .16, .00, .18, .00),
                       (.17, .00, .16, .00, .17, .00, .18, .00)]),
    "wine": _rows([(.03, .01, .03, .01, .03, .01, .04, .01), (.04, .01, .02, .01, .03, .01, .03, .01),
                   (.04, .01, .01, .01, .03, .01, .03, .01)]),
}
PAPER_TIME = {0.05: (131, 53.8, 48.5, 157), 0.10: (264, 102, 96.6, 179), 0.20: (683, 228, 216, 248)}


# -- data ------------------------------------------------------------------------------------------------------------
def load_split(name, split):
    """Standardised ``(X, y, Xt, yt)`` (labels 0..K-1) of split ``split`` of ``name``."""
    d = np.load(SPLITS / name / "data.npz")
    f = np.load(SPLITS / name / "folds.npz")
    X, y = d["arr_0"].astype(float), d["arr_1"].astype(int)
    _, y = np.unique(y, return_inverse=True)
    tr, te = f["arr_0"][split], f["arr_1"][split]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    t = lambda a: torch.tensor(a)  # noqa: E731
    return t((X[tr] - mu) / sd), t(y[tr]).double(), t((X[te] - mu) / sd), t(y[te]).double()


def build(X, y, M, seed):
    """The model specification shared by every method (module docstring)."""
    torch.manual_seed(seed)
    K = int(y.max().item()) + 1
    N, D = X.shape
    Z = torch.stack([X[torch.randperm(N)[:M]] for _ in range(K)])
    med = torch.pdist(X).median()
    kern = Sum(RBF(D, lengthscale=torch.full((D,), float(med.sqrt()))), WhiteNoise(D, variance=torch.tensor(1.0)))
    return ps.SVGP(kern, Z, ps.RobustMax(K, epsilon=1e-3), num_outputs=K, whiten=True)


# -- one run ---------------------------------------------------------------------------------------------------------
def run_one(method, X, y, Xt, yt, frac, args, seed):
    pyro.clear_param_store()
    N = X.shape[0]
    M = max(2, int(round(frac * N)))
    gp = build(X, y, M, seed)
    t0 = time.perf_counter()
    if method in ("ep", "sep"):
        st = ps.infer.fit_ep(gp, X, y, method=method, num_iters=args.iters, seed=seed, progress=False)
        per_iter = st.time_per_iteration
        extra = {"skipped": st.skipped, "log_evidence": st.log_evidence[-1]}
    elif method == "gfitc":
        st = ps.infer.fit_gfitc(gp, X, y, num_iters=args.gfitc_iters, progress=False)
        per_iter = st.seconds / max(1, st.lbfgs_iterations)
        extra = {"log_evidence": st.log_evidence[-1], "ep_runs": st.evaluations, "ep_sweeps": sum(st.ep_iterations),
                 "lbfgs_iters": st.lbfgs_iterations, "ep_not_converged": st.converged.count(False)}
    else:
        t_steps = []
        _vi(gp, X, y, args, t_steps)
        per_iter = float(np.median(t_steps))
        extra = {}
    secs = time.perf_counter() - t0
    pred = gp.predict(Xt, full=True)[2]
    nll = -pred.log_prob(yt).mean().item()
    err = (pred.probs.argmax(-1) != yt.long()).double().mean().item()
    return {"M": M, "N_train": N, "error": err, "nll": nll, "train_s": secs, "s_per_iter": per_iter, **extra}


def _vi(gp, X, y, args, t_steps):
    """Full-batch Adam on the closed-form eq. 15 (what ``fit(..., elbo="analytic")`` does), timed per step."""
    opt = torch.optim.Adam(gp.parameters(), lr=args.lr)
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.zero_grad()
        loss = -gp.analytic_elbo(X, y)
        loss.backward()
        opt.step()
        t_steps.append(time.perf_counter() - t)


def _se(a):
    return float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")


def _fmt(m, s):
    return f"{m:.3f}±{s:.3f}" if not math.isnan(s) else f"{m:.3f}"


def main():
    p = parser(__doc__)
    p.set_defaults(threads=1)
    p.add_argument("--splits", type=int, default=None, help="first S of the 20 splits (default 20; quick: 1)")
    p.add_argument("--iters", type=int, default=None, help="EP/SEP iterations (default 250; quick: 40)")
    p.add_argument("--steps", type=int, default=None, help="VI Adam steps (default 200; quick: 60)")
    p.add_argument("--gfitc-iters", type=int, default=None, help="GFITC L-BFGS iterations (default 250; quick: 20)")
    p.add_argument("--lr", type=float, default=0.1, help="VI Adam learning rate")
    p.add_argument("--datasets", default=None, help=f"comma-separated subset of {','.join(DATASETS)}")
    p.add_argument("--methods", default="ep,sep,vi", help="comma-separated subset of ep,sep,gfitc,vi")
    p.add_argument("--fracs", default=None, help="comma-separated M fractions (default 0.05,0.1,0.2; quick 0.05)")
    args = p.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    names = args.datasets.split(",") if args.datasets else (["wine"] if args.quick else list(DATASETS))
    methods = args.methods.split(",")
    for n in names:
        if n not in DATASETS:
            raise SystemExit(f"unknown dataset {n!r}; choose from {', '.join(DATASETS)}")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    splits = args.splits or (1 if args.quick else 20)
    fracs = [float(f) for f in args.fracs.split(",")] if args.fracs else ([0.05] if args.quick else list(FRACS))
    args.iters = args.iters or (40 if args.quick else 250)
    args.steps = args.steps or (60 if args.quick else 200)
    args.gfitc_iters = args.gfitc_iters if args.gfitc_iters is not None else (20 if args.quick else 250)
    print(f"# EP/SEP: {args.iters} batch iterations; GFITC: {args.gfitc_iters} L-BFGS iterations; VI: {args.steps} "
          f"Adam steps; splits 0..{splits - 1}")
    rows, summary = [], []
    t_all = time.perf_counter()
    for name in names:
        for frac in fracs:
            res = {m: [] for m in methods}
            for s in range(splits):
                X, y, Xt, yt = load_split(name, s)
                for m in methods:
                    r = run_one(m, X, y, Xt, yt, frac, args, seed=s)
                    res[m].append(r)
                    rows.append({"dataset": name, "method": m, "M_pct": round(100 * frac), "error": r["error"],
                                 "nll": r["nll"], "split": s, "train_s": r["train_s"],
                                 **{k: r[k] for k in GFITC_KEYS if k in r}})
                    print(f"  {name:12s} {m:4s} M={r['M']:4d} ({frac:.0%}) split {s}: error {r['error']:.3f}  "
                          f"nll {r['nll']:.3f}  {r['s_per_iter'] * 1e3:.0f} ms/iter ({r['train_s']:.1f} s)"
                          + (f"  skipped {r['skipped']}" if "skipped" in r else "")
                          + (f"  {r['ep_runs']} EP runs, {r['ep_sweeps']} sweeps, {r['lbfgs_iters']} L-BFGS its"
                             if "ep_runs" in r else ""), flush=True)
            fi = FRACS.index(frac) if frac in FRACS else None
            for m in methods:
                nll = np.array([r["nll"] for r in res[m]])
                err = np.array([r["error"] for r in res[m]])
                row = {"dataset": name, "M": f"{frac:.0%}", "method": m, "splits": len(nll),
                       "nll": _fmt(nll.mean(), _se(nll)), "error": _fmt(err.mean(), _se(err)),
                       "ms_per_iter": float(np.median([r["s_per_iter"] for r in res[m]]) * 1e3),
                       "train_s": float(np.mean([r["train_s"] for r in res[m]]))}
                if fi is not None:
                    row["paper_nll"] = _fmt(*PAPER_NLL[name][fi][m])
                    row["paper_err"] = _fmt(*PAPER_ERR[name][fi][m])
                    row["paper_GFITC_nll"] = _fmt(*PAPER_NLL[name][fi]["gfitc"])
                    lo, hi = (PAPER_NLL[name][fi][m][0] - 2 * max(PAPER_NLL[name][fi][m][1], 0.005),
                              PAPER_NLL[name][fi][m][0] + 2 * max(PAPER_NLL[name][fi][m][1], 0.005))
                    row["nll_in_2bars"] = bool(lo - 2 * _nz(_se(nll)) <= nll.mean() <= hi + 2 * _nz(_se(nll)))
                summary.append(row)
            print(table(summary[-len(methods):], list(summary[-1])), flush=True)
    print("\nEP, SEP (fit_ep), GFITC (fit_gfitc) and VI (eq. 15) on one model specification, beside table 2 (NLL) and "
          "supplementary table 3 (error) of Villacampa-Calvo and Hernández-Lobato (2017); mean ± standard error over "
          "splits; nll_in_2bars: |ours - paper| within 2 (paper's bar + our standard error)")
    cols = ["dataset", "M", "method", "splits", "nll", "paper_nll", "paper_GFITC_nll", "nll_in_2bars", "error",
            "paper_err", "ms_per_iter", "train_s"]
    print(table(summary, cols))
    _per_iter_table(summary, methods)
    _train_time_table(summary, methods)
    print(f"# total {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, rows)


def _nz(x):
    return 0.0 if math.isnan(x) else x


def _cells(summary, methods, field, suffix):
    """Per (dataset, M) of the summary rows: ``({dataset, M, <method>_<suffix>: value}, {method: value})``."""
    keys = sorted({(r["dataset"], r["M"]) for r in summary}, key=lambda k: (k[0], float(k[1][:-1])))
    for ds, m in keys:
        vals = {r["method"]: r[field] for r in summary if r["dataset"] == ds and r["M"] == m}
        yield {"dataset": ds, "M": m, **{f"{meth}_{suffix}": vals.get(meth, float("nan")) for meth in methods}}, vals


def _train_time_table(summary, methods):
    """Training seconds of every method beside each other (mean over splits) and the paper's average times."""
    out = []
    for rec, _ in _cells(summary, methods, "train_s", "s"):
        m = rec["M"]
        paper = PAPER_TIME.get(float(m[:-1]) / 100)
        if paper is not None:
            for meth, t in zip((_G, _E, _S, _V), paper, strict=True):
                if meth in methods:
                    rec[f"paper_{meth}_s"] = float(t)
        out.append(rec)
    print("\ntraining time (s, whole fit; paper: average over its 8 datasets and 20 splits, R on their machine)")
    print(table(out, list(out[0])))


def _per_iter_table(summary, methods):
    """Time per iteration of EP, SEP and VI beside each other (ratios to SEP), per dataset and M."""
    out = []
    for rec, ms in _cells(summary, methods, "ms_per_iter", "ms"):
        if "sep" in ms:
            for meth in methods:
                if meth != "sep":
                    rec[f"{meth}/sep"] = ms[meth] / ms["sep"]
        out.append(rec)
    print("\ntime per iteration (ms; EP/SEP: one refinement + one hyper-parameter step; GFITC: one L-BFGS iteration, "
          "EP to convergence at each of its evaluations; VI: one Adam step)")
    print(table(out, list(out[0])))


if __name__ == "__main__":
    main()
