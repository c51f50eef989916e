r"""Inference of the latent points of new rows for :class:`~pyro_sparsegp.layers.gplvm.GPLVM`, and its helpers: the
encoder's inputs, a default encoder, the PCA start.

For a new row ``y*`` ``[D]`` (``NaN`` where not observed) the GP, ``q(u)`` and the likelihood are frozen and
``q(x*) = N(mu*, diag sigma*^2)`` maximises the row's own bound,

.. math:: \mathbb{E}_{q(x^*)}\sum_{d\ \rm observed}\mathbb{E}_{q(f_d\mid x^*)}\log p(y^*_d\mid f_d)
   - \mathrm{KL}[q(x^*)\,\|\,N(0, I)],

the term that row would add to the training bound (Titsias and Lawrence 2010 infer a test point's latent
the same way). It starts at the encoder's ``q(x*)`` (amortised guide; the refinement corrects the encoder's
amortisation gap) or, without one, at the best of a few candidate points (the inducing inputs, the
origin, up to 256 training means) by the expected log-likelihood of the observed entries plus the prior's log
density, and takes ``steps`` Adam steps on ``(mu*, log sigma*)``. Rows are independent and Adam acts element-wise,
so chunks of rows are optimised separately with the same result.
"""

from __future__ import annotations

import math

import torch

from ..checks.inputs import as_tensor, check_missing
from ..context.composition import sampled_attributes
from .outputs import masked_sum, targets

__all__ = ["LatentInference", "encoder_inputs", "mlp_encoder", "pca_init", "kl_standard_normal"]

_CHUNK = 2**23  # elements of the [D, M, rows] projection per chunk of rows


