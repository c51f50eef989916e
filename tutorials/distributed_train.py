"""Data-parallel SVGP training with ``torchrun``: the script behind ``tutorials/distributed.ipynb``.

    torchrun --standalone --nproc_per_node=2 tutorials/distributed_train.py [--steps 500] [--batch 256] [--json PATH]

Each process (rank) loads the power-plant data, builds the same SVGP and calls ``ps.infer.fit``; ``fit`` sees the
initialised process group and then broadcasts rank 0's parameters, gives rank ``r`` the ``r``-th slice of every global
minibatch of ``K * batch`` points, averages the loss and the gradients over ranks (``all_reduce``) and averages the
natural parameters of ``q(u)`` after each natural-gradient step (exact: the step is linear in the data term).
The ranks therefore stay identical, and equal one process that trains on the union of their batches.

Rank 0 then checks both claims: it gathers every rank's parameters and reports the largest difference between ranks,
and (after the process group is torn down) repeats the fit in a single process with minibatches of ``K * batch`` and
reports the largest difference to the data-parallel result. It prints test metrics and, with ``--json``, writes them
with both loss traces. ``gloo`` runs on CPUs; on GPUs use ``nccl`` and move the data to ``cuda:LOCAL_RANK``.
With the environment variable ``CI`` or ``PYRO_SPARSEGP_SMOKE`` set, the default is 20 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import pyro
import torch
import torch.distributed as tdist
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.datasets import load_powerplant, standardize

SMOKE = "CI" in os.environ or "PYRO_SPARSEGP_SMOKE" in os.environ


def build(D: int, Z: torch.Tensor) -> ps.SVGP:
    """The model every rank builds: ARD RBF kernel, Gaussian likelihood, whitened q(u)."""
    return ps.SVGP(RBF(D, lengthscale=torch.ones(D)), Z, ps.Gaussian(noise=0.1))


def train(X, y, Z, args, batch_size):
    gp = build(X.shape[1], Z)
    t0 = time.perf_counter()
    # elbo="analytic": the closed-form bound on each minibatch (no sampling), so that the data-parallel and the
    # single-process runs can be compared number for number
    state = ps.infer.fit(gp, X, y, num_steps=args.steps, batch_size=batch_size, lr=0.02, natgrad=0.1,
                         elbo="analytic", progress=False, seed=0)
    return gp, state, time.perf_counter() - t0


def flat(gp) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in gp.parameters()])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20 if SMOKE else 500)
    p.add_argument("--batch", type=int, default=256, help="minibatch size per rank")
    p.add_argument("--M", type=int, default=64, help="number of inducing points")
    p.add_argument("--json", default=None, help="rank 0 writes metrics and loss traces here")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # one core per process
    torch.set_default_dtype(torch.float64)
    pyro.settings.set(module_local_params=True)  # the two models of rank 0 must not share Pyro's global store
    tdist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = tdist.get_rank(), tdist.get_world_size()

    data = load_powerplant()
    X, Xt, _, _ = standardize(data.X_train, data.X_test)
    y, yt, _, y_std = standardize(data.y_train, data.y_test)
    # whole global batches per epoch (fit drops an epoch's incomplete last global batch; one process would not),
    # so that the single-process comparison sees exactly the same minibatches
    n = (len(X) // (world * args.batch)) * world * args.batch
    X, y = X[:n], y[:n]
    Z = X[torch.randperm(n, generator=torch.Generator().manual_seed(0))[: args.M]].clone()

    gp, state, secs = train(X, y, Z, args, args.batch)
    params = flat(gp)
    gathered = [torch.empty_like(params) for _ in range(world)]
    tdist.all_gather(gathered, params)
    tdist.barrier()
    tdist.destroy_process_group()
    if rank != 0:
        return None

    between_ranks = max((g - params).abs().max().item() for g in gathered)
    single, single_state, single_secs = train(X, y, Z, args, world * args.batch)
    to_single = (flat(single) - params).abs().max().item()
    mean, var, pred = gp.predict(Xt, full=True)
    out = {
        "world_size": world,
        "steps": args.steps,
        "batch_per_rank": args.batch,
        "num_data": n,
        "seconds_data_parallel": secs,
        "seconds_single_process": single_secs,
        "max_abs_diff_between_ranks": between_ranks,
        "max_abs_diff_to_single_process": to_single,
        "test_rmse_mw": ((mean - yt) * y_std).pow(2).mean().sqrt().item(),
        "test_log_lik": (pred.log_prob(yt) - math.log(y_std)).mean().item(),
        "losses_data_parallel": state.losses,
        "losses_single_process": single_state.losses,
    }
    print(f"{world} ranks x {args.batch} points per step, {args.steps} steps, N = {n}")
    print(f"data-parallel fit       {secs:6.1f} s")
    print(f"single process (x{world} batch) {single_secs:6.1f} s")
    print(f"max |difference| between ranks             {between_ranks:.3g}")
    print(f"max |difference| to the single-process fit  {to_single:.3g}")
    print(f"test RMSE {out['test_rmse_mw']:.3f} MW, test log-likelihood {out['test_log_lik']:.4f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)
    return out


if __name__ == "__main__":
    main()
