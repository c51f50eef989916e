"""Time per training step of our 2-layer deep GP against GPyTorch's ``DeepGP`` in the same configuration (GPyTorch's
deep GP example: hidden width 10, M = 128 inducing points per layer and per output, a trainable linear mean in the
hidden layer and a constant mean in the last, RBF-ARD kernels, Gaussian likelihood, batch 1024, 10 samples
propagated through the hidden layer's marginals; Salimbeni & Deisenroth 2017), in float64 and float32, measured
alternately in one run. A step is: zero the gradients, the doubly stochastic ELBO estimate on the minibatch
(ours: ``DeepGP.analytic_elbo``; GPyTorch: ``DeepApproximateMLL(VariationalELBO)``), backward, one Adam step.

Rows: ``{"dtype", "ours_ms", "gpytorch_ms", "ratio", "ours_min_ms", "gpytorch_min_ms"}`` with ``ratio`` = ours /
GPyTorch (medians). Target: ratio <= 0.7 on CPU.

    python benchmarks/deepgp_speed.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_note, parser, setup, table, time_alternating_stats, write_json  # noqa: E402

import pyro_sparsegp as ps  # noqa: E402
from pyro_sparsegp import DeepGP  # noqa: E402
from pyro_sparsegp.mean_functions import Constant, Linear  # noqa: E402

WIDTH, M, BATCH, SAMPLES, N = 10, 128, 1024, 10, 10_000


def ours(X, Z0, Z1):
    from pyro.contrib.gp.kernels import RBF

    D = X.shape[-1]
    hidden = ps.SVGP(RBF(D, lengthscale=torch.ones(D)), Z0, num_outputs=WIDTH, name="hidden",
                     mean_function=Linear(D, WIDTH))
    last = ps.SVGP(RBF(WIDTH, lengthscale=torch.ones(WIDTH)), Z1, ps.Gaussian(), name="last",
                   mean_function=Constant(1))
    return DeepGP([hidden, last], num_samples=SAMPLES)


def gpytorch_dgp(Z0, Z1):
    import gpytorch
    from gpytorch.models.deep_gps import DeepGP as GDeepGP
    from gpytorch.models.deep_gps import DeepGPLayer

    class Layer(DeepGPLayer):
        def __init__(self, Z, output_dims, linear):
            batch = torch.Size([]) if output_dims is None else torch.Size([output_dims])
            q = gpytorch.variational.CholeskyVariationalDistribution(M, batch_shape=batch)
            s = gpytorch.variational.VariationalStrategy(self, Z, q, learn_inducing_locations=True)
            super().__init__(s, Z.shape[-1], output_dims)
            D = Z.shape[-1]
            means = gpytorch.means
            self.mean_module = means.LinearMean(D) if linear else means.ConstantMean(batch_shape=batch)
            rbf = gpytorch.kernels.RBFKernel(batch_shape=batch, ard_num_dims=D)
            self.covar_module = gpytorch.kernels.ScaleKernel(rbf, batch_shape=batch)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    class Model(GDeepGP):
        def __init__(self):
            super().__init__()
            self.hidden = Layer(Z0, WIDTH, True)
            self.last = Layer(Z1, None, False)
            self.likelihood = gpytorch.likelihoods.GaussianLikelihood()

        def forward(self, x):
            return self.last(self.hidden(x))

    return Model()


def measure(dtype, dim: int, repeats: int) -> dict:
    """One row: the median (and minimum) time per step of both models in ``dtype``, measured alternately."""
    import gpytorch

    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    X = torch.randn(N, dim)
    y = torch.sin(X.sum(-1))
    Z0 = X[torch.randperm(N)[:M]].expand(WIDTH, M, dim).clone()  # per-output inducing inputs, as GPyTorch
    Z1 = torch.randn(M, WIDTH)
    a = ours(X, Z0, Z1)
    b = gpytorch_dgp(Z0.clone(), Z1.clone())
    mll = gpytorch.mlls.DeepApproximateMLL(gpytorch.mlls.VariationalELBO(b.likelihood, b, N))
    opt_a = torch.optim.Adam(a.parameters(), lr=0.01)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(N, (BATCH,), generator=g, device="cpu")
        return X[idx], y[idx]

    def step_ours():
        Xb, yb = batch()
        opt_a.zero_grad(set_to_none=True)
        loss = -a.analytic_elbo(Xb, yb, num_data=N)
        loss.backward()
        opt_a.step()

    def step_gpytorch():
        Xb, yb = batch()
        opt_b.zero_grad(set_to_none=True)
        with gpytorch.settings.num_likelihood_samples(SAMPLES):
            loss = -mll(b(Xb), yb)
        loss.backward()
        opt_b.step()

    stats = time_alternating_stats({"ours": step_ours, "gpytorch": step_gpytorch}, repeats)
    return {"dtype": str(dtype).replace("torch.", ""), "ours_ms": stats["ours"]["median"],
                 "gpytorch_ms": stats["gpytorch"]["median"],
                 "ratio": stats["ours"]["median"] / stats["gpytorch"]["median"],
                 "ours_min_ms": stats["ours"]["min"], "gpytorch_min_ms": stats["gpytorch"]["min"]}


def main():
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per contender (default 20; --quick 5)")
    p.add_argument("--dim", type=int, default=8, help="input dimension D")
    args = p.parse_args()
    setup(args)
    print(machine_note(args.threads))
    repeats = args.repeats or (5 if args.quick else 20)
    rows = []
    for dtype in (torch.float64, torch.float32):
        rows.append(measure(dtype, args.dim, repeats))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(f"# 2-layer DGP, width {WIDTH}, M = {M} per layer (per output), batch {BATCH}, {SAMPLES} samples, "
          f"D = {args.dim}, {repeats} steps each, alternating")
    print(table(rows, list(rows[0])))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
