"""Count regression on NMES 1988 (issue 47, item 3): GPyTorch's SVGP with its Poisson and negative-binomial
likelihoods (Adam, and its NGD recipe), Poisson and negative-binomial GLMs fitted by maximum likelihood, and ours
(``ps.Poisson``, ``ps.NegativeBinomial`` NB2 and NB1, and GPyTorch's own negative-binomial model written with
``ps.likelihoods.from_distribution``), on the 10 random 90/10 splits of ``pyro_sparsegp.datasets.load_nmes1988``.

    PYTHONPATH=. python benchmarks/counts_nmes.py [--quick] [--json PATH] [--splits 0-9] [--steps S] [--M M]
        [--methods a,b,...] [--mean constant|linear] [--summarize A.json,B.json]

The record ``records/counts_nmes.json`` holds the ten splits (2000 steps, M = 64; the README row has the commands):
every negative-binomial method and GLM on all ten, the two Poisson GPs on splits 0, 4 and 7 only (each GP run took
2-7 minutes on the shared 2-core CPU, and the Poisson comparison is a nat wide).

Setting: ``visits`` (physician office visits, 4,406 people, mean 5.8, variance 45: over-dispersed, 15 % zeros) on 17
covariates (5 numeric, 12 dummies), inputs standardised with the training statistics, counts raw. Every GP has M
inducing inputs drawn from the training inputs (the same for all), an RBF kernel with one lengthscale per input
(initial lengthscales 1, variance 1), a constant prior mean (``--mean linear``: a linear one) started at the link's
inverse of the training mean, q(u) whitened and at the prior, minibatches of ``--batch`` (1024) and ``--steps`` steps
of Adam with learning rate 0.01 (GPyTorch's examples).

* ``gpytorch_poisson`` / ``gpytorch_negbin``: ``ApproximateGP`` + ``CholeskyVariationalDistribution`` +
  ``VariationalStrategy`` with ``PoissonLikelihood`` / ``NegativeBinomialLikelihood`` (gpytorch 1.15.2: mean
  ``softplus(f)``; the negative binomial's success probability p is learned and shared, so its variance is
  ``mean / (1 - p)``: an NB1 model), ``VariationalELBO`` (20-point Gauss-Hermite expected log-likelihood), Adam.
* ``gpytorch_poisson_ngd`` / ``gpytorch_negbin_ngd``: the same models with GPyTorch's NGD recipe
  (``NaturalVariationalDistribution``, ``gpytorch.optim.NGD`` with step 0.1 on q(u), Adam 0.01 on the rest; its docs
  give it for any likelihood). They are the peers: every Poisson method is timed to ``gpytorch_poisson_ngd``'s final
  test NLPD, every negative-binomial one to ``gpytorch_negbin_ngd``'s.
* ``glm_poisson`` / ``glm_negbin`` / ``glm_negbin1``: log-linear GLMs (intercept + the 17 covariates) by full-batch
  L-BFGS (strong Wolfe) on the mean negative log-likelihood; the negative binomial is NB2 (variance
  ``mu + alpha mu^2``, ``log alpha`` learned: Deb & Trivedi's 1997 negbin II) or NB1 (variance ``mu (1 + alpha)``).
  A GP with a constant mean should come close to them, one with a linear mean should not lose.
* ``ours_poisson`` / ``ours_negbin`` / ``ours_negbin1``: ``ps.SVGP(RBF, Z, ps.Poisson() | ps.NegativeBinomial() |
  ps.NegativeBinomial(variance="NB1"), mean_function=Constant(log mean))`` trained with ``ps.infer.fit`` defaults
  (``lr`` 0.01, the same steps and minibatches).
* ``ours_negbin1_softplus``: the model of ``gpytorch_negbin`` (NB1, mean ``softplus(f)``: :class:`SoftplusNB1`) as a
  user writes it with ``ps.likelihoods.from_distribution``, the constant mean at ``softplus^-1`` of the mean count,
  ``fit`` defaults: the same model trained by both libraries. NMES 1988 tends to prefer NB1 to NB2 (GLMs: 0.03-0.04
  nats on 3 of splits 0-4), so ``ours_negbin`` (NB2) against ``gpytorch_negbin`` compares the models more than the
  inference.
* ``ours_negbin_het``: ``ps.HeteroscedasticNegativeBinomial(variance="NB1")``, the NB1 whose log dispersion is a
  second latent GP (``Constant(2, [log mean, 0])``: dispersion started at 1), ``fit`` defaults: the count model a
  user of this library would reach for when the over-dispersion may vary with the covariates (Deb and Trivedi 1997
  fit these data with finite mixtures of negative binomials: one dispersion for everybody is the doubtful part).

Scoring (the same for all): ``test_nlpd``, the mean negative log predictive density of the test counts,
``-log ∫ p(y|f) q(f) df`` by 64-point Gauss-Hermite quadrature over each model's q(f*) with its own likelihood (the
GLMs: ``-log p(y | β̂)``); ``rmse``: of the predictive mean count. ``time_s``: training seconds (evaluations every
``--every`` steps excluded); ``time_to_peer_s``: training seconds to the peer's final test NLPD.

``--quick``: split 0, M = 8, 20 steps, GLMs at most 20 L-BFGS iterations.
"""
from __future__ import annotations

