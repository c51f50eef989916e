"""Convolutional GPs on MNIST and Fashion-MNIST (Shi, Titsias, Mnih 2020, sec. 6.2, tables 8-9; van der Wilk et al.
2017; Dutordoir et al. 2020): RBF SVGP (M; ``rbf2M``: 2M), weighted-convolutional SVGP (M and 2M), convolutional
SOLVE-GP (M + M), TICK SVGP, the sums weighted conv + RBF (``conv_rbf``, van der Wilk et al.'s "wconv + RBF") and
TICK + RBF (``tick_rbf``) with M inducing patches + M inducing images, and 2- and 3-layer deep convolutional SVGP
/ SOLVE-GP (``deep2``, ``deep2_solve``, ``deep3``, ``deep3_solve``; table 5: hidden 5x5 stride 1 with 10 channels
(deep3: then 4x4 stride 2 with 10 channels), TICK output layer 4x4 stride 2 (deep3: 5x5 stride 1)), all with the
robust-max likelihood (10 latent GPs, shared inducing patches), trained side by side on the same minibatches by
``pyro_sparsegp.infer.fit`` on each model's ``analytic_elbo`` (single layer: the closed-form bound with
Gauss-Hermite quadrature; deep: Salimbeni's estimator through the hidden layers' marginals), Adam on everything
(the paper's recipe). ``--natgrad LENGTH`` gives the output layer's q(u) natural steps of that length instead (the
positive-definite step); ``--natgrad auto`` is ``fit``'s policy, which at |B| = 64 of 8,000 or more images is Adam:
TICK on the Fashion subset reached 0.634 / 0.696 / 0.713 test accuracy after 400 iterations with steps of 0.1 / 0.01
/ 0.03, against 0.770 with Adam (``pyro_sparsegp.infer.natgrad.policy``).

Data: ``mnist`` = the 10,000 real MNIST test images (the only MNIST images in ``shared/data``), stratified 8,000 /
2,000; ``fashion`` = Fashion-MNIST 60,000 / 10,000. Pixels in [0, 1].

Defaults are the paper's (appendix G.2): M = 1000 (single layer), 384 per hidden layer / 1000 output (deep), |B| = 64,
Adam lr 0.003 annealed x0.25 every 50K of 300K iterations, patch RBF variance 5 (lengthscale 1 for pixels in
[0, 1], where the paper's 5 made Kuu numerically singular in float32), TICK location
lengthscale 3, whitening in single-layer models only, k-means-initialised patches. ``--quick``: MNIST 8k/2k and
Fashion 8k/2k subsets, M = 100 (deep: 50 hidden / 100 output), 150 iterations at lr 0.01, |B| = 64.
``--curve-every K`` adds test accuracy and log-likelihood every K iterations to the log and the JSON (``"curve"``).
``--test-n 10000`` evaluates the quick runs on all of Fashion-MNIST's test images; ``--save DIR`` keeps each trained
model's ``state_dict`` (``DIR/DATASET_MODEL.pt``) and ``--init-from DIR`` starts a run from it (to train longer).

    python benchmarks/convgp_mnist.py --quick --threads 1 --datasets mnist --iters 2000 --curve-every 500 --json m.json

A CPU budget on the full Fashion-MNIST set (deep2 about 0.45 s/iter, TICK 0.35 on one thread, deep2_solve 0.47 on
two; then 2,000 more iterations at lr 0.0025 with ``--init-from DIR --save DIR2 --iters 2000 --lr 0.0025``):

    python benchmarks/convgp_mnist.py --threads 1 --datasets fashion --models deep2,tick --M 100 --M-deep 50,100 \
        --iters 8000 --lr 0.01 --anneal-every 6000 --curve-every 2000 --save DIR --json f.json

gives, on all 10,000 test images (accuracy / test LL) after 8,000 and then 10,000 iterations: TICK (M = 100) 0.845
/ -0.832 and 0.843 / -0.805; deep2 0.862 / -0.725 and 0.864 / -0.702; deep2_solve (the same command with
``--models deep2_solve --threads 2``) 0.868 / -0.710 and 0.865 / -0.657. None had converged (the paper trains
300,000 iterations).

On a GPU (``--device cuda``; one H200, float32, two runs sharing it): deep2 0.039 s/iter, 8,000 iterations reach
0.861 / -0.741 on the 10,000 test images; deep2_solve 0.078 s/iter, and on all 10,000 test images at 1K/2K/3K/4K/5K
iterations 0.814 / 0.828 / 0.843 / 0.849 / 0.846 against deep2's 0.789 / 0.820 / 0.828 / 0.835 / 0.840 (test LL
-0.94 / -0.89 / -0.86 / -0.81 / -0.78 against -1.07 / -0.86 / -0.88 / -0.90 / -0.82):

    python benchmarks/convgp_mnist.py --device cuda --threads 2 --datasets fashion --models deep2_solve --M 100 \
        --M-deep 50,100 --iters 8000 --lr 0.01 --anneal-every 6000 --curve-every 1000 --curve-n 10000 --json g.json

Rows: ``{"dataset", "model", "M", "accuracy", "test_ll", "s_per_iter"}``; the table adds the peak memory per step
(``torch.cuda.max_memory_allocated`` on a GPU, the process's resident set on CPU) and, for reference, the paper's
0.241 s/iter for conv SVGP (M = 1000, |B| = 64, one GPU, CIFAR-10: 784 patches of 5x5x3; here 576 of 5x5).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyro
import torch
from pyro.contrib.gp.kernels import RBF

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _classification_data import _idx, stratified_split  # noqa: E402
from _common import parser, setup, table, write_json  # noqa: E402

import pyro_sparsegp as ps  # noqa: E402
from pyro_sparsegp.conv import build_deep_conv_gp, log_likelihood_and_accuracy  # noqa: E402
from pyro_sparsegp.inducing import init_patches, kmeans  # noqa: E402
from pyro_sparsegp.infer import fit  # noqa: E402

IMG = (28, 28, 1)
KEYS = ("dataset", "model", "M", "accuracy", "test_ll", "s_per_iter")
EXTRA = ("peak_mem_MB", "curve")  # beside the keys: memory per step, test metrics during training
PAPER_S_PER_ITER = 0.241  # conv SVGP, M = 1000, |B| = 64, one GPU (Shi et al. 2020, table 8)


def data_root() -> Path:
    """``shared/data`` beside the checkout (``/work/shared/data`` for a worktree under ``/work/wt``)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    raise FileNotFoundError("no shared/data directory above this benchmark")


