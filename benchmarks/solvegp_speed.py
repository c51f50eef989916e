"""Time per training step (forward + backward + Adam) of SVGP(M), SOLVE-GP(M + M) and SVGP(2M) (Shi, Titsias, Mnih
2020), batch 1024, D = 8 (random data), measured alternately in one run (medians), beside our ODVGP(M + M) and
GPyTorch's OrthogonallyDecoupledVariationalStrategy (a VariationalStrategy over M covariance inducing points wrapped
with M mean inducing points and a DeltaVariationalDistribution, as in GPyTorch's docs); and the cubic-cost
operations one forward pass of ours performs, beside table 4 of the paper.

    python benchmarks/solvegp_speed.py [--quick] [--json PATH] [--threads T]

Our step: ``TraceMeanField_ELBO().differentiable_loss(gp.model, gp.guide, X, y, num_data=N)``, ``backward``, Adam,
with ``integrate_f=True`` (f integrated out given the sampled u, v: the same bound as sampling the f site, lower
variance, no f samples). Columns without suffix: whitened (the modules' default); ``*_nw``: no whitening (as in
the paper's algorithm 1 and its regression experiments), which adds the KL's solves against chol(Kuu), chol(Cvv).
``--quick``: M in {256, 512}, float64; full: M in {256, 512, 1024}, float64, then float32 as extra rows.
On a loaded machine pass ``--threads 1``: with two threads competing for two busy cores torch's parallel regions
slowed our steps by 10x or more.
"""
from __future__ import annotations

import inspect
import os
import warnings
from collections import Counter

import gpytorch
import torch
from _common import parser, setup, table, time_alternating, write_json
from _gpytorch import approximate_gp, optimizers
from pyro.contrib.gp.kernels import RBF
from pyro.infer import TraceMeanField_ELBO
from torch.utils._python_dispatch import TorchDispatchMode

import pyro_sparsegp as ps

N, B, D = 10_000, 1024, 8

# Table 4 of the paper ("Cubic-cost operations in SOLVE-GP and SVGP, following the implementation in algorithm 1"),
# read from the paper's text: operation -> {cost: count}. M2 is the number of orthogonal inducing points.
TABLE4 = {
    "svgp": {"matmul": {"N M^2": 1}, "cholesky": {"M^3": 1}, "trisolve": {"M^3": 1, "N M^2": 2}},
    "solvegp": {
        "matmul": {"N M^2": 1, "N M2^2": 1, "N M M2": 1, "M M2^2": 1},
        "cholesky": {"M^3": 1, "M2^3": 1},
        "trisolve": {"M^3": 1, "M2^3": 1, "N M^2": 2, "N M2^2": 2, "M^2 M2": 1},
    },
}


def build(kind, M, whiten=True):
    k = RBF(D, lengthscale=torch.ones(D))
    if kind in ("solvegp", "odvgp"):
        return ps.SOLVEGP(k, torch.randn(M, D), torch.randn(M, D), ps.Gaussian(0.1), whiten=whiten, integrate_f=True,
                          odvgp=kind == "odvgp")
    return ps.SVGP(k, torch.randn(M if kind == "svgp_m" else 2 * M, D), ps.Gaussian(0.1), whiten=whiten,
                   integrate_f=True)


def ours_step(gp, X, y):
    opt = torch.optim.Adam(gp.parameters(), lr=0.01)
    elbo = TraceMeanField_ELBO()

    def step():
        opt.zero_grad()
        elbo.differentiable_loss(gp.model, gp.guide, X, y, num_data=N).backward()
        opt.step()

    return step


def gpytorch_odvgp_step(M, X, y):
    model = approximate_gp(torch.randn(M, D), mean_inducing=torch.randn(M, D))
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    (opt,) = optimizers(model, lik, N, lr=0.01)
    model.train()
    lik.train()

    def step():
        opt.zero_grad()
        (-mll(model(X), y)).backward()
        opt.step()

    return step


# -- counting cubic-cost operations -------------------------------------------------------------------------------
def _cost(dims, sym):
    """Canonical cost string of a product of sizes, e.g. (1024, 256, 256) -> 'N M^2'; None unless all are large."""
    if not all(d in sym for d in dims):
        return None
    c = Counter(sym[d] for d in dims)
    return " ".join(s if c[s] == 1 else f"{s}^{c[s]}" for s in ("N", "M", "M2") if c[s])


