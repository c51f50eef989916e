"""Memory flat in N (docs/streaming.md; issue 25, item 5): the resident memory that ``fit`` adds while it trains on a
streamed data set does not grow with the data set's size N.

Each run is a fresh interpreter (``torch.set_num_threads(1)``) that trains an SVGP (M = 32, D = 4, Gaussian
likelihood) for 30 steps of batch 256 on :class:`HashedRows`, a data set of N rows computed from their indices on
the fly (``len(ds)``, ``ds[idx] -> (X[idx], y[idx])``, as docs/streaming.md describes; nothing of size N is ever
stored). Before the measured ``fit`` the child runs a warm-up ``fit`` on 1,000 rows (torch's one-time buffers, the
autograd engine and the natural-gradient code paths are then resident), then resets the kernel's high-water mark of
its resident set (``/proc/self/clear_refs`` = 5; where that is refused, the older peak stays and the growth is read
against the current resident set, which can only overstate it) and reads ``VmRSS``. The growth is
``VmHWM`` after the measured ``fit`` minus that ``VmRSS``: the peak resident memory the run itself added,
whatever allocated it (torch, numpy or Python), and a page only counts once it is written, as any real index array
or copy of the data is.

What must fail: an ``O(N)`` allocation during the run, e.g. an epoch permutation ``torch.randperm(N)`` (10^7 int64
= 76 MiB), an ``np.arange(N)`` of positions (the same), or a materialised column of the data (10^7 float64 = 76 MiB).
The bound: the growth at N = 10^7 may exceed the growth at N = 10^5 by at most ``BOUND_MB`` = 20 MiB, a quarter of
the smallest of those (the smallest ``O(N)`` array of 8-byte entries at N = 10^7; an int32 permutation, 38 MiB,
fails too). Measured on the development machine (Linux, torch 2.13 CPU, about 3.5 s per child): growth 0.14 MiB at
N = 10^5 and 0.13 MiB at N = 10^7 (difference -0.01; 0.7 MiB at most over repeated runs); with the injected per-epoch
``torch.randperm(N)`` sampler the growth at N = 10^7 is 76.4 MiB (also without the high-water reset), so the test
would fail by 56 MiB; ``test_the_measurement_sees_an_index_permutation`` runs exactly that
injection and asserts that it is seen, so the detector itself is tested.

``predict`` is not part of this test: it takes the test inputs as one tensor (``check_inputs`` -> ``as_tensor``
raises ``TypeError`` for a data-set object) and chunks that tensor internally, so there is no streamed test set to
feed it.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the child imports this checkout's package
BOUND_MB = 20.0
SMALL, LARGE = 10**5, 10**7

CHILD = r'''
import gc, json, resource, sys, warnings
import torch, pyro
torch.set_num_threads(1)
warnings.simplefilter("ignore")  # tqdm and cast warnings are not what is measured
pyro.settings.set(module_local_params=True)
torch.set_default_dtype(torch.float64)
from pyro.contrib.gp.kernels import RBF
import pyro_sparsegp as ps
import pyro_sparsegp.infer.training.batches as batches
from pyro_sparsegp.infer import fit

N, inject = int(sys.argv[1]), sys.argv[2]
D, M = 4, 32


class HashedRows:
    """N rows computed from their indices (a hash of ``(i, d)``), so nothing of size N is stored:
    ``X[i, d] = frac(sin(12.9898 i + 78.233 d + 1) 43758.5453)`` in (-1, 1), ``y = sin(3 X[:, 0]) + 0.1 e``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    @staticmethod
    def _hash(i, d):
        return torch.frac(torch.sin(i[:, None] * 12.9898 + d * 78.233 + 1.0) * 43758.5453)

    def __getitem__(self, idx):
        i = torch.as_tensor(idx).reshape(-1).to(torch.float64)
        X = self._hash(i, torch.arange(D, dtype=torch.float64))
        e = self._hash(i, torch.tensor([D + 1.0], dtype=torch.float64))[:, 0]
        return X, torch.sin(3 * X[:, 0]) + 0.1 * e


if inject == "randperm":  # the O(N) sampler this test exists to catch: a stored permutation per epoch
    def _iter(self):
        step, epoch, perm = self.start_step, None, None
        while True:
            e, pos = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, perm = e, torch.randperm(self.num_data)
            yield perm[pos * self.batch_size : (pos + 1) * self.batch_size]
            step += 1
    batches.EpochBatchSampler.__iter__ = _iter


def status():
    """Resident set and its peak in MiB: /proc/self/status (Linux), else the peak from getrusage for both (macOS
    reports bytes, Linux KiB): growth is then the rise of the peak over the warm-up's."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) / 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
        out = {"VmHWM": peak, "VmRSS": peak}
    return out


def run(ds, steps):
    torch.manual_seed(0)
    Z = ds[torch.randint(len(ds), (M,))][0]
    gp = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), Z, ps.Gaussian(0.1))
    return fit(gp, dataset=ds, num_steps=steps, batch_size=256, lr=0.01, progress=False)


run(HashedRows(1000), 3)  # warm-up: torch's one-time allocations are resident before the measurement
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident set
    reset = True
except OSError:
    reset = False
before = status()["VmRSS"]
state = run(HashedRows(N), 30)
after = status()["VmHWM"]
print(json.dumps({"N": N, "growth_mb": after - before, "before_mb": before, "peak_mb": after, "reset": reset,
                  "loss": state.losses[-1]}))
'''


def _growth(N: int, inject: str = "none") -> dict:
    """The child's report for one fresh run: ``growth_mb``, the peak resident memory that the measured ``fit``
    added (MiB)."""
    root = str(ROOT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", CHILD, str(N), inject], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])




def test_fit_memory_is_flat_in_N():
    """Growth at N = 10^7 minus growth at N = 10^5 below ``BOUND_MB`` = 20 MiB (a quarter of the 76 MiB that any
    ``O(N)`` 8-byte array costs at 10^7; module docstring). Measured: 0.14 and 0.13 MiB."""
    small, large = _growth(SMALL), _growth(LARGE)
    assert large["growth_mb"] - small["growth_mb"] < BOUND_MB, (small, large)
    assert small["growth_mb"] < BOUND_MB, small  # 30 steps of M = 32, B = 256 need a few MiB at most
    assert math.isfinite(large["loss"]) and math.isfinite(small["loss"])  # it trained


def test_the_measurement_sees_an_index_permutation():
    """The detector works: with the sampler replaced by one that stores ``torch.randperm(N)`` per epoch (76 MiB at
    N = 10^7) the same measurement exceeds the bound (measured growth: 76.4 MiB)."""
    bad = _growth(LARGE, inject="randperm")
    assert bad["growth_mb"] > BOUND_MB + 50, bad