import argparse
import math

import _gpytorch as gpt
import _realdata as rd
import pyro.distributions as dist
import torch
from _common import parser, table, write_json
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import load_nmes1988, standardize

LR, NGD_LR = 0.01, 0.1


Task = rd.Task


def load_task(split: int, M: int, seed: int = 0) -> Task:
    s = load_nmes1988(split=split)
    X, Xt, _, _ = standardize(s.X_train, s.X_test)
    return Task("nmes1988", split, X, s.y_train, Xt, s.y_test, rd.inducing_subset(X, M, seed + split))


# -- GLMs -----------------------------------------------------------------------------------------------------------
def glm_distribution(eta, log_alpha=None, nb1: bool = False):
    """Poisson(exp(eta)), or NB2 with mean exp(eta) and variance mu + alpha mu^2 (total count 1/alpha), or (``nb1``)
    NB1 with variance mu (1 + alpha) (total count mu / alpha, logits log alpha)."""
    if log_alpha is None:
        return torch.distributions.Poisson(eta.exp())
    if nb1:
        return torch.distributions.NegativeBinomial(total_count=(eta - log_alpha).exp(),
                                                    logits=log_alpha.expand(eta.shape))
    r = (-log_alpha).exp()
    return torch.distributions.NegativeBinomial(total_count=r, logits=eta - r.log())


def run_glm(task: Task, cfg, negbin: bool, nb1: bool = False) -> rd.Trace:
    X1, Xt1 = (torch.cat([torch.ones(len(A), 1), A], 1) for A in (task.X, task.Xt))
    beta = torch.zeros(X1.shape[1])
    beta[0] = task.y.mean().log()
    beta.requires_grad_(True)
    params = [beta] + ([torch.zeros((), requires_grad=True)] if negbin else [])

    def evaluate():
        d = glm_distribution(Xt1 @ beta, *params[1:], nb1=nb1)
        return {"test_nlpd": -d.log_prob(task.yt).mean().item(), "rmse": (d.mean - task.yt).pow(2).mean().sqrt().item()}

    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=1, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -glm_distribution(X1 @ beta, *params[1:], nb1=nb1).log_prob(task.y).mean()
        loss.backward()
        return loss

    trace, prev = rd.Trace(evaluate, 1), math.inf
    for it in range(cfg.glm_iters):
        loss = opt.step(closure).item()
        done = abs(prev - loss) < 1e-12 * max(1.0, abs(loss)) or it == cfg.glm_iters - 1
        trace.tick(final=done)
        if done:
            break
        prev = loss
    return trace


# -- GPyTorch -------------------------------------------------------------------------------------------------------
def run_gpytorch(task: Task, cfg, negbin: bool, ngd: bool = False) -> rd.Trace:
    import gpytorch

    lik = gpytorch.likelihoods.NegativeBinomialLikelihood() if negbin else gpytorch.likelihoods.PoissonLikelihood()
    model = gpt.approximate_gp(task.Z, mean=cfg.mean, distribution="natural" if ngd else "cholesky",
                               lengthscale=1.0, outputscale=1.0)
    with torch.no_grad():  # softplus^-1 of the mean count: the prior mean's rate is the training mean
        model.mean_module.initialize(**{"constant" if cfg.mean == "constant" else "bias":
                                        task.y.mean().expm1().log()})
    opts = gpt.optimizers(model, lik, len(task.X), LR, NGD_LR if ngd else None)

    def evaluate():
        def go():
            f = model(task.Xt)
            lp, mean = rd.predictive(lik.forward, task.yt, f.mean, f.variance)
            return {"test_nlpd": -lp.mean().item(), "rmse": (mean - task.yt).pow(2).mean().sqrt().item()}

        return gpt.evaluate(model, lik, go)

    return gpt.train(model, lik, task.X, task.y, cfg.steps, cfg.batch, rd.Trace(evaluate, cfg.every), opts,
                     seed=cfg.seed)


