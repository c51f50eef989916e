"""Multi-output regression with missing outputs (issue 47, item 3): hourly temperature at the three New York airports
(``pyro_sparsegp.datasets.load_nyc_weather``), one airport's 48 hours held out per block, the blocks rotating over
the airports and the month. GPyTorch's linear model of coregionalisation (``LMCVariationalStrategy``) and its
independent multitask SVGP beside ours: independent outputs (``ps.SVGP(..., num_outputs=3)``) and the LMC
``ps.SVGP(kernel, Z, ps.Gaussian(), num_outputs=3, num_latents=Q)`` on ``y [N, 3]`` with NaN (Álvarez, Rosasco,
Lawrence 2012, section 4.2). This script absorbed ``lmc_weather.py`` (ours only, LMC Q = 2 / 3 against independent
outputs on rotating hidden 48 h blocks): its rotation is the protocol here, the peers run beside it.

    PYTHONPATH=. python benchmarks/multioutput_weather.py [--quick] [--json PATH] [--blocks 0-5] [--num-blocks 6]
        [--gap 48] [--days 28] [--steps S] [--M M] [--latents Q] [--variable temp|dewp] [--methods a,b,...]
        [--summarize A.json,B.json]

Data (the loader's window): 28 days of January 2013 on an hourly grid (666 hours with a report: the file starts at
06:00 UTC), outputs EWR, JFK, LGA (NaN where an hour is missing, 1-2 per airport). Block ``r`` (``--blocks``, of
``--num-blocks`` = 6) hides airport ``r % 3`` (EWR, JFK, LGA, EWR, ...) for ``--gap`` = 48 hours, the six blocks
spread evenly over the window (first hours 94, 182, 270, 359, 447, 535 since Jan 1 00:00 UTC); its values are NaN
in training (the other airports' stay) and are the test set. Time in days from Jan 1; each airport's temperature
standardised with its observed training values. The held-out block is where the outputs' correlation matters: an
independent model has to bridge two days from that airport alone, a coupled one reads them off the other two.

Setting (every GP): M inducing times on an even grid over the window (the same for all, every latent process),
RBF kernels (initial lengthscale 0.25 days, variance 1), noise variance 0.1, ``--steps`` steps on minibatches of
``--batch`` rows (256: GPyTorch's multitask strategies form the minibatch's full covariance, so a full-batch step on
the 666 rows costs 0.4 s on a busy CPU core), Adam learning rate 0.01; block ``r`` seeds the minibatch order.

The record ``records/multioutput_weather.json`` is smaller than the defaults (the README row has the command): the
six blocks at M = 64 and 1000 steps, without ``ours_indep_each``: on the shared CPU (load 7-13 from other jobs) a step
of GPyTorch's LMC at M = 128 took 0.2 s, and the defaults would not fit the session.

* ``gpytorch_lmc``: ``LMCVariationalStrategy(VariationalStrategy(batch Q), num_tasks=3, num_latents=Q)``, constant
  means, a ``MultitaskGaussianLikelihood(num_tasks=3)`` (a noise per task plus a shared one), ``VariationalELBO``,
  Adam; the missing entries are left out of the bound with GPyTorch's ``settings.observation_nan_policy("mask")``
  (gpytorch >= 1.11: the Gaussian likelihoods' expected log-likelihood drops the NaN entries of the targets; checked
  against a hand-written sum over the observed entries in ``tests/integration/test_benchmark_tables.py``), Adam.
* ``gpytorch_lmc_ngd``: the same with GPyTorch's NGD recipe (``NaturalVariationalDistribution`` with batch Q, NGD
  0.1 on the q(u) of the latent processes, Adam on the rest, the LMC coefficients included): the peer, every method
  is timed to its final test NLPD.
* ``gpytorch_indep``: the LMC model's settings with ``IndependentMultitaskVariationalStrategy`` (three independent GPs
  with their own kernels and Z), Adam.
* ``ours_indep``: ``ps.SVGP(RBF(1), Z, ps.Gaussian(0.1), num_outputs=3)`` (one kernel for the three outputs) on the
  rows where all three airports are observed (the held-out hours drop out for every airport, which an independent
  model does not miss), ``ps.infer.fit`` defaults.
* ``ours_indep_each``: three single-output ``ps.SVGP(RBF(1), Z, ps.Gaussian(0.1))``, a kernel and a noise each (as
  ``gpytorch_indep``), each on its airport's observed hours, ``fit`` one after another (the held-out airport's last;
  ``steps`` counts the three fits' steps, the clock runs over all three).
* ``ours_lmc``: ``ps.SVGP(RBF(1), Z, ps.Gaussian(0.1), num_outputs=3, num_latents=Q)`` on every row, NaN
  entries masked out of the bound, ``ps.infer.fit`` defaults.

Scoring on the held-out block, in degrees Fahrenheit: ``rmse`` of the predictive mean; ``test_nlpd``: mean
``-log N(y; mean, var + noise)`` of the predictive marginals; ``time_s``, ``time_to_peer_s``: training seconds and
those to ``gpytorch_lmc_ngd``'s final test NLPD (the held-out NLPD of a run wanders by ~0.05-0.3 from one evaluation
to the next: two days of extrapolation hang on a few parameters, so read the curves too).

``--quick``: block 1 (JFK), M = 16, Q = 2, 20 steps.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import _gpytorch as gpt
import _realdata as rd
import numpy as np
import torch
from _common import parser, table, write_json

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import NYC_AIRPORTS, load_nyc_weather

LR, NGD_LR, NOISE, LENGTHSCALE = 0.01, 0.1, 0.1, 0.25
WINDOW_START_H = 6  # the file's first hour: 2013-01-01 06:00 UTC


@dataclass
class Task:
    name: str
    split: int  # the block (and the seed of the minibatch order)
    X: torch.Tensor  # [N, 1] days
    y: torch.Tensor  # [N, 3] standardised, NaN where missing
    Xt: torch.Tensor  # [T, 1]
    yt: torch.Tensor  # [T, 3] standardised, NaN except the held-out airport
    Z: torch.Tensor  # [M, 1]
    y_mean: torch.Tensor  # [3]
    y_std: torch.Tensor  # [3]
    airport: str = ""  # the held-out block's airport
    start_h: int = 0  # its first hour since 2013-01-01 00:00 UTC


def block_of(r: int, cfg) -> tuple[str, int]:
    """Block ``r``'s airport (``NYC_AIRPORTS[r % 3]``) and first hour: ``--blocks`` blocks of ``--gap`` hours spread
    evenly over the window, each of the three airports in turn (``lmc_weather.py``'s rotation, folded in here)."""
    n = cfg.num_blocks
    return NYC_AIRPORTS[r % 3], WINDOW_START_H + (r + 1) * (24 * cfg.days - WINDOW_START_H - cfg.gap) // (n + 1)


def load_task(cfg, r: int) -> Task:
    airport, h0 = block_of(r, cfg)
    start = (np.datetime64("2013-01-01T00", "h") + np.timedelta64(h0, "h")).astype(str)
    s = load_nyc_weather(variable=cfg.variable, days=cfg.days, holdout_airport=airport, holdout_start=start,
                         holdout_days=cfg.gap / 24)
    X, Xt = s.X_train / 24, s.X_test / 24
    mean = torch.stack([c[c.isfinite()].mean() for c in s.y_train.T])
    std = torch.stack([c[c.isfinite()].std() for c in s.y_train.T])
    Z = torch.linspace(X.min().item(), X.max().item(), cfg.M).unsqueeze(-1)
    return Task(f"nyc_weather_{cfg.variable}", r, X, (s.y_train - mean) / std, Xt, (s.y_test - mean) / std, Z,
                mean, std, airport, h0)


def metrics(task: Task, mean, var):
    """RMSE (degrees F) and NLPD (per held-out value, in degrees F) of the predictive marginals ``N(mean, var)``
    ``[T, 3]`` (standardised units) on the held-out entries."""
    obs = task.yt.isfinite()
    scale = task.y_std.expand_as(task.yt)[obs]
    m, v, y = mean[obs], var[obs], task.yt[obs]
    lp = torch.distributions.Normal(m, v.sqrt()).log_prob(y) - scale.log()
    return {"test_nlpd": -lp.mean().item(), "rmse": ((m - y) * scale).pow(2).mean().sqrt().item()}


# -- GPyTorch -------------------------------------------------------------------------------------------------------
def run_gpytorch(task: Task, cfg, lmc: bool, ngd: bool = False) -> rd.Trace:
    import gpytorch

    Q = cfg.latents if lmc else 3
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3)
    lik.noise = NOISE / 2  # the shared noise; each task's adds as much: 0.1 in all
    lik.task_noises = torch.full((3,), NOISE / 2)
    model = gpt.approximate_gp(task.Z, mean="constant", latents=Q, tasks=3, lmc=lmc,
                               distribution="natural" if ngd else "cholesky", lengthscale=LENGTHSCALE, outputscale=1.0)
    opts = gpt.optimizers(model, lik, len(task.X), LR, NGD_LR if ngd else None)

    def evaluate():
        def go():
            pred = lik(model(task.Xt))  # MultitaskMultivariateNormal [T, 3] with the noise
            return metrics(task, pred.mean, pred.variance)

        return gpt.evaluate(model, lik, go)

    with gpytorch.settings.observation_nan_policy("mask"):
        return gpt.train(model, lik, task.X, task.y, cfg.steps, cfg.batch, rd.Trace(evaluate, cfg.every), opts,
                         seed=task.split)


