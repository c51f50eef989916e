"""Heteroscedastic regression on real data (issue 47, item 3): GPyTorch's nearest recipe (two independent latent GPs,
mean f and log noise scale g, through ``IndependentMultitaskVariationalStrategy``, with a likelihood
``y ~ N(f, exp(g)^2)`` whose expected log-likelihood is in closed form) and its homoscedastic SVGP, beside ours: the
homoscedastic ``ps.SVGP`` with ``ps.Gaussian`` and, as a hook that runs once ``ps.HeteroscedasticGaussian`` is on the
branch, ``ps.SVGP(kernel, Z, ps.HeteroscedasticGaussian())``.

    PYTHONPATH=. python benchmarks/heteroscedastic.py [--quick] [--json PATH] [--datasets mcycle,protein]
        [--splits 0-9] [--steps S] [--M M] [--methods a,b,...] [--summarize A.json,B.json]

Data sets: ``mcycle`` (Silverman 1985, 133 points; ``pyro_sparsegp.datasets.load_mcycle``): random 90/10 splits drawn
with ``numpy.random.default_rng(split)`` (120 / 13 points), 10 by default. ``protein`` (UCI protein tertiary
structure, 45,730 x 9; ``_common.load_regression``: the Hernández-Lobato & Adams / Gal & Ghahramani 90/10 splits, 5
of them, 3 by default; 41,157 / 4,573 points) is the larger set. Among the regression sets in ``../shared/data`` its
noise depends clearly on the inputs: a gradient-boosted model of the log squared residuals of a boosted mean (5-fold,
20,000 points) lowers the held-out Gaussian NLL by 0.10 nats per point against a constant variance, where powerplant
gains 0.01, kin8nm loses 0.02, elevators gains 0.04 and kin40k 0.08 (bike's target is a function of two of its inputs,
fitted with R^2 = 1.000; pol's takes 11 values). It is large enough that minibatches matter, and
``time_to_accuracy.py`` already runs it homoscedastic.

Defaults: mcycle 10 splits, M = 32, 1000 full-batch steps; protein 3 splits, M = 64, 2000 steps of 1024 (50 epochs);
sized for a shared 2-core CPU. The record ``records/heteroscedastic.json`` is smaller (the README row has the commands):
mcycle splits 0-4 and protein splits 0-2 (1000 steps), without ``gpytorch_svgp`` (and on protein ``gpytorch_het``),
the Adam runs that lose to GPyTorch's NGD recipe; on the shared CPU (load 7-13 from other jobs) an mcycle step cost
~30 ms, and the full protocol would not fit the session.

Setting (every GP): inputs and targets standardised with the training statistics; M inducing inputs drawn from the
training inputs (the same for all), RBF kernels with one lengthscale per input (initial lengthscales 1, variance 1),
initial noise variance 0.1 (heteroscedastic: the g latent's constant mean at ``log sqrt(0.1)``); minibatches of
``--batch`` (1024; mcycle: full batch), ``--steps`` steps, Adam learning rate 0.01.

* ``gpytorch_svgp``: ``ApproximateGP`` + ``VariationalStrategy`` + ``GaussianLikelihood``, Adam;
  ``gpytorch_svgp_ngd``: its NGD recipe (``NaturalVariationalDistribution``, NGD 0.1 on q(u), Adam on the rest), the
  peer of the homoscedastic methods.
* ``gpytorch_het``: ``IndependentMultitaskVariationalStrategy`` over two GPs (batch 2: kernels, constant means, q(u)
  and Z of their own) with the likelihood of :func:`het_likelihood`, ``VariationalELBO``, Adam;
  ``gpytorch_het_ngd``: the same with the NGD recipe, the peer of the heteroscedastic methods (on mcycle it reaches
  in 700 steps what Adam has not reached after 3000).
* ``ours_svgp``: ``ps.SVGP(RBF, Z, ps.Gaussian(0.1))`` with ``ps.infer.fit`` defaults (natural gradients on q(u) and
  the noise, Adam 0.01 on the rest, the exact finish).
* ``ours_het``: ``ps.SVGP(RBF, Z, ps.HeteroscedasticGaussian())`` (two latents sharing the kernel, zero prior means,
  ``num_outputs`` inferred) with ``ps.infer.fit`` defaults; ``ours_het_sep``: a kernel per latent
  (``ps.SVGP([RBF, RBF], ...)``) and ``Constant(2, [0, log sqrt(0.1)])`` prior means, GPyTorch's recipe.

Scoring: ``test_nlpd``, the mean negative log predictive density of the test targets in the original units:
homoscedastic ``-log N(y; mu_f, var_f + noise)``; heteroscedastic ``-log ∫ N(y; mu_f, var_f + exp(2 g)) q(g) dg`` by
64-point Gauss-Hermite quadrature over q(g); ``rmse`` of the predictive mean, in the original units; ``time_s``,
``time_to_peer_s``: training seconds (evaluations every ``--every`` steps excluded) and those to the peer's final test
NLPD.

``--quick``: mcycle split 0, M = 8, 20 steps.
"""
from __future__ import annotations