# -- ours (hooks: ps.Poisson and ps.NegativeBinomial come from the likelihood branches) ------------------------------
def run_ours(task: Task, cfg, likelihood, link: str = "log") -> rd.Trace:
    from pyro.contrib.gp.kernels import RBF

    from pyro_sparsegp.mean_functions import Constant, Linear

    D, Q = task.X.shape[1], likelihood.latent_dim
    m = task.y.mean()  # the prior mean starts at the link's inverse of the mean count (a second latent: at 0)
    start = torch.zeros(Q)
    start[0] = m.log() if link == "log" else m.expm1().log()
    mean_fn = Constant(Q, start) if cfg.mean == "constant" else Linear(D, Q, b=start)
    gp = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), task.Z.clone(), likelihood, mean_function=mean_fn)

    def evaluate():
        mean, var = gp.predict(task.Xt)
        if Q == 2:  # [T, 2] marginals of the log mean and the log dispersion, the distribution's f [T, 2, n]
            lp, pmean = rd.predictive2(gp.likelihood.distribution, task.yt, mean, var)
        else:
            lp, pmean = rd.predictive(gp.likelihood.distribution, task.yt, mean, var)
        return {"test_nlpd": -lp.mean().item(), "rmse": (pmean - task.yt).pow(2).mean().sqrt().item()}

    return rd.ours_fit(gp, task.X, task.y, cfg.steps, cfg.batch, rd.Trace(evaluate, cfg.every), lr=LR)


class SoftplusNB1(PyroModule):
    """GPyTorch's ``NegativeBinomialLikelihood`` written for ``ps.likelihoods.from_distribution`` (the documented
    route to a likelihood of one's own): mean ``softplus(f)``, variance ``mean (1 + alpha)`` (NB1), ``alpha`` a
    positive ``PyroParam`` started at 1 (GPyTorch's p = 1/2). ``f`` ``[..., B]``."""

    def __init__(self):
        super().__init__()
        self.dispersion = PyroParam(torch.tensor(1.0), constraints.positive)

    def forward(self, f):
        alpha = self.dispersion
        return dist.NegativeBinomial(torch.nn.functional.softplus(f) / alpha, logits=alpha.log().expand(f.shape))


def softplus_nb1():
    return ps.likelihoods.from_distribution(SoftplusNB1(), support=constraints.nonnegative_integer)


METHODS = {
    "glm_poisson": rd.Method(lambda t, c: run_glm(t, c, False), "torch", peer="gpytorch_poisson_ngd"),
    "glm_negbin": rd.Method(lambda t, c: run_glm(t, c, True), "torch", peer="gpytorch_negbin_ngd"),
    "glm_negbin1": rd.Method(lambda t, c: run_glm(t, c, True, nb1=True), "torch", peer="gpytorch_negbin_ngd"),
    "gpytorch_poisson": rd.Method(lambda t, c: run_gpytorch(t, c, False), "gpytorch", peer="gpytorch_poisson_ngd"),
    "gpytorch_poisson_ngd": rd.Method(lambda t, c: run_gpytorch(t, c, False, ngd=True), "gpytorch"),
    "gpytorch_negbin": rd.Method(lambda t, c: run_gpytorch(t, c, True), "gpytorch", peer="gpytorch_negbin_ngd"),
    "gpytorch_negbin_ngd": rd.Method(lambda t, c: run_gpytorch(t, c, True, ngd=True), "gpytorch"),
    "ours_poisson": rd.Method(lambda t, c: run_ours(t, c, ps.Poisson()), "pyro_sparsegp", peer="gpytorch_poisson_ngd"),
    "ours_negbin": rd.Method(lambda t, c: run_ours(t, c, ps.NegativeBinomial()), "pyro_sparsegp",
                             peer="gpytorch_negbin_ngd"),
    "ours_negbin1": rd.Method(lambda t, c: run_ours(t, c, ps.NegativeBinomial(variance="NB1")), "pyro_sparsegp",
                              peer="gpytorch_negbin_ngd"),
    "ours_negbin_het": rd.Method(lambda t, c: run_ours(t, c, ps.HeteroscedasticNegativeBinomial(variance="NB1")),
                                 "pyro_sparsegp", peer="gpytorch_negbin_ngd"),
    "ours_negbin1_softplus": rd.Method(lambda t, c: run_ours(t, c, softplus_nb1(), link="softplus"), "pyro_sparsegp",
                                       peer="gpytorch_negbin_ngd"),
}

