"""GPLVM on Fashion-MNIST (issue 54, item 3): held-out reconstruction and time of ``ps.GPLVM`` (per-point and
amortised guides, minibatches) against probabilistic PCA and GPyTorch's ``BayesianGPLVM``, and a memory-flat-in-N
check.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/gplvm.py --threads 1 --json benchmarks/records/gplvm.json

Data: the 60,000 Fashion-MNIST training images (Xiao, Rasul, Vollgraf 2017; ``/work/shared/data/fashion_mnist``)
pooled 2x2 to 14x14 = 196 pixels (to keep a run within minutes on one thread), scaled to [0, 1], centred per pixel
and divided by one global sd. Test: ``--n-test`` images of the test set; in each, a random half of the pixels is
hidden; every method infers the latent point from the visible half and predicts the hidden half: RMSE (in the
standardised units) and NLPD per hidden pixel (Gaussian, with the predictive mean and variance), each method with the
same ``Q`` latent dimensions.

* ``ppca``: probabilistic PCA (Tipping and Bishop 1999, closed-form maximum likelihood), the posterior of ``x`` given
  the visible pixels, then the hidden pixels' Gaussian.
* ``gplvm``: ``ps.GPLVM`` with the per-point guide (latent means started at PCA), ``fit`` on minibatches of rows;
  ``reconstruct`` (``infer_latent`` from the best candidate point, then Adam steps).
* ``gplvm_encoder``: the amortised guide (an MLP encoder), same training; ``reconstruct`` with the encoder's
  ``q(x*)`` refined (``_enc0``: the encoder's ``q(x*)`` alone, no refinement).
* ``gpytorch``: ``gpytorch.models.gplvm.BayesianGPLVM`` as in GPyTorch's example (``VariationalLatentVariable``,
  inducing inputs ``[D, M, Q]`` per output, a ``D``-batch of ``q(u)``, ``GaussianLikelihood(batch_shape=[D])``,
  minibatches of rows, Adam); it has no inference of ``x*`` for new rows, so ``q(x*)`` of the test rows is optimised
  by hand with the model frozen (as a user would: Adam on the visible pixels' expected log-likelihood minus the KL).
* memory: ``fit`` of the amortised and per-point GPLVM on ``N`` = 15,000 and ``4N`` = 60,000 rows (in a fresh
  subprocess each), the peak resident memory over steps 2-20 above the memory after step 1 (``VmHWM`` reset through
  ``/proc/self/clear_refs`` from ``fit``'s callback; tensors in ``mmap``'d blocks, so that freed memory leaves the
  resident set). Before its first step ``fit`` checks the whole data set once (``NaN`` and finiteness checks:
  temporaries of the size of ``Y``, ``O(N D)``), as it does for every layer; the steps themselves are flat in ``N``
  (the per-point guide's ``[N, Q]`` parameters, their gradient and Adam's moments are ``O(N Q)``: 1.2 MB each at
  ``N`` = 60,000, ``Q`` = 5, float32).

Wall time of the full run: 12 minutes on one thread of a shared 2-core machine (``fit_s`` and ``infer_s`` of each
row of ``benchmarks/records/gplvm.json``); ``--quick`` (5,000 rows, 100 steps): about 2 minutes. Recorded (Q = 5,
M = 32, 1,000 steps of 256 rows, 500 test images): hidden-pixel RMSE / NLPD ppca 0.564 / 0.842, gplvm 0.467 / 0.652,
gplvm_encoder 0.477 / 0.679 (encoder alone 0.509 / 0.738), gpytorch 0.611 / 0.869; fit 128 s, 139 s and 214 s;
peak memory over the steps at 4N over N: 1.00 (encoder), 1.04 (per point).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import parser, setup, table, write_json

DATA = Path("/work/shared/data/fashion_mnist")
ROOT = Path(__file__).resolve().parents[1]


def load_images(kind: str) -> torch.Tensor:
    with gzip.open(DATA / f"{kind}-images-idx3-ubyte.gz") as fh:
        raw = np.frombuffer(fh.read(), np.uint8, offset=16)
    img = torch.from_numpy(raw.reshape(-1, 1, 28, 28).astype(np.float32)) / 255.0
    return torch.nn.functional.avg_pool2d(img, 2).reshape(len(img), -1)  # [n, 196]


def load(n_train: int, n_test: int, seed: int = 0):
    train, test = load_images("train")[:n_train], load_images("t10k")[:n_test]
    mean = train.mean(0)
    sd = (train - mean).std()
    Y, Yt = ((train - mean) / sd), ((test - mean) / sd)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.rand(Yt.shape, generator=g).argsort(-1) < Yt.shape[-1] // 2  # a random half of each row
    dt = torch.get_default_dtype()
    return Y.to(dt), Yt.to(dt), hidden


def scores(mean, var, Yt, hidden) -> dict:
    err = (mean - Yt)[hidden]
    nlpd = 0.5 * (math.log(2 * math.pi) + var[hidden].log() + err.pow(2) / var[hidden])
    return {"rmse": err.pow(2).mean().sqrt().item(), "nlpd": nlpd.mean().item()}


# -- probabilistic PCA ---------------------------------------------------------------------------------------------
def ppca(Y, Yt, hidden, Q):
    t0 = time.perf_counter()
    mu = Y.mean(0)
    evals, evecs = torch.linalg.eigh(torch.cov((Y - mu).T))
    evals, evecs = evals.flip(0), evecs.flip(1)
    s2 = evals[Q:].mean()
    W = evecs[:, :Q] * (evals[:Q] - s2).clamp_min(0).sqrt()  # [D, Q]
    fit_s = time.perf_counter() - t0
    means, variances = [], []
    for y, h in zip(Yt, hidden, strict=True):
        Wo, Wh = W[~h], W[h]
        S = torch.linalg.inv(torch.eye(Q) + Wo.T @ Wo / s2)
        m = S @ Wo.T @ (y[~h] - mu[~h]) / s2
        mean, var = mu.clone(), torch.full_like(mu, s2)
        mean[h] = mu[h] + Wh @ m
        var[h] = (Wh @ S * Wh).sum(-1) + s2
        means.append(mean)
        variances.append(var)
    return torch.stack(means), torch.stack(variances), fit_s, time.perf_counter() - t0 - fit_s


# -- ours ----------------------------------------------------------------------------------------------------------
def ours(Y, Yt, hidden, Q, M, steps, batch, encoder: bool, infer_steps: int):
    import pyro_sparsegp as ps
    from pyro_sparsegp.layers.gplvm import mlp_encoder, pca_init

    torch.manual_seed(0)
    N, D = Y.shape
    X_init = pca_init(Y, Q)
    Z = X_init[torch.randperm(N)[:M]].clone()
    if encoder:
        g = ps.GPLVM(D, Q, num_inducing=M, Z=Z, encoder=mlp_encoder(D, Q, hidden=(256,)), name="enc")
    else:
        g = ps.GPLVM(D, Q, num_inducing=M, Z=Z, num_data=N, X_init=X_init, name="pp")
    t0 = time.perf_counter()
    state = ps.infer.fit(g, torch.arange(N).unsqueeze(-1), Y, num_steps=steps, batch_size=batch, lr=0.01,
                         progress=False)
    fit_s = time.perf_counter() - t0
    Yv = Yt.masked_fill(hidden, float("nan"))
    out = {}
    for k in ([0, infer_steps] if encoder else [infer_steps]):
        t0 = time.perf_counter()
        torch.manual_seed(1)
        mean, var = g.reconstruct(Yv, steps=k, lr=0.05)
        out[k] = (mean, var, time.perf_counter() - t0)
    return out, fit_s, -state.losses[-1] / N


# -- GPyTorch's BayesianGPLVM (its example's recipe) ---------------------------------------------------------------
def gpytorch_gplvm(Y, Yt, hidden, Q, M, steps, batch, infer_steps):
    import gpytorch
    from gpytorch.likelihoods import GaussianLikelihood
    from gpytorch.means import ZeroMean
    from gpytorch.models.gplvm import BayesianGPLVM, VariationalLatentVariable
    from gpytorch.priors import NormalPrior
    from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy

    from pyro_sparsegp.layers.gplvm import pca_init

    torch.manual_seed(0)
    N, D = Y.shape

    class Model(BayesianGPLVM):
        def __init__(self):
            X_init = pca_init(Y, Q)
            Zi = X_init[torch.randperm(N)[:M]].clone().expand(D, M, Q).contiguous()
            q_u = CholeskyVariationalDistribution(M, batch_shape=torch.Size([D]))
            q_f = VariationalStrategy(self, Zi, q_u, learn_inducing_locations=True)
            prior_x = NormalPrior(torch.zeros(N, Q), torch.ones(N, Q))
            X = VariationalLatentVariable(N, D, Q, torch.nn.Parameter(X_init.clone()), prior_x)
            super().__init__(X, q_f)
            self.mean_module = ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=Q))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model, lik = Model(), GaussianLikelihood(batch_shape=torch.Size([D]))
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = torch.optim.Adam([{"params": model.parameters()}, {"params": lik.parameters()}], lr=0.01)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    model.train(), lik.train()
    for _ in range(steps):
        idx = torch.randperm(N, generator=gen)[:batch]
        opt.zero_grad()
        x = model.sample_latent_variable()  # all N latents, as the example does
        loss = -mll(model(x[idx]), Y[idx].T).sum()
        loss.backward()
        opt.step()
    fit_s = time.perf_counter() - t0
    # q(x*) by hand, the model frozen
    t0 = time.perf_counter()
    for p in list(model.parameters()) + list(lik.parameters()):
        p.requires_grad_(False)
    noise = lik.noise.squeeze(-1)  # [D]
    obs = (~hidden).T  # [D, n]
    yv = Yt.T  # [D, n]
    with torch.no_grad():  # the start: the prior mean
        loc = torch.zeros(len(Yt), Q)
    loc.requires_grad_(True)
    log_s = torch.full((len(Yt), Q), math.log(0.1), requires_grad=True)
    xopt = torch.optim.Adam([loc, log_s], lr=0.05)
    with gpytorch.settings.cholesky_jitter(1e-4):
        for _ in range(infer_steps):
            xopt.zero_grad()
            x = loc + log_s.exp() * torch.randn_like(loc)
            f = model(x)
            m, v = f.mean, f.variance  # [D, n]
            ell = -0.5 * (torch.log(2 * math.pi * noise).unsqueeze(-1) + ((yv - m) ** 2 + v) / noise.unsqueeze(-1))
            kl = (0.5 * (loc**2 + log_s.exp() ** 2 - 1) - log_s).sum()
            (-(ell * obs).sum() + kl).backward()
            xopt.step()
        with torch.no_grad():  # (train mode throughout: eval mode caches terms whose graph a second backward needs)
            S = 32
            xs = loc + log_s.exp() * torch.randn(S, *loc.shape)
            f = model(xs.reshape(-1, Q))
            m, v = f.mean.unflatten(-1, (S, -1)), f.variance.unflatten(-1, (S, -1))  # [D, S, n]
            mean = m.mean(-2)
            var = (v + m**2).mean(-2) - mean**2 + noise.unsqueeze(-1)
    return mean.T, var.T, fit_s, time.perf_counter() - t0


# -- memory flat in N ----------------------------------------------------------------------------------------------
CHILD = r"""
import json, sys, torch, pyro
torch.set_num_threads(1); torch.set_default_dtype(torch.float32)
pyro.settings.set(module_local_params=True)
sys.path.insert(0, sys.argv[4])
import pyro_sparsegp as ps
from pyro_sparsegp.layers.gplvm import mlp_encoder
from gplvm import load
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
N, encoder, steps = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
Y, _, _ = load(60000, 1)
Y = Y.repeat(N // 60000 + 1, 1)[:N] if N > 60000 else Y[:N]
D, Q = Y.shape[1], 5
g = (ps.GPLVM(D, Q, num_inducing=32, encoder=mlp_encoder(D, Q, hidden=(256,))) if encoder
     else ps.GPLVM(D, Q, num_inducing=32, num_data=N))
at = {}
def reset(step, loss):  # after the first step: the peak over the steps from then on (not fit's checks of the data)
    if step == 1:
        open("/proc/self/clear_refs", "w").write("5")
        at["before"] = rss("VmRSS:")
ps.infer.fit(g, torch.arange(N).unsqueeze(-1), Y, num_steps=steps, batch_size=256, progress=False, callback=reset)
peak = rss("VmHWM:")
print(json.dumps({"N": N, "before_mb": at["before"], "peak_mb": peak, "step_mb": peak - at["before"]}))
"""


def memory_rows(N: int, steps: int) -> list:
    rows = []
    for encoder in (True, False):
        for n in (N, 4 * N):
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), "1" if encoder else "0", str(steps),
                                  str(Path(__file__).parent)], capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                      # tensors in mmap'd blocks, returned at once: RSS follows live memory
                                      "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"})
            if out.returncode:
                raise RuntimeError(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"method": "memory_" + ("encoder" if encoder else "per_point"), **r})
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--n-train", type=int, default=60000)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--Q", type=int, default=5)
    p.add_argument("--M", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--infer-steps", type=int, default=100)
    p.add_argument("--only", default="ppca,gplvm,gplvm_encoder,gpytorch,memory")
    args = p.parse_args()
    if args.quick:
        args.n_train, args.n_test, args.steps, args.infer_steps = 5000, 100, 100, 20
    setup(args)
    torch.set_default_dtype(torch.float32)
    only = args.only.split(",")
    Y, Yt, hidden = load(args.n_train, args.n_test)
    print(f"# Fashion-MNIST 14x14: train {tuple(Y.shape)}, test {tuple(Yt.shape)}, half of each test row hidden; "
          f"Q={args.Q}, M={args.M}, {args.steps} steps of {args.batch} rows")
    rows = []
    base = {"N": len(Y), "D": Y.shape[1], "Q": args.Q, "M": args.M, "steps": args.steps, "batch": args.batch}
    if "ppca" in only:
        m, v, fs, ps_ = ppca(Y, Yt, hidden, args.Q)
        rows.append({"method": "ppca", **base, **scores(m, v, Yt, hidden), "fit_s": fs, "infer_s": ps_})
    for name, enc in (("gplvm", False), ("gplvm_encoder", True)):
        if name in only:
            out, fs, bound = ours(Y, Yt, hidden, args.Q, args.M, args.steps, args.batch, enc, args.infer_steps)
            for k, (m, v, s) in out.items():
                label = name if k else name + "_enc0"
                rows.append({"method": label, **base, **scores(m, v, Yt, hidden), "fit_s": fs, "infer_s": s,
                             "infer_steps": k, "bound_per_row": bound})
    if "gpytorch" in only:
        m, v, fs, s = gpytorch_gplvm(Y, Yt, hidden, args.Q, args.M, args.steps, args.batch, args.infer_steps)
        rows.append({"method": "gpytorch", **base, **scores(m, v, Yt, hidden), "fit_s": fs, "infer_s": s,
                     "infer_steps": args.infer_steps})
    ref = next((r for r in rows if r["method"] == "ppca"), None)
    for r in rows:
        if ref is not None:
            r["rmse_vs_ppca"] = r["rmse"] / ref["rmse"]
    print(table(rows, ["method", "rmse", "nlpd", "rmse_vs_ppca", "fit_s", "infer_s"]))
    if "memory" in only:
        mem = memory_rows(15000 if not args.quick else 2000, 20)
        for r in mem:
            first = next(x for x in mem if x["method"] == r["method"])
            r["ratio"] = r["step_mb"] / first["step_mb"]
        print(table(mem, ["method", "N", "before_mb", "peak_mb", "step_mb", "ratio"]))
        rows += mem
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
