"""Export time and per-batch latency of an exported SVGP (issue 55, items 1 and 3): ``ps.export`` of an SVGP trained
on the bundled UCI power-plant data (D = 4, M = 128, float64), then the predictive mean and variance of a batch of
1,000 test points from

* ``predict``: ``gp.predict(X)`` in eager code (input checks, the strategy's factorisation of ``Kuu`` at every call),
* ``exported``: the ``torch.export`` program (``ep.module()(X)``: the kernel and two ``M x M`` products per row),
* ``loaded``: the same program after ``torch.export.save`` / ``torch.export.load`` (what a server runs),
* ``onnxruntime``: the ONNX program of ``ps.deploy.export_onnx`` in ONNX Runtime (CPU provider), if installed,

timed round-robin (medians), with the largest difference from ``predict`` of each. One thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/export_latency.py --threads 1 \
        --json benchmarks/records/export_latency.json          # about 1 minute (export times included)
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from _common import machine_note, parser, setup, table, time_alternating, write_json
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import load_powerplant, standardize

M, BATCH = 128, 1000


def _trained():
    data = load_powerplant()
    X, Xt, _, _ = standardize(data.X_train, data.X_test)
    y, _, _, _ = standardize(data.y_train, data.y_test)
    gp = ps.SVGP(RBF(4, lengthscale=torch.ones(4)), X[:M].clone(), ps.Gaussian(0.1))
    ps.infer.fit(gp, X, y, num_steps=200, batch_size=1024, lr=0.02, progress=False)
    Xb = torch.cat([Xt, X])[:BATCH].contiguous()  # 957 test rows and 43 training rows: a batch of 1,000
    return gp, X, Xb


def _onnx(gp, X, Xb, where):
    try:
        import onnxruntime as ort
    except ImportError:
        return None, None
    t = time.perf_counter()
    ps.deploy.export_onnx(gp, X[:7], where / "gp.onnx")
    seconds = time.perf_counter() - t
    session = ort.InferenceSession(str(where / "gp.onnx"), providers=["CPUExecutionProvider"])
    feed = {"X": Xb.numpy()}
    return (lambda: session.run(None, feed)), seconds


def main():
    args = parser(__doc__).parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    gp, X, Xb = _trained()
    t = time.perf_counter()
    ep = ps.export(gp, X[:7])
    export_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        torch.export.save(ep, where / "gp.pt2")
        t = time.perf_counter()
        loaded = torch.export.load(where / "gp.pt2").module()
        load_s = time.perf_counter() - t
        exported = ep.module()
        fns = {"predict": lambda: gp.predict(Xb), "exported": lambda: exported(Xb), "loaded": lambda: loaded(Xb)}
        run_onnx, onnx_s = _onnx(gp, X, Xb, where)
        if run_onnx is not None:
            fns["onnxruntime"] = run_onnx
        ms = time_alternating(fns, repeats=3 if args.quick else 30, warmup=2)
        want = torch.stack(gp.predict(Xb))
        rows = []
        for name, f in fns.items():
            got = torch.stack([torch.as_tensor(t) for t in f()])
            setup_s = {"exported": export_s, "loaded": load_s, "onnxruntime": onnx_s}.get(name)
            rows.append({"contender": name, "batch": BATCH, "M": M, "ms_per_batch": ms[name],
                         "ratio_to_predict": ms[name] / ms["predict"], "setup_s": setup_s,
                         "max_abs_diff": float((got - want).abs().max())})
    print(machine_note(torch.get_num_threads()))
    print(table(rows, ["contender", "batch", "M", "ms_per_batch", "ratio_to_predict", "setup_s", "max_abs_diff"]))
    print("# setup_s: export (ps.export / export_onnx) or torch.export.load time, seconds")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