import argparse
import math

import _gpytorch as gpt
import _realdata as rd
import torch
from _common import load_regression, parser, table, write_json

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import load_mcycle, standardize

LR, NGD_LR, NOISE = 0.01, 0.1, 0.1
DEFAULTS = {  # dataset: (splits, M, steps, batch)
    "mcycle": ("0-9", 32, 1000, 1024),
    "protein": ("0-2", 64, 2000, 1024),
}


Task = rd.Task


def load_task(name: str, split: int, M: int, seed: int = 0) -> Task:
    if name == "mcycle":
        X, y = load_mcycle()
        train, test = rd.random_split(len(X), split)
        X, Xt, y, yt = X[train], X[test], y[train], y[test]
    else:
        s = load_regression(name, split, dtype=torch.get_default_dtype())
        X, Xt, y, yt = s.X_train, s.X_test, s.y_train, s.y_test
    X, Xt, _, _ = standardize(X, Xt)
    y, yt, _, y_std = standardize(y, yt)
    return Task(name, split, X, y, Xt, yt, rd.inducing_subset(X, M, seed + split), float(y_std))


def gaussian_metrics(task: Task, mean, var, noise):
    """Homoscedastic predictive ``N(mean, var + noise)`` in standardised units -> NLPD and RMSE in the original."""
    lp = torch.distributions.Normal(mean, (var + noise).sqrt()).log_prob(task.yt) - math.log(task.y_std)
    return {"test_nlpd": -lp.mean().item(), "rmse": ((mean - task.yt) * task.y_std).pow(2).mean().sqrt().item()}


def het_metrics(task: Task, mf, vf, mg, vg):
    """Heteroscedastic predictive ``∫ N(y; mf, vf + exp(2 g)) N(g; mg, vg) dg`` by quadrature over g."""
    def normal(g):  # g [T, n]
        return torch.distributions.Normal(mf.unsqueeze(-1), (vf.unsqueeze(-1) + (2 * g).exp()).sqrt())

    lp, _ = rd.predictive(normal, task.yt, mg, vg)
    return {"test_nlpd": -(lp - math.log(task.y_std)).mean().item(),
            "rmse": ((mf - task.yt) * task.y_std).pow(2).mean().sqrt().item()}


def batch_size(task: Task, cfg) -> int:
    return len(task.X) if task.name == "mcycle" else cfg.batch


# -- GPyTorch -------------------------------------------------------------------------------------------------------
def het_likelihood():
    """GPyTorch likelihood ``y ~ N(f, exp(g)^2)`` for a two-task ``MultitaskMultivariateNormal`` ``[..., N, 2]``
    (task 0: f, task 1: g), with the expected log-likelihood in closed form:
    ``E[log N(y; f, e^{2g})] = -log(2 pi)/2 - m_g - ((y - m_f)^2 + v_f) exp(2 v_g - 2 m_g) / 2``
    (``E[exp(-2 g)] = exp(-2 m_g + 2 v_g)``; Lázaro-Gredilla & Titsias 2011, Saul et al. 2016)."""
    import gpytorch

    class HeteroscedasticGaussianLikelihood(gpytorch.likelihoods.Likelihood):
        def forward(self, function_samples, *args, **kwargs):
            return torch.distributions.Normal(function_samples[..., 0], function_samples[..., 1].exp())

        def expected_log_prob(self, observations, function_dist, *args, **kwargs):
            m, v = function_dist.mean, function_dist.variance  # [..., N, 2]
            mf, mg, vf, vg = m[..., 0], m[..., 1], v[..., 0], v[..., 1]
            return (-0.5 * math.log(2 * math.pi) - mg
                    - 0.5 * ((observations - mf).square() + vf) * (2 * vg - 2 * mg).exp())

    return HeteroscedasticGaussianLikelihood()