# time to the peer: from when a run stays within REACH_TOL nats of the peer's final NLPD
# (counts: a split's evaluations wander by ~0.0005)
REACH_TOL = 0.002
DONE_WHEN = [  # issue 47: (label, a, b[, options]) for _realdata.condition
    ("NB vs Poisson", "ours_negbin", "ours_poisson"),
    ("NB1 vs Poisson", "ours_negbin1", "ours_poisson"),
    ("NB vs its GLM", "ours_negbin", "glm_negbin", {"rule": "no_worse"}),
    ("NB1 vs its GLM", "ours_negbin1", "glm_negbin1", {"rule": "no_worse"}),
    ("softplus-NB1 vs the NB1 GLM", "ours_negbin1_softplus", "glm_negbin1", {"rule": "no_worse"}),
    ("NB vs GPyTorch NB (NGD)", "ours_negbin", "gpytorch_negbin_ngd", {"timed": True}),
    ("NB1 vs GPyTorch NB (NGD)", "ours_negbin1", "gpytorch_negbin_ngd", {"timed": True}),
    ("heteroscedastic NB1 vs GPyTorch NB (NGD)", "ours_negbin_het", "gpytorch_negbin_ngd", {"timed": True}),
    ("heteroscedastic NB1 vs GPyTorch NB (Adam)", "ours_negbin_het", "gpytorch_negbin", {"timed": True}),
    ("heteroscedastic NB1 vs NB1", "ours_negbin_het", "ours_negbin1"),
    ("GPyTorch's NB model, ours vs GPyTorch (NGD)", "ours_negbin1_softplus", "gpytorch_negbin_ngd", {"timed": True}),
    ("GPyTorch's NB model, ours vs GPyTorch (Adam)", "ours_negbin1_softplus", "gpytorch_negbin", {"timed": True}),
    ("Poisson vs GPyTorch Poisson (NGD)", "ours_poisson", "gpytorch_poisson_ngd", {"timed": True}),
]


def config(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--splits", default=None, help="splits of load_nmes1988, e.g. 0-9 (default) or 0,3")
    p.add_argument("--steps", type=int, default=None, help="training steps of every GP (default 2000)")
    p.add_argument("--M", type=int, default=None, help="inducing points (default 64)")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--every", type=int, default=None, help="steps between test evaluations (default 50)")
    p.add_argument("--glm-iters", type=int, default=None, help="L-BFGS iterations at most (default 200)")
    p.add_argument("--mean", choices=["constant", "linear"], default="constant", help="the GPs' prior mean")
    rd.add_method_arguments(p, METHODS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.splits = rd.parse_splits(a.splits or ("0" if a.quick else "0-9"))
    a.steps = a.steps or (20 if a.quick else 2000)
    a.M = a.M or (8 if a.quick else 64)
    a.every = a.every or (10 if a.quick else 50)
    a.glm_iters = a.glm_iters or (20 if a.quick else 200)
    return rd.parse_methods(p, a, METHODS)


def main(argv=None) -> list[dict]:
    cfg = config(argv)
    rows = rd.begin(cfg, REACH_TOL)
    for split in [] if cfg.summarize else cfg.splits:
        task = load_task(split, cfg.M, cfg.seed)
        print(f"# nmes1988 split {split}: {len(task.X)} train / {len(task.Xt)} test, D = {task.X.shape[1]}, "
              f"M = {len(task.Z)}, {cfg.steps} steps of {min(cfg.batch, len(task.X))}", flush=True)
        runs = rd.run_methods(METHODS, cfg.methods, task, cfg)
        rows += rd.split_rows(runs, METHODS, {"dataset": "nmes1988", "split": split, "M": len(task.Z)}, REACH_TOL)
        write_json(cfg.json, rows) if cfg.json else None
    print("\nNMES 1988 visits, per split (test NLPD per count; time_to_peer_s: training seconds to the peer's final "
          f"test NLPD, from which the run stays within {REACH_TOL} nats of it):")
    print(table(rows, ["split", "method", "library", "test_nlpd", "rmse", "time_s", "time_to_peer_s", "steps",
                       "peer"]))
    print("\nMean over splits (se: standard error; reached: splits on which the run "
          f"settled within {REACH_TOL} nats of the peer's final NLPD):")
    print(table(rd.summarize(rows), ["method", "library", "splits", "test_nlpd", "test_nlpd_se", "rmse", "time_s",
                                  "reached", "time_to_peer_s"]))
    checks = rd.conditions(rows, DONE_WHEN, REACH_TOL)
    write_json(cfg.json, rows + checks)
    return rows


if __name__ == "__main__":
    main()