def kl_standard_normal(loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``KL[N(loc, scale^2) || N(0, 1)]`` element-wise (closed form), same shape as ``loc`` and ``scale``: the
    latents' KL of the Bayesian GPLVM bound (Titsias and Lawrence 2010)."""
    return 0.5 * (loc.pow(2) + scale.pow(2) - 1.0) - scale.log()


def encoder_inputs(y: torch.Tensor) -> torch.Tensor:
    """What the encoder reads: ``y`` ``[..., B, D]`` with ``NaN`` as 0, then the observed mask (1.0 / 0.0):
    ``[..., B, 2 D]`` (the recognition model's input, Bui and Turner 2015, for the GPLVM of Titsias and Lawrence
    2010)."""
    missing = torch.isnan(y)
    return torch.cat([y.masked_fill(missing, 0.0), (~missing).to(y.dtype)], -1)


def mlp_encoder(Y_dim: int, latent_dim: int, hidden=(128,), scale: float = 0.1) -> torch.nn.Sequential:
    """A multilayer perceptron ``[..., B, 2 D] -> [..., B, 2 Q]`` (``tanh`` hidden layers of the widths ``hidden``)
    for :class:`GPLVM`'s ``encoder``; its scales start near ``scale`` (the last layer's bias). A recognition model
    as in Bui and Turner 2015 for the GPLVM of Titsias and Lawrence 2010 (a back-constraint, Lawrence and
    Quiñonero-Candela 2006)."""
    sizes, layers = [2 * Y_dim, *hidden], []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    last = torch.nn.Linear(sizes[-1], 2 * latent_dim)
    with torch.no_grad():
        last.weight.mul_(0.1)
        last.bias.zero_()
        last.bias[latent_dim:] = math.log(math.expm1(scale))  # softplus^{-1}(scale)
    return torch.nn.Sequential(*layers, last).to(torch.get_default_dtype())


def pca_init(Y, latent_dim: int) -> torch.Tensor:
    """The first ``Q = latent_dim`` principal-component scores of ``Y`` ``[N, D]`` (``NaN`` entries filled with their
    column's mean), each scaled to unit variance, the prior's: ``[N, Q]``, the usual start of the latent means
    (as Titsias and Lawrence 2010 start them)."""
    Y = as_tensor(Y, "Y")
    Y = torch.where(torch.isnan(Y), Y.nanmean(0), Y)
    Yc = Y - Y.mean(0)
    U, S, _ = torch.linalg.svd(Yc, full_matrices=False)
    X = U[:, :latent_dim] * S[:latent_dim]
    return X / X.std(0).clamp_min(1e-12)


class LatentInference:
    """Mixin of :class:`~pyro_sparsegp.layers.gplvm.GPLVM`: :meth:`infer_latent` and :meth:`reconstruct` for new
    rows ``Y_new`` ``[N*, D]`` (module docstring: a test point's latent as in Titsias and Lawrence 2010)."""

    def expected_log_lik(self, y, loc, scale, num_samples: int = 1) -> torch.Tensor:
        """``sum_n E_{q(x_n)} sum_{d observed} E_{q(f_nd | x_n)} log p(y_nd | f_nd)`` ``()`` for ``y`` ``[B, D]`` and
        ``q(x)`` ``(loc, scale)`` ``[B, Q]``, by ``S = num_samples`` reparameterised draws of ``x`` (the GP's marginals
        in closed form given ``x``: Hensman, Matthews, Ghahramani 2015, eq. 19). Leaves the GP's factors cached for
        ``gp.kl_divergence(consume=True)``."""
        x = loc + scale * torch.randn((num_samples,) + loc.shape, dtype=loc.dtype, device=loc.device)
        f_loc, f_var = self.gp.qf(x.reshape(-1, self.latent_dim))  # [D, S B]
        yt, mask = targets(y, True)  # [D, B]
        yt = yt.repeat(1, num_samples)
        mask = None if mask is None else mask.repeat(1, num_samples)
        return masked_sum(self.likelihood.expected_log_prob(yt, f_loc, f_var), mask) / num_samples

    def _new_rows(self, Y_new) -> torch.Tensor:
        if sampled_attributes(self, names=False):
            raise ValueError("infer_latent needs fixed hyperparameters, and this GPLVM has a PyroSample (a "
                             "hyperprior): read outside a trace it would be a draw from its prior; condition the model "
                             "on values (poutine.condition) or infer x* inside your own program")
        Y = as_tensor(Y_new, "Y_new", self.gp.Z.dtype, self.gp.Z.device)
        if Y.dim() != 2 or Y.shape[-1] != self.Y_dim:
            raise ValueError(f"Y_new must be [N*, D] with D = {self.Y_dim}, got {tuple(Y.shape)}")
        check_missing(Y)
        return Y

    def _chunk(self, batch_size, samples: int) -> int:
        rows = max(1, _CHUNK // (self.Y_dim * self.num_inducing * samples))
        return rows if batch_size is None else int(batch_size)

    @torch.no_grad()
    def _start(self, y: torch.Tensor):
        """``(loc, scale)`` ``[B, Q]``: the encoder's ``q(x*)``, or the best candidate point per row (module
        docstring) with the initial scale."""
        if self.encoder is not None:
            return self.q_x(None, y)
        cands = [self.gp.Z, torch.zeros(1, self.latent_dim, dtype=y.dtype, device=y.device)]
        step = max(1, self.num_data // 256)
        cands.append(self.x_loc[::step][:256])
        C = torch.cat(cands)  # [C, Q]
        f_loc, f_var = self.gp.qf(C)  # [D, C]
        self.gp.strategy.clear()
        yt, mask = targets(y, True)  # [D, B]
        ell = self.likelihood.expected_log_prob(yt.unsqueeze(-1), f_loc.unsqueeze(-2), f_var.unsqueeze(-2))
        if mask is not None:
            ell = torch.where(mask.unsqueeze(-1), ell, torch.zeros((), dtype=ell.dtype, device=ell.device))
        score = ell.sum(0) - 0.5 * C.pow(2).sum(-1)  # [B, C]
        loc = C[score.argmax(-1)]
        return loc, torch.full_like(loc, min(self._x_scale0, 1.0))

    def infer_latent(self, Y_new, steps: int = 50, lr: float = 0.05, num_samples: int = 1,
                     batch_size: int | None = None):
        """``q(x*)`` of new rows ``Y_new`` ``[N*, D]`` (``NaN`` where not observed) with the GP frozen: the encoder's
        output (or the best candidate point) refined by ``steps`` Adam steps of rate ``lr`` on each row's bound with
        ``num_samples`` draws of ``x*`` (module docstring). ``batch_size``: rows per chunk (default: as many as keep
        the ``[D, M, rows]`` projection within 2^23 elements). Returns ``(mean, var)``, each ``[N*, Q]``. The
        test-point inference of Titsias and Lawrence 2010, started at the encoder's output."""
        Y = self._new_rows(Y_new)
        chunk = self._chunk(batch_size, num_samples)
        means, variances = [], []
        for i in range(0, Y.shape[0], chunk):
            y = Y[i : i + chunk]
            loc0, scale0 = self._start(y)
            loc, log_s = loc0.clone().requires_grad_(True), scale0.log().clone().requires_grad_(True)
            opt = torch.optim.Adam([loc, log_s], lr=lr)
            for _ in range(steps):
                s = log_s.exp()
                bound = self.expected_log_lik(y, loc, s, num_samples) - kl_standard_normal(loc, s).sum()
                self.gp.strategy.clear()
                loc.grad, log_s.grad = torch.autograd.grad(-bound, [loc, log_s])
                opt.step()
            means.append(loc.detach())
            variances.append(log_s.detach().exp().pow(2))
        return torch.cat(means), torch.cat(variances)

    @torch.no_grad()
    def reconstruct(self, Y_new, steps: int = 50, lr: float = 0.05, num_samples: int = 32,
                    batch_size: int | None = None, latent=None):
        """The predictive mean and variance of ``y*`` ``[N*, D]`` for new rows ``Y_new`` ``[N*, D]`` (``NaN`` where
        not observed: the entries to predict), under ``q(x*)`` from :meth:`infer_latent` (``steps``, ``lr``) or the
        given ``latent = (mean, var)`` ``[N*, Q]``: ``num_samples`` draws of ``x*``, the GP's ``q(f* | x*)`` at each,
        moments matched (``E[f*]`` and ``Var[f*]``, plus the noise of a Gaussian likelihood). Returns
        ``(mean, var)``, each ``[N*, D]``: the predictive of Titsias and Lawrence 2010, by sampling."""
        if latent is None:
            with torch.enable_grad():
                latent = self.infer_latent(Y_new, steps=steps, lr=lr)
        x_mean, x_var = latent
        chunk = self._chunk(batch_size, num_samples)
        means, variances = [], []
        for i in range(0, x_mean.shape[0], chunk):
            m, v = x_mean[i : i + chunk], x_var[i : i + chunk]
            x = m + v.sqrt() * torch.randn((num_samples,) + m.shape, dtype=m.dtype, device=m.device)
            f_loc, f_var = self.gp.qf(x.reshape(-1, self.latent_dim))  # [D, S B]
            self.gp.strategy.clear()
            f_loc, f_var = f_loc.unflatten(-1, (num_samples, -1)), f_var.unflatten(-1, (num_samples, -1))
            mean = f_loc.mean(-2)  # [D, B]
            var = (f_var + f_loc.pow(2)).mean(-2) - mean.pow(2)
            means.append(mean.mT)
            variances.append(var.clamp_min(0.0).mT)
        mean, var = torch.cat(means), torch.cat(variances)
        noise = getattr(self.likelihood, "noise", None)
        return mean, var + (0.0 if noise is None else noise)