def run_gpytorch(task: Task, cfg, ngd: bool = False) -> rd.Trace:
    import gpytorch

    lik = gpytorch.likelihoods.GaussianLikelihood()
    lik.noise = NOISE
    model = gpt.approximate_gp(task.Z, distribution="natural" if ngd else "cholesky", lengthscale=1.0,
                               outputscale=1.0)
    opts = gpt.optimizers(model, lik, len(task.X), LR, NGD_LR if ngd else None)

    def evaluate():
        def go():
            f = model(task.Xt)
            return gaussian_metrics(task, f.mean, f.variance, lik.noise)

        return gpt.evaluate(model, lik, go)

    return gpt.train(model, lik, task.X, task.y, cfg.steps, batch_size(task, cfg), rd.Trace(evaluate, cfg.every),
                     opts, seed=cfg.seed)


def run_gpytorch_het(task: Task, cfg, ngd: bool = False) -> rd.Trace:
    lik = het_likelihood()
    model = gpt.approximate_gp(task.Z, mean="constant", latents=2, distribution="natural" if ngd else "cholesky",
                               lengthscale=1.0, outputscale=1.0)
    model.mean_module.constant = torch.tensor([0.0, 0.5 * math.log(NOISE)])  # f: 0; g: log sd of noise 0.1
    opts = gpt.optimizers(model, lik, len(task.X), LR, NGD_LR if ngd else None)

    def evaluate():
        def go():
            q = model(task.Xt)  # MultitaskMultivariateNormal [T, 2]
            m, v = q.mean, q.variance
            return het_metrics(task, m[:, 0], v[:, 0], m[:, 1], v[:, 1])

        return gpt.evaluate(model, lik, go)

    return gpt.train(model, lik, task.X, task.y, cfg.steps, batch_size(task, cfg), rd.Trace(evaluate, cfg.every),
                     opts, seed=cfg.seed)


# -- ours -----------------------------------------------------------------------------------------------------------
def _kernel(D: int):
    from pyro.contrib.gp.kernels import RBF

    return RBF(D, lengthscale=torch.ones(D))


def run_ours(task: Task, cfg) -> rd.Trace:
    gp = ps.SVGP(_kernel(task.X.shape[1]), task.Z.clone(), ps.Gaussian(noise=NOISE))

    def evaluate():
        mean, var = gp.predict(task.Xt)
        return gaussian_metrics(task, mean, var, gp.likelihood.noise.detach())

    return rd.ours_fit(gp, task.X, task.y, cfg.steps, batch_size(task, cfg), rd.Trace(evaluate, cfg.every), lr=LR)


def run_ours_het(task: Task, cfg, separate: bool = False) -> rd.Trace:
    """``ps.HeteroscedasticGaussian`` (latent 0: the mean, latent 1: the log noise scale), one kernel shared by both
    latents and zero prior means (the plain call); ``separate``: a kernel per latent (a list of kernels,
    ``docs/multioutput.md``) and constant prior means started at 0 and ``log sqrt(0.1)`` (``Constant(2, ...)``),
    GPyTorch's recipe."""
    from pyro_sparsegp.mean_functions import Constant

    D = task.X.shape[1]
    if separate:
        gp = ps.SVGP([_kernel(D), _kernel(D)], task.Z.clone(), ps.HeteroscedasticGaussian(),
                     mean_function=Constant(2, torch.tensor([0.0, 0.5 * math.log(NOISE)])))
    else:
        gp = ps.SVGP(_kernel(D), task.Z.clone(), ps.HeteroscedasticGaussian())

    def evaluate():
        mean, var = gp.predict(task.Xt)  # [T, 2] each
        return het_metrics(task, mean[:, 0], var[:, 0], mean[:, 1], var[:, 1])

    return rd.ours_fit(gp, task.X, task.y, cfg.steps, batch_size(task, cfg), rd.Trace(evaluate, cfg.every), lr=LR)


