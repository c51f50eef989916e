"""Wall time per SVGP training step (forward, backward, Adam step) of pyro_sparsegp against GPyTorch's SVGP
(VariationalStrategy and LargeBatchVariationalStrategy) and Pyro's own VariationalSparseGP(whiten=True), at the
same M, batch 1024, D = 8 and dtype, measured alternately in one run; plus the floor set by the dense operations a
step cannot avoid.

    python benchmarks/svgp_speed.py [--quick] [--json PATH]

Our rows: ``ours_f`` (the sampled f site, the DESIGN's site contract), ``ours_int`` (f integrated out given u),
``ours_an`` (closed-form bound, ``fit(elbo="analytic")``: the same quantity GPyTorch computes). All whitened, one
particle, TraceMeanField_ELBO (analytic KL).
"""
from __future__ import annotations

import warnings

import gpytorch
import pyro
import pyro.contrib.gp as pgp
import torch
from _common import gpytorch_svgp, parser, setup, table, time_alternating, write_json
from pyro.contrib.gp.kernels import RBF
from pyro.infer import TraceMeanField_ELBO

import pyro_sparsegp as ps

N, B, D = 10_000, 1024, 8


def ours(X, y, M, mode):
    pyro.clear_param_store()
    gp = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), torch.randn(M, D), ps.Gaussian(0.1), integrate_f=(mode == "int"))
    opt = torch.optim.Adam(gp.parameters(), lr=0.01)
    elbo = TraceMeanField_ELBO()

    def step():
        opt.zero_grad()
        if mode == "an":
            loss = -gp.analytic_elbo(X, y, num_data=N)
        else:
            loss = elbo.differentiable_loss(gp.model, gp.guide, X, y, num_data=N)
        loss.backward()
        opt.step()

    return step


def gpytorch_step(X, y, M, strategy):
    model = gpytorch_svgp(torch.randn(M, D), strategy)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.01)
    model.train()
    lik.train()

    def step():
        opt.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        opt.step()

    return step


def pyro_vsgp_step(X, y, M):
    pyro.clear_param_store()
    vsgp = pgp.models.VariationalSparseGP(
        X, y, pgp.kernels.RBF(D, lengthscale=torch.ones(D)), torch.randn(M, D), pgp.likelihoods.Gaussian(),
        whiten=True, num_data=N,
    )
    opt = torch.optim.Adam(vsgp.parameters(), lr=0.01)
    loss_fn = TraceMeanField_ELBO().differentiable_loss

    def step():
        opt.zero_grad()
        loss = loss_fn(vsgp.model, vsgp.guide)
        loss.backward()
        opt.step()

    return step


def floor_step(M, dtype):
    """Cholesky of Kuu, the solve Luu^{-1} Kuf and the product with S^{1/2}, forward and backward."""
    A = torch.randn(M, M)
    Kuu = (A @ A.mT / M + torch.eye(M)).requires_grad_(True)
    Kuf = torch.randn(M, B).requires_grad_(True)
    Ls = torch.tril(torch.randn(M, M) / M**0.5).requires_grad_(True)

    def step():
        L = torch.linalg.cholesky(Kuu)
        W = torch.linalg.solve_triangular(L, Kuf, upper=False)
        (W.pow(2).sum() + (Ls.mT @ W).pow(2).sum()).backward()

    return step


def main():
    args = parser(__doc__).parse_args()
    setup(args)
    warnings.filterwarnings("ignore")
    sizes = [128, 512] if args.quick else [128, 512, 1024]
    dtypes = [torch.float64, torch.float32]
    rows = []
    for dtype in dtypes:
        torch.set_default_dtype(dtype)
        for M in sizes:
            torch.manual_seed(0)
            X, y = torch.randn(B, D), torch.randn(B)
            repeats = (3 if M >= 1024 else 5) if args.quick else (7 if M >= 1024 else 15)
            fns = {
                "ours_f": ours(X, y, M, "f"),
                "ours_int": ours(X, y, M, "int"),
                "ours_an": ours(X, y, M, "an"),
                "gpyt_vs": gpytorch_step(X, y, M, gpytorch.variational.VariationalStrategy),
                "gpyt_lb": gpytorch_step(X, y, M, gpytorch.variational.LargeBatchVariationalStrategy),
                "pyro_vsgp": pyro_vsgp_step(X, y, M),
                "floor": floor_step(M, dtype),
            }
            t = time_alternating(fns, repeats)
            peer = min(t["gpyt_vs"], t["gpyt_lb"])
            ours_best = min(t["ours_f"], t["ours_int"], t["ours_an"])
            row = {"M": M, "batch": B, "D": D, "dtype": str(dtype).split(".")[-1]}
            row.update({f"{k}_ms": v for k, v in t.items()})
            row.update(
                ours_ms=t["ours_f"],
                peer_ms=peer,
                ratio=t["ours_f"] / peer,
                ratio_int=t["ours_int"] / peer,
                ratio_best=ours_best / peer,
                ratio_vs_pyro=t["ours_f"] / t["pyro_vsgp"],
                ratio_floor=t["ours_f"] / t["floor"],
            )
            rows.append(row)
            print(table([row], list(row)), flush=True)
    print("\nratio = ours_f / fastest GPyTorch strategy (target <= 0.8 at M >= 512, <= 1.0 at M = 128);")
    print("ratio_int / ratio_best: the integrated-f and best of our three paths; ratio_floor = ours_f / floor\n")
    cols = ["dtype", "M", "ours_f_ms", "ours_int_ms", "ours_an_ms", "gpyt_vs_ms", "gpyt_lb_ms", "pyro_vsgp_ms",
            "floor_ms", "ratio", "ratio_int", "ratio_vs_pyro", "ratio_floor"]
    print(table(rows, cols))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