# -- ours -----------------------------------------------------------------------------------------------------------
def _ours(task: Task, X, y, cfg, **kw) -> rd.Trace:
    from pyro.contrib.gp.kernels import RBF

    gp = ps.SVGP(RBF(1, lengthscale=torch.tensor(LENGTHSCALE)), task.Z.clone(), ps.Gaussian(noise=NOISE),
                 num_outputs=3, **kw)

    def evaluate():
        _, _, pred = gp.predict(task.Xt, full=True)  # the predictive distribution of y* [T, 3]
        return metrics(task, pred.mean, pred.variance)

    return rd.ours_fit(gp, X, y, cfg.steps, cfg.batch, rd.Trace(evaluate, cfg.every), lr=LR, seed=task.split)


def run_ours_indep(task: Task, cfg) -> rd.Trace:
    complete = task.y.isfinite().all(-1)
    return _ours(task, task.X[complete], task.y[complete], cfg)


def run_ours_each(task: Task, cfg) -> rd.Trace:
    """Three single-output SVGPs (a kernel and a noise each), each fitted to its airport's observed hours, one after
    another with the held-out airport's last; one clock over the three, evaluations of the held-out airport's."""
    from pyro.contrib.gp.kernels import RBF

    held = int(task.yt.isfinite().any(0).nonzero()[0, 0])
    gps = [ps.SVGP(RBF(1, lengthscale=torch.tensor(LENGTHSCALE)), task.Z.clone(), ps.Gaussian(noise=NOISE))
           for _ in range(3)]

    def evaluate():
        mean, var = torch.zeros_like(task.yt), torch.ones_like(task.yt)  # only the held-out column is scored
        _, _, pred = gps[held].predict(task.Xt, full=True)
        mean[:, held], var[:, held] = pred.mean, pred.variance
        return metrics(task, mean, var)

    trace = rd.Trace(evaluate, cfg.every)
    for j in sorted(range(3), key=lambda j: j == held):
        obs = task.y[:, j].isfinite()
        rd.ours_fit(gps[j], task.X[obs], task.y[obs, j], cfg.steps, cfg.batch, trace, lr=LR, seed=task.split)
    return trace


