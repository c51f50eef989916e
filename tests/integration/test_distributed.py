"""Data-parallel fit under torch.distributed (gloo, two processes on this machine): the ranks stay identical and
equal a single-process run whose batches are the union of the ranks' batches."""

import os
import tempfile

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer import fit

STEPS, B = 12, 32


def _setup(kind="svgp"):
    torch.set_default_dtype(torch.float64)
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    X = torch.rand(256, 2, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(256, generator=g, dtype=torch.float64)
    if kind == "solvegp":  # the joint natural-gradient step: the probe's gradient is averaged over ranks too
        gp = ps.SOLVEGP(RBF(2), X[:6].clone(), X[6:12].clone(), ps.Gaussian(0.3))
    else:
        gp = ps.SVGP(RBF(2), X[:10].clone(), ps.Gaussian(0.3))
    return X, y, gp


def _worker(rank, world, init_file, out_dir, natgrad_lr, kind):
    import pyro

    with pyro.settings.context(module_local_params=True):
        tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            X, y, gp = _setup(kind)
            if rank == 1:  # a different start: fit must broadcast rank 0's parameters
                with torch.no_grad():
                    gp.q_u.u_loc_unconstrained.add_(1.0)
            fit(
                gp,
                X,
                y,
                num_steps=STEPS,
                batch_size=B,
                lr=0.02,
                natgrad=natgrad_lr,
                elbo="analytic",
                progress=False,
                seed=5,
            )
            torch.save(gp.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
            tdist.barrier()  # no rank tears gloo down while the other is still in a collective (seen once: SIGABRT)
        finally:
            tdist.destroy_process_group()


@pytest.mark.parametrize("natgrad_lr,kind", [(None, "svgp"), (0.5, "svgp"), (0.5, "solvegp")],
                         ids=["adam", "natgrad", "natgrad-solvegp"])
def test_two_ranks_equal_one_process_with_the_union_of_their_batches(natgrad_lr, kind):
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        mp.spawn(_worker, args=(2, init_file, d, natgrad_lr, kind), nprocs=2, join=True)
        r0 = torch.load(os.path.join(d, "rank0.pt"))
        r1 = torch.load(os.path.join(d, "rank1.pt"))
    with torch.device("cpu"):  # the reference on the CPU, as the gloo ranks are (the suite's CUDA pass sets a default)
        X, y, gp = _setup(kind)
        fit(gp, X, y, num_steps=STEPS, batch_size=2 * B, lr=0.02, natgrad=natgrad_lr, elbo="analytic",
            progress=False, seed=5)
    for k, v in gp.state_dict().items():
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(r0[k], v, rtol=1e-9, atol=1e-9, msg=k)


def _worker_data(rank, world, init_file, out_dir, mode):
    """``mode="differ"``: rank 1 passes other rows (fit must refuse on both ranks); ``"loader"``: each rank trains on
    its own half through a loader with ``num_data`` = the whole size."""
    import pyro
    from torch.utils.data import DataLoader, TensorDataset

    with pyro.settings.context(module_local_params=True):
        tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            X, y, gp = _setup()
            if mode == "differ":
                if rank == 1:
                    X, y = X.flip(0), y.flip(0)  # the same points in another order
                try:
                    fit(gp, X, y, num_steps=2, batch_size=B, progress=False)
                    msg = "no error"
                except ValueError as e:
                    msg = str(e)
                with open(os.path.join(out_dir, f"msg{rank}.txt"), "w") as fh:
                    fh.write(msg)
            else:
                half = slice(rank * 128, (rank + 1) * 128)
                loader = DataLoader(TensorDataset(X[half], y[half]), batch_size=B)  # in order: reproducible
                fit(gp, loader, num_data=len(X), num_steps=STEPS, lr=0.02, natgrad=0.5, progress=False)
                torch.save(gp.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
            tdist.barrier()
        finally:
            tdist.destroy_process_group()


def test_ranks_with_different_data_are_refused_on_every_rank():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker_data, args=(2, os.path.join(d, "init"), d, "differ"), nprocs=2, join=True)
        msgs = []
        for r in (0, 1):
            with open(os.path.join(d, f"msg{r}.txt")) as fh:
                msgs.append(fh.read())
    for m in msgs:
        assert "the ranks passed different data" in m and "DataLoader as X" in m, m


def test_a_shard_per_rank_through_a_loader_equals_one_process_on_their_union():
    """Each rank's loader reads its own half (num_data = all of it): the same steps as one process whose batches
    are the union of the ranks' batches."""
    from torch.utils.data import DataLoader, TensorDataset

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker_data, args=(2, os.path.join(d, "init"), d, "loader"), nprocs=2, join=True)
        r0 = torch.load(os.path.join(d, "rank0.pt"))
        r1 = torch.load(os.path.join(d, "rank1.pt"))
    with torch.device("cpu"):  # the reference on the CPU, as the gloo ranks are
        X, y, gp = _setup()
        idx = torch.cat([torch.cat([torch.arange(i, i + B), torch.arange(128 + i, 128 + i + B)])
                         for i in range(0, 128, B)])
        loader = DataLoader(TensorDataset(X[idx], y[idx]), batch_size=2 * B)  # step t: both ranks' t-th batches
        fit(gp, loader, num_data=len(X), num_steps=STEPS, lr=0.02, natgrad=0.5, progress=False)
    for k, v in gp.state_dict().items():
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(r0[k], v, rtol=1e-9, atol=1e-9, msg=k)