_CHOLESKY = ("linalg_cholesky_ex", "cholesky", "linalg_cholesky")


def _linalg_op(func, args, kwargs):
    """``(op, (m, k, n), batch)`` of a dense linear-algebra ATen call (what ``@``, ``torch.matmul``,
    ``torch.linalg.cholesky_ex`` and ``torch.linalg.solve_triangular`` dispatch to): a product ``[m, k] x [k, n]``,
    a Cholesky ``(n, n, n)``, a triangular solve ``(n, n, right-hand sides)``; ``batch`` matrices of each. ``None``
    for anything else."""
    name = func.overloadpacket.__name__
    a = [t for t in args if isinstance(t, torch.Tensor)]
    if name in ("mm", "bmm", "addmm", "baddbmm"):
        x, y = (a[0], a[1]) if name in ("mm", "bmm") else (a[1], a[2])
        return "matmul", (x.shape[-2], x.shape[-1], y.shape[-1]), x.shape[:-2].numel()
    if name in _CHOLESKY:
        return "cholesky", (a[0].shape[-1],) * 3, a[0].shape[:-2].numel()
    if name in ("linalg_solve_triangular", "triangular_solve"):
        A, Bm = (a[0], a[1]) if name == "linalg_solve_triangular" else (a[1], a[0])
        k = Bm.shape[-1] if kwargs.get("left", True) else Bm.shape[-2]
        return "trisolve", (A.shape[-1], A.shape[-1], k), torch.broadcast_shapes(A.shape[:-2], Bm.shape[:-2]).numel()
    if name.startswith(("linalg_", "cholesky_")):
        return "other linalg: " + name, tuple(a[0].shape[-2:]) + (a[0].shape[-1],), 1
    return None


