"""Time to reach a target test negative log predictive density (NLPD) on binary data: the Pólya-Gamma augmented
logit GP with closed-form natural-gradient steps (Wenzel et al. 2019) against our SVGP with the logit likelihood
trained by Adam on the Gauss-Hermite bound, and GPyTorch's SVGP (BernoulliLikelihood, which is probit) by Adam.

    python benchmarks/pg_speed.py [--quick] [--json PATH]

Same M, same minibatches, same Adam learning rate for the hyperparameters and inducing points. The target is the
worst of the three methods' final NLPDs (so every method reaches it); the clock runs only during training steps.
"""
from __future__ import annotations

import warnings

import gpytorch
import numpy as np
import pyro
import torch
from _classification_data import load_binary, stratified_split
from _common import batches, parser, setup, table, train_trace, write_json
from _gpytorch import approximate_gp, optimizers
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps


def ours(kind, X, y, Xt, yt, Z, idx, every, lr, rho):
    pyro.clear_param_store()
    D = X.shape[1]
    lik = ps.PolyaGammaLogit() if kind == "pg_natgrad" else ps.Bernoulli("logit")
    gp = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), Z.clone(), lik, whiten=True)
    nat = kind == "pg_natgrad"
    params = [p for n, p in gp.named_parameters() if not (nat and n.startswith("q_u."))]
    opt = torch.optim.Adam(params, lr=lr)

    def step(i):
        opt.zero_grad()
        (-gp.analytic_elbo(X[i], y[i], num_data=len(X))).backward()
        opt.step()
        if nat:
            ps.infer.natgrad.polya_gamma_natgrad_step(gp, X[i], y[i], lr=rho, num_data=len(X))

    def evaluate():
        mean, var = gp.predict(Xt)
        return -ps.Bernoulli("logit", num_gh=40).predictive_log_prob(yt, mean, var).mean().item()

    return train_trace(step, evaluate, idx, every)


def gpyt(X, y, Xt, yt, Z, idx, every, lr):
    model = approximate_gp(Z.clone(), lengthscale=1.0)
    lik = gpytorch.likelihoods.BernoulliLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(X))
    (opt,) = optimizers(model, lik, len(X), lr=lr)

    def step(i):
        model.train()
        lik.train()
        opt.zero_grad()
        (-mll(model(X[i]), y[i])).backward()
        opt.step()

    def evaluate():
        model.eval()
        lik.eval()
        with torch.no_grad():
            p = lik(model(Xt)).probs.clamp(1e-12, 1 - 1e-12)
        return -(yt * p.log() + (1 - yt) * (1 - p).log()).mean().item()

    return train_trace(step, evaluate, idx, every)


def reach(trace, target):
    for s, clock, v in trace:
        if v <= target:
            return clock, s
    return float("nan"), -1


def main():
    p = parser(__doc__)
    p.add_argument("--M", type=int, default=64)
    args = p.parse_args()
    setup(args)
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    datasets = ["banana"] if args.quick else ["banana", "twonorm", "ringnorm"]
    steps = 300 if args.quick else 1500
    B, lr, rho, every = 500, 0.01, 0.5, 10
    rows = []
    for name in datasets:
        Xn, yn = load_binary(name)
        tr, te = stratified_split(yn, 0.8, np.random.default_rng(0))
        mu, sd = Xn[tr].mean(0), Xn[tr].std(0) + 1e-12
        X, Xt = torch.tensor((Xn[tr] - mu) / sd), torch.tensor((Xn[te] - mu) / sd)
        y, yt = torch.tensor(yn[tr]), torch.tensor(yn[te])
        torch.manual_seed(0)
        Z = X[torch.randperm(len(X))[: args.M]].clone()
        idx = batches(len(X), B, steps)
        traces = {
            "pg_natgrad": ours("pg_natgrad", X, y, Xt, yt, Z, idx, every, lr, rho),
            "ours_logit_adam": ours("logit", X, y, Xt, yt, Z, idx, every, lr, rho),
            "gpytorch_adam": gpyt(X, y, Xt, yt, Z, idx, every, lr),
        }
        target = max(tr_[-1][2] for tr_ in traces.values())
        t_pg, _ = reach(traces["pg_natgrad"], target)
        for kind, tr_ in traces.items():
            secs, step_ = reach(tr_, target)
            rows.append({"dataset": name, "model": kind, "M": args.M, "batch": B, "steps": steps,
                         "final_nlpd": tr_[-1][2], "target_nlpd": target, "reach_s": secs, "reach_step": step_,
                         "train_s": tr_[-1][1], "ratio_vs_pg": secs / t_pg})
        print(table(rows[-3:], list(rows[-1])), flush=True)
    print("\nreach_s: training seconds to the target NLPD (the worst final NLPD of the three); ratio_vs_pg = "
          "reach_s / that of the Pólya-Gamma natural-gradient fit (the paper reports up to ~100x)")
    print(table(rows, ["dataset", "model", "final_nlpd", "target_nlpd", "reach_s", "reach_step", "ratio_vs_pg"]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