def load(name, quick, rng, test_n=2000):
    """``(Xtr, ytr, Xte, yte)`` (module docstring); ``quick``: 8,000 training images and ``test_n`` test images
    (stratified; all 10,000 Fashion-MNIST test images for ``test_n >= 10000``)."""
    DATA = data_root()
    if name == "mnist":
        d = DATA / "mnist" / "gpflow_partial"
        X = _idx(d / "t10k-images-idx3-ubyte.gz").reshape(10000, -1) / 255.0
        y = _idx(d / "t10k-labels-idx1-ubyte.gz").astype(float)
        tr, te = stratified_split(y, 0.8, rng)
        Xtr, ytr, Xte, yte = X[tr], y[tr], X[te], y[te]
    else:
        d = DATA / "fashion_mnist"
        Xtr = _idx(d / "train-images-idx3-ubyte.gz").reshape(-1, 784) / 255.0
        ytr = _idx(d / "train-labels-idx1-ubyte.gz").astype(float)
        Xte = _idx(d / "t10k-images-idx3-ubyte.gz").reshape(-1, 784) / 255.0
        yte = _idx(d / "t10k-labels-idx1-ubyte.gz").astype(float)
        if quick:  # stratified subsets of the official split
            a, _ = stratified_split(ytr, 8000 / len(ytr), rng)
            b = stratified_split(yte, test_n / len(yte), rng)[0] if test_n < len(yte) else np.arange(len(yte))
            Xtr, ytr, Xte, yte = Xtr[a], ytr[a], Xte[b], yte[b]
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.get_default_dtype())  # noqa: E731
    return t(Xtr), t(ytr), t(Xte), t(yte)