METHODS = {
    "gpytorch_svgp": rd.Method(run_gpytorch, "gpytorch", peer="gpytorch_svgp_ngd"),
    "gpytorch_svgp_ngd": rd.Method(lambda t, c: run_gpytorch(t, c, ngd=True), "gpytorch"),
    "gpytorch_het": rd.Method(run_gpytorch_het, "gpytorch", peer="gpytorch_het_ngd"),
    "gpytorch_het_ngd": rd.Method(lambda t, c: run_gpytorch_het(t, c, ngd=True), "gpytorch"),
    "ours_svgp": rd.Method(run_ours, "pyro_sparsegp", peer="gpytorch_svgp_ngd"),
    "ours_het": rd.Method(run_ours_het, "pyro_sparsegp", peer="gpytorch_het_ngd"),
    "ours_het_sep": rd.Method(lambda t, c: run_ours_het(t, c, separate=True), "pyro_sparsegp",
                              peer="gpytorch_het_ngd"),
}

# time to the peer: from when a run stays within REACH_TOL nats of the peer's final NLPD
# (mcycle's 13 test points make the curves wander by a few 0.001)
REACH_TOL = 0.01
DONE_WHEN = [  # issue 47: (label, a, b[, options]) for _realdata.condition, per data set
    *((f"{d}: heteroscedastic vs homoscedastic", "ours_het", "ours_svgp", {"dataset": d}) for d in DEFAULTS),
    *((f"{d}: ours vs GPyTorch heteroscedastic (NGD)", "ours_het", "gpytorch_het_ngd", {"dataset": d, "timed": True})
      for d in DEFAULTS),
    *((f"{d}: ours vs GPyTorch homoscedastic (NGD)", "ours_svgp", "gpytorch_svgp_ngd", {"dataset": d, "timed": True})
      for d in DEFAULTS),
]


def config(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--datasets", default=None, help="comma-separated: mcycle, protein (default both)")
    p.add_argument("--splits", default=None, help="e.g. 0-9 (default: mcycle 0-9, protein 0-2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: mcycle 1000, protein 2000)")
    p.add_argument("--M", type=int, default=None, help="inducing points (default: mcycle 32, protein 64)")
    p.add_argument("--batch", type=int, default=1024, help="minibatch size (mcycle: always the full batch)")
    p.add_argument("--every", type=int, default=None, help="steps between test evaluations (default 50)")
    rd.add_method_arguments(p, METHODS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.datasets = (a.datasets or ("mcycle" if a.quick else "mcycle,protein")).split(",")
    a.every = a.every or (10 if a.quick else 50)
    return rd.parse_methods(p, a, METHODS)


def main(argv=None) -> list[dict]:
    cfg = config(argv)
    rows = rd.begin(cfg, REACH_TOL)
    for name in [] if cfg.summarize else cfg.datasets:
        splits, M, steps, _ = DEFAULTS[name]
        run_cfg = argparse.Namespace(**{**vars(cfg), "steps": cfg.steps or (20 if cfg.quick else steps)})
        M = cfg.M or (8 if cfg.quick else M)
        for split in rd.parse_splits(cfg.splits or ("0" if cfg.quick else splits)):
            task = load_task(name, split, M, cfg.seed)
            print(f"# {name} split {split}: {len(task.X)} train / {len(task.Xt)} test, D = {task.X.shape[1]}, "
                  f"M = {len(task.Z)}, {run_cfg.steps} steps of {batch_size(task, cfg)}", flush=True)
            runs = rd.run_methods(METHODS, cfg.methods, task, run_cfg)
            rows += rd.split_rows(runs, METHODS, {"dataset": name, "split": split, "M": len(task.Z)}, REACH_TOL)
            write_json(cfg.json, rows) if cfg.json else None
    print("\nHeteroscedastic regression, per split (test NLPD per point in the original units; time_to_peer_s: "
          f"training seconds to the peer's final test NLPD, staying within {REACH_TOL} nats of it):")
    print(table(rows, ["dataset", "split", "method", "library", "test_nlpd", "rmse", "time_s", "time_to_peer_s",
                       "steps", "peer"]))
    print("\nMean over splits (se: standard error; reached: splits on which the run "
          f"settled within {REACH_TOL} nats of the peer's final NLPD):")
    print(table(rd.summarize(rows), ["dataset", "method", "library", "splits", "test_nlpd", "test_nlpd_se", "rmse",
                                     "time_s", "reached", "time_to_peer_s"]))
    checks = rd.conditions(rows, DONE_WHEN, REACH_TOL)
    write_json(cfg.json, rows + checks)
    return rows


if __name__ == "__main__":
    main()