class CountCubic(TorchDispatchMode):
    """Records every matrix product, Cholesky factorisation and triangular solve at the ATen level, classified by
    its operands' sizes; those whose three sizes are all in ``sym`` (batch N, M, M2) are cubic."""

    def __init__(self, sym):
        super().__init__()
        self.sym = sym
        self.found = {"matmul": Counter(), "cholesky": Counter(), "trisolve": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = _linalg_op(func, args, kwargs)
        if found is not None:
            op, dims, _ = found
            cost = _cost(dims, self.sym)
            if cost is not None:
                self.found.setdefault(op, Counter())[cost] += 1
        return func(*args, **kwargs)


class CountFlops(TorchDispatchMode):
    """Floating-point operations of the dense linear algebra (matrix products ``2mkn``, Cholesky ``n^3/3``,
    triangular solves ``n^2 k``) that run inside the mode, forward and backward, batch dimensions included."""

    PER_MKN = {"matmul": 2, "cholesky": 1 / 3, "trisolve": 1}

    def __init__(self):
        super().__init__()
        self.flops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = _linalg_op(func, args, kwargs)
        if found is not None and found[0] in self.PER_MKN:
            op, (m, k, n), batch = found
            self.flops[op] += self.PER_MKN[op] * m * k * n * batch
        return func(*args, **kwargs)


def count_step_flops(kind, M, whiten=True):
    """Dense-algebra flops of one training step (loss and backward) of ours, as timed above."""
    torch.manual_seed(0)
    gp = build(kind, M, whiten)
    X, y = torch.randn(B, D), torch.randn(B)
    mode = CountFlops()
    with mode:
        TraceMeanField_ELBO().differentiable_loss(gp.model, gp.guide, X, y, num_data=N).backward()
    return mode.flops


def count_ops(kind, M, M2, whiten):
    """Cubic-cost operations of one forward pass (loss only) of our training step, at batch B, M and M2 chosen
    distinct so that each operand size names one symbol."""
    torch.manual_seed(0)
    k = RBF(D, lengthscale=torch.ones(D))
    if kind == "svgp":
        gp = ps.SVGP(k, torch.randn(M, D), ps.Gaussian(0.1), whiten=whiten, integrate_f=True)
    else:
        gp = ps.SOLVEGP(k, torch.randn(M, D), torch.randn(M2, D), ps.Gaussian(0.1), whiten=whiten, integrate_f=True)
    X, y = torch.randn(B, D), torch.randn(B)
    mode = CountCubic({B: "N", M: "M", M2: "M2"})
    with mode:
        TraceMeanField_ELBO().differentiable_loss(gp.model, gp.guide, X, y, num_data=N)
    return mode.found


def mm_units(counts):
    """Cost in units of one operation on M x M matrices at N = M = M2 (the paper's figure 4a)."""
    return sum(counts.values())


def package_table4():
    """``pyro_sparsegp.bounds.solvegp.count_cubic_operations`` in table-4 form, if the package has it."""
    try:
        from pyro_sparsegp.bounds.solvegp import count_cubic_operations as f
    except ImportError:
        return None
    out = {}
    for method in ("svgp", "solvegp"):
        params = list(inspect.signature(f).parameters)
        res = f(256, 256, method) if len(params) >= 3 else f(method)
        out[method] = {op: {str(c): int(n) for c, n in (v.items() if isinstance(v, dict) else v)}
                       for op, v in res.items()}
    return out


def main():
    args = parser(__doc__).parse_args()
    setup(args)
    warnings.filterwarnings("ignore")
    sizes = [256, 512] if args.quick else [256, 512, 1024]
    print(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows = []
    for dtype in (torch.float64,) if args.quick else (torch.float64, torch.float32):
        torch.set_default_dtype(dtype)
        for M in sizes:
            torch.manual_seed(0)
            X, y = torch.randn(B, D), torch.randn(B)
            fns = {kind: ours_step(build(kind, M), X, y) for kind in ("svgp_m", "solvegp", "svgp_2m", "odvgp")}
            fns["gpyt_odvgp"] = gpytorch_odvgp_step(M, X, y)
            fns.update({f"{kind}_nw": ours_step(build(kind, M, whiten=False), X, y)
                        for kind in ("svgp_m", "solvegp", "svgp_2m")})
            reps = 5 if (M >= 1024 or args.quick) else 7
            t = time_alternating(fns, reps, warmup=2)
            row = {"M": M, "M2": M, "batch": B, "D": D, "dtype": str(dtype).split(".")[-1], "reps": reps,
                   "threads": torch.get_num_threads(), "integrate_f": True}
            row.update({f"{k}_ms": v for k, v in t.items()})
            row["ratio_svgp2m_over_solve"] = t["svgp_2m"] / t["solvegp"]
            row["ratio_solve_over_svgpm"] = t["solvegp"] / t["svgp_m"]
            row["ratio_svgp2m_over_solve_nw"] = t["svgp_2m_nw"] / t["solvegp_nw"]
            row["ratio_solve_over_svgpm_nw"] = t["solvegp_nw"] / t["svgp_m_nw"]
            row["ratio_solve_over_gpyt_odvgp"] = t["solvegp"] / t["gpyt_odvgp"]
            row["load_avg"] = os.getloadavg()[0]
            rows.append(row)
            print(table([row], ["dtype", "M", "svgp_m_ms", "solvegp_ms", "svgp_2m_ms", "odvgp_ms", "gpyt_odvgp_ms",
                                "svgp_m_nw_ms", "solvegp_nw_ms", "svgp_2m_nw_ms"]), flush=True)
    print("\nms per training step (median), batch 1024, D = 8; whitened unless *_nw; all ours with integrate_f=True")
    print(table(rows, ["dtype", "M", "svgp_m_ms", "solvegp_ms", "svgp_2m_ms", "odvgp_ms", "gpyt_odvgp_ms",
                       "svgp_m_nw_ms", "solvegp_nw_ms", "svgp_2m_nw_ms"]))
    print("\nratios (targets at M = 1024: SVGP(2M)/SOLVE-GP(M+M) >= 1.5, SOLVE-GP(M+M)/SVGP(M) <= 2.5)")
    print(table(rows, ["dtype", "M", "ratio_svgp2m_over_solve", "ratio_solve_over_svgpm", "ratio_svgp2m_over_solve_nw",
                       "ratio_solve_over_svgpm_nw", "ratio_solve_over_gpyt_odvgp"]))

    # -- flops of a whole step: why SOLVE-GP(M + M) / SVGP(M) cannot reach the paper's operation-count ratio ----
    torch.set_default_dtype(torch.float64)
    frows = []
    for M in sizes:
        fl = {kind: count_step_flops(kind, M) for kind in ("svgp_m", "solvegp", "svgp_2m")}
        tot = {k: sum(v.values()) for k, v in fl.items()}
        t = next(r for r in rows if r["M"] == M and r["dtype"] == "float64")
        frows.append({"table": "step_flops", "M": M, "batch": B,
                      **{f"{k}_gflop": round(v / 1e9, 2) for k, v in tot.items()},
                      "flop_ratio_solve_over_svgpm": tot["solvegp"] / tot["svgp_m"],
                      "time_ratio_solve_over_svgpm": t["ratio_solve_over_svgpm"],
                      "flop_ratio_svgp2m_over_solve": tot["svgp_2m"] / tot["solvegp"],
                      "time_ratio_svgp2m_over_solve": t["ratio_svgp2m_over_solve"]})
    print("\ndense-algebra flops of one whole training step (forward and backward, whitened, counted at the ATen "
          "level), beside the measured time ratios (float64):")
    print(table(frows, ["M", "svgp_m_gflop", "solvegp_gflop", "svgp_2m_gflop", "flop_ratio_solve_over_svgpm",
                        "time_ratio_solve_over_svgpm", "flop_ratio_svgp2m_over_solve", "time_ratio_svgp2m_over_solve"]))
    print("  every exact method needs, for each point, the variance of p(f | u, v): k_nn - k_Jn^T K_JJ^-1 k_Jn over "
          "J = Z + O, a dense (M + M2)-dimensional quadratic form, so the batch-dependent work of SOLVE-GP(M + M) is "
          "((M + M2) / M)^2 = 4 times SVGP(M)'s (the same as SVGP(2M)'s); only the M^3 part is cheaper than SVGP(2M). "
          "The paper's table 4 / figure 4a count operations (a Cholesky as one matrix product, forward pass only), "
          "which gives 13 / 5 = 2.6; on a CPU, where Cholesky and triangular solves run near matrix-product speed "
          "per flop, the time ratio follows the flop ratio.")
    rows.extend(frows)

    # -- cubic-cost operations, table 4 ------------------------------------------------------------------------
    Mc, M2c = 256, 384
    ours = {(m, w): count_ops(m, Mc, M2c, w) for m in ("svgp", "solvegp") for w in (True, False)}
    print(f"\ncubic-cost operations in one forward pass of our step (counted at the ATen level; batch N = {B}, "
          f"M = {Mc}, M2 = {M2c} so that sizes name symbols) beside table 4 of the paper:")
    crow = []
    for method in ("svgp", "solvegp"):
        for op in ("matmul", "cholesky", "trisolve"):
            costs = set(TABLE4[method][op]) | set(ours[method, True].get(op, {})) | set(ours[method, False].get(op, {}))
            for c in sorted(costs):
                crow.append({"method": method, "op": op, "cost": f"O({c})",
                             "paper": TABLE4[method][op].get(c, 0),
                             "ours_whitened": ours[method, True].get(op, {}).get(c, 0),
                             "ours_not_whitened": ours[method, False].get(op, {}).get(c, 0)})
        for extra in sorted(set(ours[method, True]) | set(ours[method, False])):
            if extra.startswith("other"):
                print(f"  note: {method} also runs {extra}")
    print(table(crow, ["method", "op", "cost", "paper", "ours_whitened", "ours_not_whitened"]))
    print("\nin units of one op on M x M matrices at N = M = M2 (the paper's figure 4a: SVGP 1/1/3, SOLVE-GP 4/2/7):")
    urow = []
    for method in ("svgp", "solvegp"):
        r = {"method": method}
        for op in ("matmul", "cholesky", "trisolve"):
            r[f"{op}_paper"] = mm_units(TABLE4[method][op])
            r[f"{op}_ours_w"] = mm_units(ours[method, True].get(op, {}))
            r[f"{op}_ours_nw"] = mm_units(ours[method, False].get(op, {}))
        urow.append(r)
    print(table(urow, list(urow[0])))
    print("  ours samples u and v (the S_u, S_v products of algorithm 1 lines 5-7 and E = Lu^-T B, G = Lc^-T D are not "
          "needed: with integrate_f the data term uses p(f | u, v) with sampled u, v); whitened, the KL needs no "
          "solve; "
          "the backward pass adds about twice the forward cost")
    pkg = package_table4()
    if pkg is None:
        print("  pyro_sparsegp.bounds.solvegp.count_cubic_operations: not in the package")
    else:
        print("  pyro_sparsegp.bounds.solvegp.count_cubic_operations agrees with table 4 as read here: "
              f"{'yes' if pkg == TABLE4 else 'NO: ' + repr(pkg)}")
    for r in crow:
        rows.append({"table": "cubic_ops", "M": Mc, "M2": M2c, "batch": B, **r})
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
