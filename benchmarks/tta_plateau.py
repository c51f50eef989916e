"""Why ours hovers above the plateau on a large noisy set (issue 46, item 4): variants of ``fit`` on one data set of
``time_to_accuracy.py`` (same setting: split 0 standardised, M inducing inputs from the same random rows, RBF ARD
from lengthscale 1, noise 0.1, batch 1024, Adam lr 0.01), each a test-LL curve by step, beside GPyTorch's
natural-gradient recipe (the target: its final test LL) in the same run.

    PYTHONPATH=. python benchmarks/tta_plateau.py [--dataset flights] [--epochs 10] [--every 49]
        [--variants default,cool30,cool50,...] [--diagnose 147] [--seed S] [--no-peer] [--threads 1] [--json PATH]

Variants: ``default`` (``fit``'s defaults), ``coolF`` (``cooldown=F/100``: Adam's rate and the natural step lengths
decay log-linearly to a tenth over the last fraction ``F/100`` of the steps), ``nat_coolF`` / ``adam_coolF`` (the
decay on the natural steps only / on Adam only), ``ngX`` (natural step length ``X/100`` instead of 0.1),
``noise_adam`` (the noise trained by Adam, as GPyTorch does, instead of the Fisher-scoring step), ``noiseX`` (the
noise's Fisher-scoring step ``X/100`` times as long as the natural step), ``greedy`` /
``kmeans`` (the inducing inputs from ``ps.inducing.select`` under the initial kernel, its time counted as training);
``+`` joins them (``cool50+greedy``).

``--diagnose K``: every ``K`` steps also the test LL of a copy of the model whose q(u) and noise are set to their
exact optimum on all the training data given the current kernel and Z (``exact_finish_``; not timed): where that
curve is flat while the model's own hovers, the hovering is minibatch noise in q(u) and the noise, not the kernel
or Z. Rows: per variant the curve ``[[step, seconds, test_ll, noise], ...]``, the finished curve, the step and
time at which GPyTorch-NGD's final test LL is first reached (``reach_step``, ``reach_s``), from which every later
evaluation stays at or above it (``stay_step``), and ``ratio_ngd`` (``reach_s`` over GPyTorch-NGD's).
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings

import pyro
import torch
from _common import load_regression, machine_note, parser, setup, write_json
from pyro.contrib.gp.kernels import RBF
from time_to_accuracy import NOISE, Trace, metrics, run_gpytorch, select_start

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit
from pyro_sparsegp.infer.natgrad import optimizer as natgrad_optimizer
from pyro_sparsegp.infer.natgrad import policy
from pyro_sparsegp.infer.training import steps as training_steps
from pyro_sparsegp.infer.training.exact_finish import exact_finish_

B, LR = 1024, 0.01


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _options(name: str):
    """``(fit keyword arguments, start, patches)`` of a variant name (module docstring)."""
    kw, start, patches = {}, "random", []
    for part in name.split("+"):
        if part == "default":
            continue
        if part.startswith(("greedy", "kmeans")):
            start = part
        elif part == "noise_adam":  # the noise to Adam: no likelihood takes the Fisher-scoring step
            patches.append((training_steps, "noise_natgrad_likelihood", lambda module: None))
        elif part.startswith("noise") and part[5:].isdigit():  # the noise's Fisher-scoring step X/100 as long
            step, factor = natgrad_optimizer.noise_step_from_grads_, int(part[5:]) / 100
            patches.append((natgrad_optimizer, "noise_step_from_grads_",
                            lambda lik, lr, n, f=factor, step=step: step(lik, f * lr, n)))
        elif part.startswith("nat_cool"):
            kw["cooldown"] = int(part[8:]) / 100
            patches.append((policy.NatGradPlan, "adam_multiplier", lambda self, step: 1.0))
        elif part.startswith("adam_cool"):
            kw["cooldown"] = int(part[9:]) / 100
            patches.append((policy, "Cooldown", lambda schedule, *args: schedule))
        elif part.startswith("cool"):
            kw["cooldown"] = int(part[4:]) / 100
        elif part.startswith("ng"):
            kw["lr"] = int(part[2:]) / 100
        else:
            raise SystemExit(f"unknown variant {part!r} (module docstring)")
    return kw, start, patches


def run_variant(name, X, y, Xt, yt, Z, steps, every, y_std, diagnose=0, seed=0):
    kw, start, patches = _options(name)
    kernel = RBF(X.shape[1], lengthscale=torch.ones(X.shape[1]))
    clock = time.perf_counter()
    if start != "random":
        Z = select_start(X, len(Z), kernel, start)
    gp = ps.SVGP(kernel, Z.clone(), ps.Gaussian(noise=NOISE))
    finished = []

    def evaluate():
        mean, var = gp.predict(Xt)
        out = metrics(mean, var + gp.likelihood.noise.detach(), yt, y_std)
        noises.append(float(gp.likelihood.noise))
        if diagnose and trace.step % diagnose == 0:
            twin = copy.deepcopy(gp)
            exact_finish_(twin, ((X[i : i + 8192], y[i : i + 8192]) for i in range(0, len(X), 8192)))
            m2, v2 = twin.predict(Xt)
            finished.append([trace.step, metrics(m2, v2 + twin.likelihood.noise.detach(), yt, y_std)[0],
                             float(twin.likelihood.noise)])
        return out

    noises = []
    trace = Trace(evaluate, every, math.ceil(len(X) / B), start=clock)
    with contextlib.ExitStack() as stack:
        for obj, attr, value in patches:
            stack.enter_context(_patched(obj, attr, value))
        fit(gp, X, y, num_steps=steps, batch_size=B, lr=LR, progress=False, seed=seed,
            natgrad=ps.infer.NaturalPolicy(**kw),
            callback=lambda step, loss: trace.tick(final=step == steps))
    trace.close()
    return trace, noises, finished


def main():
    p = parser(__doc__)
    p.add_argument("--dataset", default="flights")
    p.add_argument("--M", type=int, default=256)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--every", type=int, default=49)
    p.add_argument("--variants", default="default,cool30,cool50")
    p.add_argument("--diagnose", type=int, default=0, help="every K steps the exactly finished copy's test LL")
    p.add_argument("--seed", type=int, default=0, help="seeds the random rows of Z and fit's minibatch order")
    p.add_argument("--no-peer", action="store_true", help="skip GPyTorch-NGD (no target, no ratios)")
    p.add_argument("--max-test", type=int, default=20000)
    args = p.parse_args()
    setup(args)
    print(machine_note(torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    X, y, Xt, yt, _, y_std = load_regression(args.dataset).standardized()
    if args.max_test and len(Xt) > args.max_test:
        keep = torch.randperm(len(Xt), generator=torch.Generator().manual_seed(0))[: args.max_test]
        Xt, yt = Xt[keep], yt[keep]
    steps = args.epochs * math.ceil(len(X) / B)
    print(f"# {args.dataset}: {len(X)} train, {len(Xt)} test evaluated, {steps} steps, M = {args.M}", flush=True)
    pyro.set_rng_seed(args.seed)
    Z = X[torch.randperm(len(X))[: args.M]]
    rows, target, peer_s = [], None, None
    if not args.no_peer:
        peer = run_gpytorch(X, y, Xt, yt, Z, steps, args.every, y_std, ngd=True)
        target = peer.points[-1][2]
        peer_s = next(c for _, c, ll, _ in peer.points if ll >= target)
        peer_step = next(s for s, _, ll, _ in peer.points if ll >= target)
        rows.append({"variant": "gpytorch_ngd", "test_ll": target, "seconds": peer.seconds, "reach_s": peer_s,
                     "reach_step": peer_step, "curve": [[s, c, ll] for s, c, ll, _ in peer.points]})
        print(f"# gpytorch_ngd: final {target:.4f}, reached at step {peer_step} ({peer_s:.1f} s), "
              f"{peer.seconds / steps * 1000:.1f} ms/step", flush=True)
        print("#   " + " ".join(f"{ll:.3f}" for _, _, ll, _ in peer.points), flush=True)
    for name in args.variants.split(","):
        pyro.set_rng_seed(args.seed)
        tr, noises, finished = run_variant(name, X, y, Xt, yt, Z, steps, args.every, y_std, args.diagnose, args.seed)
        row = {"variant": name, "test_ll": tr.points[-1][2], "seconds": tr.seconds, "setup_s": tr.setup_s,
               "curve": [[s, c, ll, nz] for (s, c, ll, _), nz in zip(tr.points, noises + [math.nan], strict=False)],
               "finished": finished}
        if target is not None:
            hit = [(s, c) for s, c, ll, _ in tr.points if ll >= target]
            row["reach_step"], row["reach_s"] = hit[0] if hit else (None, None)
            row["ratio_ngd"] = None if not hit else hit[0][1] / peer_s
            stay = None
            for s, _, ll, _ in tr.points:
                stay = None if ll < target else (s if stay is None else stay)
            row["stay_step"] = stay
        rows.append(row)
        print(f"# {name}: final {row['test_ll']:.4f}, {tr.seconds / steps * 1000:.1f} ms/step, reach step "
              f"{row.get('reach_step')} ({row.get('reach_s')}), ratio {row.get('ratio_ngd')}, stay step "
              f"{row.get('stay_step')}", flush=True)
        print("#   " + " ".join(f"{ll:.3f}" for _, _, ll, _ in tr.points), flush=True)
        print("#   noise " + " ".join(f"{nz:.3f}" for nz in noises[::4]), flush=True)
        if finished:
            print("#   finished " + " ".join(f"{s}:{ll:.3f}" for s, ll, _ in finished), flush=True)
        if args.json:
            write_json(args.json, rows)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