def run_ours_lmc(task: Task, cfg) -> rd.Trace:
    """LMC (``num_latents``) on every row, NaN entries masked out of the bound."""
    return _ours(task, task.X, task.y, cfg, num_latents=cfg.latents)


METHODS = {
    "gpytorch_lmc": rd.Method(lambda t, c: run_gpytorch(t, c, lmc=True), "gpytorch", peer="gpytorch_lmc_ngd"),
    "gpytorch_lmc_ngd": rd.Method(lambda t, c: run_gpytorch(t, c, lmc=True, ngd=True), "gpytorch"),
    "gpytorch_indep": rd.Method(lambda t, c: run_gpytorch(t, c, lmc=False), "gpytorch", peer="gpytorch_lmc_ngd"),
    "ours_indep": rd.Method(run_ours_indep, "pyro_sparsegp", peer="gpytorch_lmc_ngd"),
    "ours_indep_each": rd.Method(run_ours_each, "pyro_sparsegp", peer="gpytorch_lmc_ngd"),
    "ours_lmc": rd.Method(run_ours_lmc, "pyro_sparsegp", peer="gpytorch_lmc_ngd"),
}

# time to the peer: from when a run stays within REACH_TOL nats of the peer's final NLPD
# (the held-out NLPD wanders by 0.05-0.3)
REACH_TOL = 0.05
DONE_WHEN = [  # issue 47: (label, a, b[, options]) for _realdata.condition
    ("LMC vs independent (one kernel)", "ours_lmc", "ours_indep"),
    ("LMC vs independent (a kernel each)", "ours_lmc", "ours_indep_each"),
    ("LMC vs GPyTorch LMC (NGD)", "ours_lmc", "gpytorch_lmc_ngd", {"rule": "no_worse", "timed": True}),
    ("LMC vs GPyTorch LMC (Adam)", "ours_lmc", "gpytorch_lmc", {"rule": "no_worse", "timed": True}),
]


