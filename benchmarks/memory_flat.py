"""Memory flat in N (issue 13, point 4): ``fit`` on 10^6 and 10^7 points streamed from a memory-mapped ``.npy`` file
on disk (:class:`pyro_sparsegp.data_stream.MemmapDataset`), peak resident memory of each run printed side by side.

    PYTHONPATH=. python benchmarks/memory_flat.py [--quick] [--json PATH] [--threads T] [--dir TMP]

For each N the data ``[N, 9]`` float32 (8 inputs and a target; 10^7 rows = 360 MB) is written in chunks to a file in
a temporary folder (``--dir``, default the system's), then a fresh Python subprocess builds an SVGP (M = 128) and runs
``fit(gp, MemmapDataset(path), num_steps=S, batch_size=1024)`` and prints its peak resident set size (``VmHWM``
of ``/proc/self/status``; ``ru_maxrss`` where that is missing) and the file's size. The file is read by batches of
indices only (positional reads, see :mod:`pyro_sparsegp.data_stream`); the page cache that the kernel keeps for it
is not the process's resident memory.

Rows: ``{"N", "file_mb", "steps", "seconds", "peak_rss_mb", "ratio"}`` with ``ratio`` = peak RSS / peak RSS at the
smallest N (target: about 1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import parser, table, write_json

D = 8

CHILD = r"""
import json, os, resource, sys, time, warnings
import torch, pyro
warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[3]))
pyro.settings.set(module_local_params=True)
from pyro.contrib.gp.kernels import RBF
import pyro_sparsegp as ps
from pyro_sparsegp.data_stream import MemmapDataset
from pyro_sparsegp.infer import fit

def peak_mb():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

ds = MemmapDataset(sys.argv[1])
steps = int(sys.argv[2])
torch.manual_seed(0)
Z = ds[torch.randint(len(ds), (128,))][0]  # not randperm(N): O(N) memory
gp = ps.SVGP(RBF(ds.num_features, lengthscale=torch.ones(ds.num_features)), Z, ps.Gaussian(0.1))
t = time.perf_counter()
state = fit(gp, ds, num_steps=steps, batch_size=1024, lr=0.01, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": peak_mb(), "loss": state.losses[-1]}))
"""


def write_data(path, N, chunk=1_000_000):
    """Synthetic regression rows ``[x (8) | y]`` in float32, written chunk by chunk through a memory map."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(N, D + 1))
    rng = np.random.default_rng(0)
    for s in range(0, N, chunk):
        n = min(chunk, N - s)
        x = rng.standard_normal((n, D), dtype=np.float32)
        out[s : s + n, :D] = x
        out[s : s + n, D] = np.sin(x.sum(1)) + 0.1 * rng.standard_normal(n, dtype=np.float32)
    out.flush()
    del out


def main():
    p = parser(__doc__)
    p.add_argument("--dir", default=None, help="folder for the temporary data files")
    p.add_argument("--sizes", default="1000000,10000000", help="comma-separated N values")
    args = p.parse_args()
    steps = 30 if args.quick else 200
    sizes = [int(s) for s in args.sizes.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for N in sizes:
            path = os.path.join(tmp, f"data_{N}.npy")
            t = time.perf_counter()
            write_data(path, N)
            print(f"# wrote {N} rows ({os.path.getsize(path) / 2**20:.0f} MB) in {time.perf_counter() - t:.1f} s",
                  flush=True)
            out = subprocess.run([sys.executable, "-c", CHILD, path, str(steps), str(args.threads)], env=env,
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"N": N, "file_mb": os.path.getsize(path) / 2**20, "steps": steps,
                         "seconds": res["seconds"], "peak_rss_mb": res["peak_rss_mb"]})
            os.remove(path)
            print(f"# N={N}: peak RSS {res['peak_rss_mb']:.0f} MB, {steps} steps in {res['seconds']:.1f} s", flush=True)
    for r in rows:
        r["ratio"] = r["peak_rss_mb"] / rows[0]["peak_rss_mb"]
    print("\nPeak resident memory of fit streaming from a memory-mapped file (SVGP M = 128, batch 1024):")
    print(table(rows, ["N", "file_mb", "steps", "seconds", "peak_rss_mb", "ratio"]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
