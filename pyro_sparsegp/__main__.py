"""The main job: fit an SVGP to the bundled UCI power-plant data, print test metrics, write a plot.

python -m pyro_sparsegp [--steps 2000] [--M 128] [--plot powerplant_svgp.png] [--float32]
"""

from __future__ import annotations

import argparse
import math
import time

import pyro
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import load_powerplant, standardize


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--M", type=int, default=128, help="number of inducing points")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--plot", default="powerplant_svgp.png")
    p.add_argument("--float32", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    dtype = torch.float32 if args.float32 else torch.float64
    torch.set_default_dtype(dtype)
    pyro.set_rng_seed(0)
    data = load_powerplant()
    Xtr, Xte, _, _ = standardize(data.X_train, data.X_test)
    ytr, yte, y_mean, y_std = standardize(data.y_train, data.y_test)
    N, D = Xtr.shape
    Z = Xtr[torch.randperm(N)[: args.M]].clone()

    gp = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), Z, ps.Gaussian(noise=0.1))
    t0 = time.perf_counter()
    state = ps.infer.fit(
        gp,
        Xtr,
        ytr,
        num_steps=args.steps,
        batch_size=args.batch,
        lr=0.02,
        natgrad=0.1,
        progress=not args.no_progress,
    )
    seconds = time.perf_counter() - t0

    mean, var, pred = gp.predict(Xte, full=True)
    # metrics in the original units (MW): RMSE, and the mean test log-likelihood per point
    rmse = ((mean - yte) * y_std).pow(2).mean().sqrt().item()
    test_ll = (pred.log_prob(yte) - math.log(y_std)).mean().item()
    print(
        f"UCI power plant (N_train={N}, N_test={len(yte)}, D={D}), SVGP M={args.M}, batch={args.batch}, "
        f"{args.steps} steps (natural gradients on q(u) and the noise, Adam on the kernel and Z) in {seconds:.1f} s, "
        f"{dtype}"
    )
    print(f"test RMSE           {rmse:.3f} MW")
    print(f"test log-likelihood {test_ll:.4f} nats per point")
    print(f"final ELBO / N      {-sum(state.losses[-50:]) / 50 / N:.4f}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
        return rmse, test_ll
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    loss = torch.tensor(state.losses) / N
    ax[0].plot(-loss, lw=0.6)
    ax[0].set(
        xlabel="step",
        ylabel="ELBO / N",
        title="training",
        ylim=(float(-loss[len(loss) // 10 :].max()) - 0.5, float(-loss.min()) + 0.1),
    )
    order = torch.argsort(yte)[::4]  # every fourth test point, sorted
    obs = (yte * y_std + y_mean)[order]
    mu = (mean * y_std + y_mean)[order]
    sd = ((var + gp.likelihood.noise.detach()).sqrt() * y_std)[order]
    ax[1].errorbar(obs, mu, yerr=2 * sd, fmt=".", ms=3, alpha=0.6, elinewidth=0.6)
    lo, hi = float(obs.min()), float(obs.max())
    ax[1].plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax[1].set(
        xlabel="observed output (MW)",
        ylabel="predicted (± 2 sd)",
        title=f"test set: RMSE {rmse:.2f} MW, log-lik {test_ll:.3f}",
    )
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")
    return rmse, test_ll


if __name__ == "__main__":
    main()