def config(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--blocks", default=None, help="held-out blocks to run, e.g. 0-5 (default 0-5)")
    p.add_argument("--num-blocks", type=int, default=6, help="blocks spread over the window (the rotation's length)")
    p.add_argument("--gap", type=int, default=48, help="hours per held-out block")
    p.add_argument("--days", type=int, default=28, help="days of January 2013 in the window")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000)")
    p.add_argument("--M", type=int, default=None, help="inducing times (default 128)")
    p.add_argument("--latents", type=int, default=None, help="LMC latent processes Q (default 3)")
    p.add_argument("--batch", type=int, default=256, help="minibatch rows")
    p.add_argument("--variable", choices=["temp", "dewp"], default="temp")
    p.add_argument("--every", type=int, default=None, help="steps between test evaluations (default 50)")
    rd.add_method_arguments(p, METHODS)
    a = p.parse_args(argv)
    a.blocks = rd.parse_splits(a.blocks or ("1" if a.quick else f"0-{a.num_blocks - 1}"))
    a.steps = a.steps or (20 if a.quick else 2000)
    a.M = a.M or (16 if a.quick else 128)
    a.latents = a.latents or (2 if a.quick else 3)
    a.every = a.every or (10 if a.quick else 50)
    return rd.parse_methods(p, a, METHODS)


def main(argv=None) -> list[dict]:
    cfg = config(argv)
    rows = rd.begin(cfg, REACH_TOL)
    for r in [] if cfg.summarize else cfg.blocks:
        cfg.seed = r
        task = load_task(cfg, r)
        print(f"# nyc_weather {cfg.variable}, block {r}: {len(task.X)} hours x 3 airports "
              f"({int(task.y.isnan().sum())} missing entries, {int(task.y.isfinite().all(-1).sum())} complete rows), "
              f"{task.airport} held out for {len(task.Xt)} hours from hour {task.start_h}; M = {cfg.M}, "
              f"Q = {cfg.latents}, {cfg.steps} steps of {cfg.batch}", flush=True)
        runs = rd.run_methods(METHODS, cfg.methods, task, cfg)
        rows += rd.split_rows(runs, METHODS, {"dataset": f"nyc_weather_{cfg.variable}", "split": r, "M": cfg.M,
                                              "airport": task.airport, "start_h": task.start_h}, REACH_TOL)
        write_json(cfg.json, rows) if cfg.json else None
    print("\nNYC weather, held-out blocks (RMSE and NLPD per value in degrees F; time_to_peer_s: "
          f"training seconds to gpytorch_lmc_ngd's final test NLPD, staying within {REACH_TOL} nats of it):")
    print(table(rows, ["split", "airport", "start_h", "method", "library", "test_nlpd", "rmse", "time_s",
                       "time_to_peer_s", "steps"]))
    print(f"\nMean over blocks (reached: blocks on which the run settled within {REACH_TOL} nats of the peer's "
          "final NLPD):")
    print(table(rd.summarize(rows), ["method", "library", "splits", "test_nlpd", "test_nlpd_se", "rmse", "time_s",
                                     "reached", "time_to_peer_s"]))
    checks = rd.conditions(rows, DONE_WHEN, REACH_TOL)
    write_json(cfg.json, rows + checks)
    return rows


if __name__ == "__main__":
    main()
