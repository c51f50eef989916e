"""Time per training step of SVGP(M), SOLVE-GP(M + M) and SVGP(2M) (Shi, Titsias, Mnih 2020), batch 1024, D = 8,
measured alternately in one run, beside GPyTorch's OrthogonallyDecoupledVariationalStrategy (M covariance + M mean
inducing points); and the cubic-cost operations one of our steps performs, beside table 4 of the paper.

    python benchmarks/solvegp_speed.py [--quick] [--json PATH]

Our models train with TraceMeanField_ELBO on the site contract (sampled u, v, f; whitened, one particle) and,
in the ``*_an`` columns, on the closed-form bound of algorithm 1 (``analytic_elbo``), which needs the products
with the variational scales that the sampled path avoids.
"""
from __future__ import annotations

import warnings
from unittest import mock

import gpytorch
import pyro
import torch
from _common import gpytorch_svgp, parser, setup, table, time_alternating, write_json
from pyro.contrib.gp.kernels import RBF
from pyro.infer import TraceMeanField_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp.bounds.solvegp import count_cubic_operations

N, B, D = 10_000, 1024, 8


def build(kind, M):
    pyro.clear_param_store()
    k = RBF(D, lengthscale=torch.ones(D))
    if kind == "solvegp":
        return ps.SOLVEGP(k, torch.randn(M, D), torch.randn(M, D), ps.Gaussian(0.1))
    return ps.SVGP(k, torch.randn(M if kind == "svgp_m" else 2 * M, D), ps.Gaussian(0.1))


def ours_step(gp, X, y, analytic=False):
    opt = torch.optim.Adam(gp.parameters(), lr=0.01)
    elbo = TraceMeanField_ELBO()

    def step():
        opt.zero_grad()
        if analytic:
            (-gp.analytic_elbo(X, y, num_data=N)).backward()
        else:
            elbo.differentiable_loss(gp.model, gp.guide, X, y, num_data=N).backward()
        opt.step()

    return step


def gpytorch_odvgp_step(M, X, y):
    model = gpytorch_svgp(torch.randn(M, D), mean_inducing=torch.randn(M, D))
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.01)
    model.train()
    lik.train()

    def step():
        opt.zero_grad()
        (-mll(model(X), y)).backward()
        opt.step()

    return step


def count_ops(gp, X, y):
    """Cholesky factorisations and triangular solves with a square or wide right-hand side in one forward pass,
    by matrix sizes (measured by patching torch.linalg)."""
    found = {"cholesky": [], "trisolve": []}
    chol, tri = torch.linalg.cholesky_ex, torch.linalg.solve_triangular

    def c(A, *a, **k):
        found["cholesky"].append(f"{A.shape[-1]}^3")
        return chol(A, *a, **k)

    def t(A, Bm, *a, **k):
        if Bm.shape[-1] > 1 and Bm.shape[-2] > 1:
            found["trisolve"].append(f"{A.shape[-1]}^2 x {Bm.shape[-1]}")
        return tri(A, Bm, *a, **k)

    with mock.patch("torch.linalg.cholesky_ex", side_effect=c), mock.patch(
            "torch.linalg.solve_triangular", side_effect=t):
        TraceMeanField_ELBO().differentiable_loss(gp.model, gp.guide, X, y, num_data=N)
    return found


def main():
    args = parser(__doc__).parse_args()
    setup(args)
    warnings.filterwarnings("ignore")
    sizes = [256, 512] if args.quick else [256, 512, 1024]
    rows = []
    for dtype in [torch.float64] if args.quick else [torch.float64, torch.float32]:
        torch.set_default_dtype(dtype)
        for M in sizes:
            torch.manual_seed(0)
            X, y = torch.randn(B, D), torch.randn(B)
            fns = {kind: ours_step(build(kind, M), X, y) for kind in ("svgp_m", "solvegp", "svgp_2m")}
            fns.update({f"{kind}_an": ours_step(build(kind, M), X, y, analytic=True)
                        for kind in ("svgp_m", "solvegp", "svgp_2m")})
            fns["gpyt_odvgp"] = gpytorch_odvgp_step(M, X, y)
            reps = (3 if M >= 1024 else 5) if args.quick else (5 if M >= 1024 else 9)
            t = time_alternating(fns, reps)
            row = {"M": M, "M2": M, "batch": B, "dtype": str(dtype).split(".")[-1]}
            row.update({f"{k}_ms": v for k, v in t.items()})
            row["ratio_svgp2m_over_solve"] = t["svgp_2m"] / t["solvegp"]
            row["ratio_solve_over_svgpm"] = t["solvegp"] / t["svgp_m"]
            row["ratio_solve_over_gpyt_odvgp"] = t["solvegp"] / t["gpyt_odvgp"]
            row["an_ratio_svgp2m_over_solve"] = t["svgp_2m_an"] / t["solvegp_an"]
            row["an_ratio_solve_over_svgpm"] = t["solvegp_an"] / t["svgp_m_an"]
            rows.append(row)
            print(table([row], list(row)), flush=True)
    print("\ntargets (CPU float64, M = 1024): SVGP(2M)/SOLVE-GP(M+M) >= 1.5, SOLVE-GP(M+M)/SVGP(M) <= 2.5\n")
    print("sampled sites (TraceMeanField_ELBO):")
    print(table(rows, ["dtype", "M", "svgp_m_ms", "solvegp_ms", "svgp_2m_ms", "gpyt_odvgp_ms",
                       "ratio_svgp2m_over_solve", "ratio_solve_over_svgpm", "ratio_solve_over_gpyt_odvgp"]))
    print("closed-form bound (algorithm 1, fit(elbo='analytic')):")
    print(table(rows, ["dtype", "M", "svgp_m_an_ms", "solvegp_an_ms", "svgp_2m_an_ms", "an_ratio_svgp2m_over_solve",
                       "an_ratio_solve_over_svgpm"]))
    torch.set_default_dtype(torch.float64)
    M = 256
    X, y = torch.randn(B, D), torch.randn(B)
    print(f"\ncubic-cost operations in one forward pass (M = M2 = {M}, batch {B}); table 4 of the paper:")
    for kind in ("svgp_m", "solvegp"):
        ops = count_ops(build(kind, M), X, y)
        paper = count_cubic_operations("svgp" if kind == "svgp_m" else "solvegp")
        print(f"  {kind:8s} ours:  cholesky {ops['cholesky']}, triangular solves {ops['trisolve']}")
        print(f"  {'':8s} paper: cholesky {paper['cholesky']}, triangular solves {paper['trisolve']}, "
              f"matmul {paper['matmul']}")
    print("  (ours samples u and v, so the products with S_u, S_v of algorithm 1 lines 5-7 are not needed; the "
          "backward pass adds one solve per forward solve)")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
