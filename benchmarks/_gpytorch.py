"""The GPyTorch baselines of every benchmark, built one way: one ``ApproximateGP`` builder (:func:`approximate_gp`),
the two optimiser recipes (:func:`optimizers`: Adam on everything, or GPyTorch's NGD recipe), the training loop of
GPyTorch's examples (:func:`train`) and evaluation in eval mode (:func:`evaluate`).

GPyTorch is imported inside the functions, so a script imports this module without it (a run of our methods only
needs no GPyTorch)."""

from __future__ import annotations

import torch

# the variational distribution kinds by name (a GPyTorch class is taken as it is)
DISTRIBUTIONS = {"cholesky": "CholeskyVariationalDistribution", "natural": "NaturalVariationalDistribution",
                 "meanfield": "MeanFieldVariationalDistribution"}
MEANS = ("zero", "constant", "linear")


def approximate_gp(Z: torch.Tensor, *, mean: str = "zero", latents: int | None = None, tasks: int | None = None,
                   lmc: bool = False, strategy=None, distribution="cholesky", mean_inducing: torch.Tensor | None = None,
                   learn_inducing: bool = True, lengthscale: float | torch.Tensor | None = None,
                   outputscale: float | None = None, shared_kernel: bool = False):
    """GPyTorch's ``ApproximateGP`` as its docs build it: a ``strategy`` (a class; default ``VariationalStrategy``,
    e.g. ``LargeBatchVariationalStrategy``) over the inducing inputs ``Z [M, D]`` (learnt unless
    ``learn_inducing=False``; GPyTorch copies ``Z``) with a q(u) of kind ``distribution`` (``"cholesky"``,
    ``"natural"`` for the NGD recipe, ``"meanfield"``, or a GPyTorch class), ``ScaleKernel(RBFKernel(ard))`` and a
    ``mean`` of ``"zero"``, ``"constant"`` or ``"linear"``.

    * ``lengthscale``, ``outputscale``: the kernel's start (None: GPyTorch's own, softplus(0) = 0.693 for both).
    * ``mean_inducing`` ``[M2, D]``: the ``OrthogonallyDecoupledVariationalStrategy`` around the strategy, its mean
      inducing inputs with a ``DeltaVariationalDistribution`` (Salimbeni et al. 2018).
    * ``latents`` = Q: Q independent GPs (batch ``[Q]`` of the q(u), mean and kernel; ``Z`` repeated), wrapped in
      ``IndependentMultitaskVariationalStrategy`` (one task per latent) or, with ``lmc``,
      ``LMCVariationalStrategy(num_tasks=tasks, num_latents=Q)`` (GPyTorch's SVGP multitask tutorial);
      ``shared_kernel``: one kernel for all Q (the batch-independent model of many groups that share
      hyperparameters, ``benchmarks/groups.py``), else one per latent.
    """
    import gpytorch

    V = gpytorch.variational
    if mean not in MEANS:
        raise ValueError(f"mean: one of {MEANS}, not {mean!r}")
    q_class = getattr(V, DISTRIBUTIONS[distribution]) if isinstance(distribution, str) else distribution
    s_class = strategy or V.VariationalStrategy
    batch = torch.Size([]) if latents is None else torch.Size([latents])
    D = Z.shape[-1]

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            Zb = Z if latents is None else Z.expand(latents, *Z.shape)
            q = q_class(Z.shape[0], batch_shape=batch)
            s = s_class(self, Zb, q, learn_inducing_locations=learn_inducing)
            if mean_inducing is not None:
                s = V.OrthogonallyDecoupledVariationalStrategy(
                    s, mean_inducing, V.DeltaVariationalDistribution(mean_inducing.shape[0], batch_shape=batch))
            if latents is not None:
                s = (V.LMCVariationalStrategy(s, num_tasks=tasks, num_latents=latents, latent_dim=-1) if lmc
                     else V.IndependentMultitaskVariationalStrategy(s, num_tasks=latents))
            super().__init__(s)
            self.mean_module = {"zero": lambda: gpytorch.means.ZeroMean(batch_shape=batch),
                                "constant": lambda: gpytorch.means.ConstantMean(batch_shape=batch),
                                "linear": lambda: gpytorch.means.LinearMean(D, batch_shape=batch)}[mean]()
            kb = torch.Size([]) if shared_kernel else batch
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=D, batch_shape=kb), batch_shape=kb)
            if lengthscale is not None:
                self.covar_module.base_kernel.lengthscale = lengthscale
            if outputscale is not None:
                self.covar_module.outputscale = outputscale

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return Model()


def optimizers(model, likelihood, num_data: int, lr: float, ngd_lr: float | None = None) -> list:
    """The optimisers of one training step, each zeroed and stepped around the backward pass (:func:`train`):
    ``ngd_lr=None``: Adam (``lr``) on every parameter of the model and the likelihood; otherwise GPyTorch's
    natural-gradient recipe (its docs example "Natural Gradient Descent with Variational Models", with a
    ``distribution="natural"`` model): ``gpytorch.optim.NGD(model.variational_parameters(), num_data, lr=ngd_lr)`` on
    q(u) and Adam (``lr``) on the hyperparameters and the likelihood."""
    import gpytorch

    if ngd_lr is None:
        return [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
    return [gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=ngd_lr),
            torch.optim.Adam([{"params": model.hyperparameters()}, {"params": likelihood.parameters()}], lr=lr)]


def train(model, likelihood, X, y, steps: int, batch_size: int, trace, opts, seed: int = 0, mll=None):
    """The loop of GPyTorch's examples: shuffled minibatches (full batch when ``batch_size >= N``), zero the
    optimisers, ``-VariationalELBO`` (or ``mll``), backward, step; ``trace.tick(final=...)`` after each step (the last
    one evaluated). Returns ``trace``."""
    import gpytorch

    mll = mll or gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(X))
    model.train()
    likelihood.train()
    g = torch.Generator().manual_seed(seed)
    perm, pos = torch.randperm(len(X), generator=g), 0
    for s in range(steps):
        if batch_size >= len(X):
            idx = slice(None)
        else:
            if pos + batch_size > len(X):
                perm, pos = torch.randperm(len(X), generator=g), 0
            idx, pos = perm[pos : pos + batch_size], pos + batch_size
        for opt in opts:
            opt.zero_grad()
        loss = -mll(model(X[idx]), y[idx])
        loss.backward()
        for opt in opts:
            opt.step()
        trace.tick(final=s == steps - 1)
    return trace


def evaluate(model, likelihood, fn):
    """``fn()`` with the model and likelihood in eval mode (back to train mode after), exact predictive variances."""
    import gpytorch

    model.eval()
    likelihood.eval()
    try:
        with gpytorch.settings.fast_pred_var(False):
            return fn()
    finally:
        model.train()
        likelihood.train()