def patch_kernel(d, args):
    return RBF(d, variance=torch.tensor(args.variance), lengthscale=torch.tensor(args.lengthscale))


def build(model, Xtr, M, args):
    """The model (a module with ``model``/``guide``) and a predictive function ``X -> probs [S, N, K]``."""
    lik = ps.RobustMax(10)
    if model == "rbf":
        Z = kmeans(Xtr[torch.randperm(len(Xtr))[: 20 * M]], M)
        gp = ps.SVGP(RBF(784, variance=torch.tensor(5.0), lengthscale=torch.tensor(5.0)), Z, lik, num_outputs=10,
                     whiten=True, integrate_f=True)
    elif model in ("conv", "conv_solve", "tick"):
        kern_cls = ps.TICK if model == "tick" else ps.ConvKernel
        kw = {"location_lengthscale": args.location_lengthscale} if model == "tick" else {}
        k = kern_cls(patch_kernel(25, args), IMG, 5, 1, **kw)
        n_init = 2 * M if model == "conv_solve" else M
        P = init_patches(Xtr, IMG, 5, n_init, per_centre=args.per_centre)
        if model == "tick":
            Z = ps.IndexedInducingPatches(P, grid=k.grid)
        else:
            Z = ps.InducingPatches(P[:M])
        if model == "conv_solve":
            gp = ps.SOLVEGP(k, Z, ps.InducingPatches(P[M:]), lik, num_outputs=10, whiten=True, integrate_f=True)
        else:
            gp = ps.SVGP(k, Z, lik, num_outputs=10, whiten=True, integrate_f=True)
    elif model in ("conv_rbf", "tick_rbf"):
        # van der Wilk et al. 2017's "wconv + RBF" (TICK + RBF for tick_rbf): f = f_conv + f_rbf, u = (M
        # inducing patches of f_conv, M inducing images of f_rbf), one full q(u) per class over both
        tick = model == "tick_rbf"
        kw = {"location_lengthscale": args.location_lengthscale} if tick else {}
        kc = (ps.TICK if tick else ps.ConvKernel)(patch_kernel(25, args), IMG, 5, 1, **kw)
        P = init_patches(Xtr, IMG, 5, M, per_centre=args.per_centre)
        Zc = ps.IndexedInducingPatches(P, grid=kc.grid) if tick else ps.InducingPatches(P)
        Zr = kmeans(Xtr[torch.randperm(len(Xtr))[: 20 * M]], M)
        k = ps.SumKernel(kc, RBF(784, variance=torch.tensor(5.0), lengthscale=torch.tensor(5.0)))
        gp = ps.SVGP(k, ps.InducingSum(Zc, Zr), lik, num_outputs=10, whiten=True, integrate_f=True)
    elif model in DEEP:  # Shi et al. (2020) table 5; M = (hidden, output) inducing patches per layer
        depth, solve = DEEP[model]
        gp = build_deep_conv_gp(Xtr, IMG, 10, num_layers=depth + 1, solve=solve, num_inducing=M, likelihood=lik,
                                variance=args.variance, lengthscale=args.lengthscale,
                                location_lengthscale=args.location_lengthscale, per_centre=args.per_centre,
                                num_samples=args.particles)
        return gp, lambda X: gp.predict_proba(X, num_samples=args.samples, batch_size=args.eval_batch)
    else:
        raise KeyError(model)

    def predict(X):
        out = []
        with torch.no_grad():
            for s in range(0, len(X), args.eval_batch):
                out.append(gp.predict(X[s : s + args.eval_batch], full=True)[2].probs)
        return torch.cat(out, -2)

    return gp, predict

DEEP = {"deep2": (1, False), "deep2_solve": (1, True), "deep3": (2, False), "deep3_solve": (2, True)}
ALIASES = {"deep": "deep2", "deep_solve": "deep2_solve"}  # the rows' names before the 3-layer models


