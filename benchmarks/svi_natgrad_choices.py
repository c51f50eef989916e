"""``ps.infer.NaturalGradient`` under plain ``SVI``: which step length and warm-up to use (issue 26, items 1 and 3).
Final losses after the same steps for the step length (0.1, 0.01), the warm-up (none, ``warmup=5``) and Adam alone,
on two kinds of program; the numbers behind the advice in ``docs/composing.md``.

    PYTHONPATH=. python benchmarks/svi_natgrad_choices.py [--part grid|dgp|both] [--json PATH] [--threads T]
        [--quick]

* ``grid``: SVGP (M = 40) and SOLVE-GP (20 + 20) on 2,000 points in 3-D (``sin(2 x1) + x2 x3 / 2`` plus noise
  0.1), the layers' own ``model``/``guide`` under ``Trace_ELBO`` and ``TraceMeanField_ELBO`` (one particle),
  minibatches of 64 and 256 (``subsample_size``), natural step lengths 0.1 and 0.01, each with ``warmup=0`` and
  ``warmup=5``, and Adam (lr 0.01) on everything; 3 seeds, 300 steps. Column ``loss``: minus the closed-form bound
  per point on all the data at the end (lower is better).
* ``dgp``: the README's hand-written 2-layer deep GP (a 2-output hidden SVGP with a PCA mean, then a Gaussian
  output SVGP; ``Z = X[:30]``) on 600 points of scikit-learn's Friedman #1 (noise 1, standardised),
  ``TraceMeanField_ELBO(num_particles=5, vectorize_particles=True)``, minibatches of 100, 200 steps, seeds 0-3.
  Column ``loss``: the mean of 10 ELBO estimates on all the data at the end (lower is better).

Rows: ``part``, ``model``, ``elbo``, ``batch``, ``seed``, ``method`` (``ng0.1``, ``ng0.1_warmup5``, ``ng0.01``,
``ng0.01_warmup5``, ``adam``), ``loss``. ``--quick``: seed 0 and minibatch 256 only, 100 steps.
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import pyro
import torch
from _common import parser, setup, table, write_json
from pyro.contrib.gp.kernels import RBF
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.mean_functions import FixedProjection

METHODS = {"ng0.1": (0.1, 0), "ng0.1_warmup5": (0.1, 5), "ng0.01": (0.01, 0), "ng0.01_warmup5": (0.01, 5),
           "adam": (None, 0)}


def _optim(method):
    lr, warmup = METHODS[method]
    adam = pyro.optim.Adam({"lr": 0.01})
    return adam if lr is None else ps.infer.NaturalGradient(adam, natgrad=ps.infer.NaturalPolicy(lr=lr, warmup=warmup))


def grid_data(N=2000):
    g = torch.Generator().manual_seed(0)  # drawn on the CPU (the same data under --device), then moved
    X = torch.rand(N, 3, generator=g, device="cpu") * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(N, generator=g, device="cpu")
    return X.to(torch.get_default_device()), y.to(torch.get_default_device())


def grid_run(X, y, model, elbo_cls, B, seed, method, steps):
    pyro.set_rng_seed(seed)
    Z = X[torch.randperm(len(X), generator=torch.Generator().manual_seed(seed), device="cpu")[:40]].clone()
    gp = (ps.SVGP(RBF(3), Z, ps.Gaussian(0.1)) if model == "svgp"
          else ps.SOLVEGP(RBF(3), Z[:20].clone(), Z[20:].clone(), ps.Gaussian(0.1)))
    svi = SVI(gp.model, gp.guide, _optim(method), elbo_cls())
    for _ in range(steps):
        svi.step(X, y, subsample_size=B)
    with torch.no_grad():
        return -gp.analytic_elbo(X, y).item() / len(X)


def dgp_data():
    from sklearn.datasets import make_friedman1

    Xn, yn = make_friedman1(n_samples=600, noise=1.0, random_state=0)
    X = torch.tensor((Xn - Xn.mean(0)) / Xn.std(0))
    return X, torch.tensor((yn - yn.mean()) / yn.std())


def dgp_run(X, y, seed, method, steps):
    pyro.set_rng_seed(seed)
    Z = X[:30].clone()
    hidden = ps.SVGP(RBF(X.shape[1]), Z, num_outputs=2, mean_function=FixedProjection.from_pca(X, 2), name="h")
    out = ps.SVGP(RBF(2), hidden.mean_function(Z), ps.Gaussian(0.1), name="out")

    def model(X, y):
        u1, u2 = hidden.sample_u(), out.sample_u()
        with pyro.plate("data", len(X), subsample_size=100) as i:
            h = hidden.sample_hidden(X[i], u1)
            pyro.sample("y", out.likelihood.distribution(out.sample_f(h, u2)), obs=y[i])

    def guide(X, y):
        u1, u2 = hidden.sample_u(guide=True), out.sample_u(guide=True)
        with pyro.plate("data", len(X), subsample_size=100) as i:
            out.sample_f(hidden.sample_hidden(X[i], u1, guide=True), u2, guide=True)

    elbo = TraceMeanField_ELBO(num_particles=5, vectorize_particles=True, max_plate_nesting=2)
    svi = SVI(model, guide, _optim(method), elbo)
    for _ in range(steps):
        svi.step(X, y)
    with torch.no_grad():
        return float(np.mean([elbo.loss(model, guide, X, y) for _ in range(10)]))


def main():
    p = parser(__doc__)
    p.add_argument("--part", default="both", choices=["grid", "dgp", "both"])
    args = p.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore")
    seeds, batches = ([0], [256]) if args.quick else ([0, 1, 2], [64, 256])
    rows = []
    if args.part in ("grid", "both"):
        X, y = grid_data()
        steps = 100 if args.quick else 300
        for model, elbo_cls, B, seed in itertools.product(["svgp", "solvegp"], [Trace_ELBO, TraceMeanField_ELBO],
                                                          batches, seeds):
            for method in METHODS:
                rows.append({"part": "grid", "model": model, "elbo": elbo_cls.__name__, "batch": B, "seed": seed,
                             "method": method, "steps": steps,
                             "loss": grid_run(X, y, model, elbo_cls, B, seed, method, steps)})
                print(table(rows[-1:], ["model", "elbo", "batch", "seed", "method", "loss"]), flush=True)
    if args.part in ("dgp", "both"):
        X, y = dgp_data()
        steps = 100 if args.quick else 200
        for seed in (seeds if args.quick else [0, 1, 2, 3]):
            for method in ("ng0.1", "ng0.1_warmup5", "ng0.01", "adam"):
                loss = dgp_run(X, y, seed, method, steps)
                rows.append({"part": "dgp", "model": "dgp2", "elbo": "TraceMeanField_ELBO(5)", "batch": 100,
                             "seed": seed, "method": method, "steps": steps, "loss": loss})
                print(table(rows[-1:], ["model", "seed", "method", "loss"]), flush=True)
    print(table(rows, ["part", "model", "elbo", "batch", "seed", "method", "loss"]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