def memory_mb():
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def train(gp, Xtr, ytr, args, on_step):
    """``fit`` (the package's training loop) on the model's closed-form estimator (``analytic_elbo``: no sampling
    for the single-layer models, the expected log-likelihoods by Gauss-Hermite quadrature; the deep ones propagate
    ``--particles`` samples through the hidden layers' marginals), Adam at ``--lr``, annealed x0.25 every
    ``--anneal-every`` iterations as in Shi et al. (appendix G.2): one ``fit`` call per stage (Adam's moments
    restart with each stage)."""
    done, lr = 0, args.lr
    while done < args.iters:
        n = min(args.anneal_every, args.iters - done)
        offset = done
        fit(gp, Xtr, ytr, num_steps=n, batch_size=args.batch, lr=lr, natgrad=args.natgrad, seed=1 + done,
            progress=False, callback=lambda step, loss, o=offset: on_step(o + step, loss))
        done, lr = done + n, lr * 0.25


def run(dataset, model, M, data, args):
    Xtr, ytr, Xte, yte = data
    pyro.set_rng_seed(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    gp, predict = build(model, Xtr, M, args)
    if args.init_from:  # continue from a saved run's parameters (Adam's moments restart)
        gp.load_state_dict(torch.load(Path(args.init_from) / f"{dataset}_{model}.pt"))
    N = len(Xtr)
    state = {"mem": 0.0, "losses": [], "t": time.perf_counter(), "eval": 0.0, "curve": []}

    def on_step(it, loss):
        state["losses"].append(loss / N)
        state["mem"] = max(state["mem"], memory_mb())
        if it % args.log_every == 0 or it == args.iters:
            t_train = time.perf_counter() - state["t"] - state["eval"]
            msg = (f"#   {dataset} {model} it {it}: loss/N {np.mean(state['losses'][-args.log_every:]):.4f}, "
                   f"{t_train / it:.3f} s/iter, peak memory {state['mem']:.0f} MB")
            if args.curve_every and it % args.curve_every == 0:
                t0 = time.perf_counter()
                ll, acc = log_likelihood_and_accuracy(predict(Xte[: args.curve_n]), yte[: args.curve_n])
                state["eval"] += time.perf_counter() - t0
                state["curve"].append({"iter": it, "accuracy": acc, "test_ll": ll, "train_s": t_train})
                msg += f", test acc {acc:.4f} / LL {ll:.3f} on {min(args.curve_n, len(Xte))} test images"
            print(msg, flush=True)

    train(gp, Xtr, ytr, args, on_step)
    t_train = time.perf_counter() - state["t"] - state["eval"]
    if args.save:  # the trained parameters, for a later evaluation or a longer run (--init-from)
        Path(args.save).mkdir(parents=True, exist_ok=True)
        torch.save(gp.state_dict(), Path(args.save) / f"{dataset}_{model}.pt")
    t0 = time.perf_counter()
    ll = acc = float("nan")
    if not args.timing_only:
        ll, acc = log_likelihood_and_accuracy(predict(Xte), yte)
    Mn = f"{M[0]},{M[1]}" if isinstance(M, tuple) else M
    if model in ("conv_solve", "conv_rbf", "tick_rbf"):
        Mn = f"{M}+{M}"
    if model in DEEP:
        hidden = ",".join([f"{M[0]}+{M[0]}" if DEEP[model][1] else f"{M[0]}"] * DEEP[model][0])
        Mn = f"{hidden},{M[1]}+{M[1]}" if DEEP[model][1] else f"{hidden},{M[1]}"
    return {"dataset": dataset, "model": model, "M": Mn, "accuracy": acc, "test_ll": ll,
            "s_per_iter": t_train / args.iters, "peak_mem_MB": state["mem"], "eval_s": time.perf_counter() - t0,
            "curve": state["curve"]}


def _natgrad_arg(v: str):
    """``--natgrad``: ``None`` for "none", "auto", or a step length in (0, 1]."""
    if v in ("none", "auto"):
        return None if v == "none" else v
    try:
        length = float(v)
    except ValueError:
        length = float("nan")
    if not 0.0 < length <= 1.0:
        raise argparse.ArgumentTypeError(f"--natgrad takes 'none', 'auto' or a step length in (0, 1], got {v!r}")
    return length


def main():
    p = parser(__doc__)
    p.add_argument("--datasets", default="mnist,fashion")
    p.add_argument("--models", default="rbf,conv,conv2M,conv_solve,tick,deep2,deep2_solve",
                   help=f"comma-separated; deep models: {','.join(DEEP)} ('deep', 'deep_solve': deep2, deep2_solve)")
    p.add_argument("--M", type=int, default=None, help="inducing patches (single layer); default 1000, quick 100")
    p.add_argument("--M-deep", default=None, help="hidden,output inducing patches; default 384,1000, quick 50,100")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--anneal-every", type=int, default=50_000, help="lr x0.25 every this many iterations")
    p.add_argument("--lengthscale", type=float, default=1.0,
                   help="patch RBF lengthscale (the paper's 5 is for its unstated pixel scale; ours is [0, 1])")
    p.add_argument("--variance", type=float, default=5.0)
    p.add_argument("--location-lengthscale", type=float, default=3.0)
    p.add_argument("--per-centre", type=int, default=100, help="k-means on M x this many patches")
    p.add_argument("--particles", type=int, default=1, help="samples propagated per training step (deep models)")
    p.add_argument("--samples", type=int, default=5, help="propagated samples for deep-model prediction")
    p.add_argument("--eval-batch", type=int, default=250)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--curve-every", type=int, default=0,
                   help="test accuracy / LL on the first --curve-n test images every this many iterations (0: off)")
    p.add_argument("--curve-n", type=int, default=1000)
    p.add_argument("--timing-only", action="store_true",
                   help="seconds per iteration only: no test evaluation (accuracy and test_ll are NaN)")
    p.add_argument("--float64", action="store_true")
    p.add_argument("--test-n", type=int, default=2000, help="--quick: test images (10000: all of Fashion-MNIST's)")
    p.add_argument("--save", default=None, help="folder: each trained model's state_dict, DATASET_MODEL.pt")
    p.add_argument("--init-from", default=None, help="folder of --save: start each model from its saved parameters")
    p.add_argument("--natgrad", default="none", type=_natgrad_arg,
                   help="q(u)'s step: 'none' (Adam on every parameter, the paper's recipe), 'auto' (fit's natural-"
                        "gradient policy) or a length (natural steps on the output layer)")
    args = p.parse_args()
    setup(args)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_default_dtype(torch.float64 if args.float64 else torch.float32)
    M = args.M or (100 if args.quick else 1000)
    Md = tuple(int(v) for v in (args.M_deep or ("50,100" if args.quick else "384,1000")).split(","))
    args.iters = args.iters or (150 if args.quick else 300_000)
    args.lr = args.lr or (0.01 if args.quick else 0.003)
    rows = []
    for dataset in args.datasets.split(","):
        data = load(dataset, args.quick, np.random.default_rng(0), args.test_n)
        print(f"# {dataset}: {len(data[0])} train / {len(data[2])} test images", flush=True)
        for model in (ALIASES.get(m, m) for m in args.models.split(",")):
            m = Md if model in DEEP else {"conv2M": 2 * M, "rbf2M": 2 * M}.get(model, M)
            row = run(dataset, {"conv2M": "conv", "rbf2M": "rbf"}.get(model, model), m, data, args)
            rows.append(row)
            print(table([row], [k for k in row if k != "curve"]), flush=True)
            # after every row: a partial run counts
            write_json(args.json, [{k: r[k] for k in KEYS + EXTRA} for r in rows])
    for r in rows:
        r["paper_conv_s_per_iter"] = PAPER_S_PER_ITER
        r["ratio_to_paper"] = r["s_per_iter"] / PAPER_S_PER_ITER
    print("\n" + table(rows, [k for k in rows[0] if k != "curve"]))
    write_json(args.json, [{k: r[k] for k in KEYS + EXTRA} for r in rows])


if __name__ == "__main__":
    main()
