"""Dense references for layers of several outputs (independent or LMC): the latents' ``q(g_q)`` from plain matrices
built with Pyro's own 2-D kernel calls, the outputs' ``q(f)`` through ``W``, and the bound summed over the observed
entries only, with closed forms / fine NumPy Gauss-Hermite written here (independent of the package's code)."""

import math

import numpy as np
import torch

import pyro_sparsegp as ps


def _kernels(gp, Q):
    k = gp.kernel
    return list(k.kernels) if isinstance(k, ps.kernels.Separate) else [k] * Q


def latent_q(gp, X):
    """``(mean [Q, N], cov [Q, N, N], kl [Q])`` of the layer's independent GPs (its ``Q`` latents, or its ``L``
    outputs) at ``X`` ``[N, D]``: ``q(g_q) = int p(g_q | u_q) q(u_q) du_q`` and ``KL[q(u_q) || p(u_q)]``."""
    Q = gp.num_latent_gps
    Z = gp.Z if gp.Z.dim() == 3 else gp.Z.expand(Q, *gp.Z.shape)
    means, covs, kls = [], [], []
    for q, k in enumerate(_kernels(gp, Q)):
        Kuu, Kuf, Kff = k(Z[q]).detach(), k(Z[q], X).detach(), k(X).detach()
        m, S = gp.q_u.u_loc[q].detach(), gp.q_u.u_scale_tril[q].detach()
        S = S @ S.T
        M = Kuu.shape[0]
        if gp.whiten:
            A = torch.linalg.solve_triangular(torch.linalg.cholesky(Kuu), Kuf, upper=False)  # Luu^-1 Kuf
            cov = Kff - A.T @ A + A.T @ S @ A
            kl = 0.5 * (torch.trace(S) + m @ m - M - torch.logdet(S))
        else:
            A = torch.linalg.solve(Kuu, Kuf)  # Kuu^-1 Kuf
            cov = Kff - Kuf.T @ A + A.T @ S @ A
            P = torch.linalg.solve(Kuu, S)
            kl = 0.5 * (torch.trace(P) + m @ torch.linalg.solve(Kuu, m) - M + torch.logdet(Kuu) - torch.logdet(S))
        means.append(A.T @ m)
        covs.append(cov)
        kls.append(kl)
    return torch.stack(means), torch.stack(covs), torch.stack(kls)


def mixing(gp):
    """``W`` ``[L, Q]`` of an LMC layer, the identity for independent outputs."""
    return gp.W.detach() if gp.num_latents is not None else torch.eye(gp.num_outputs)


def output_marginals(gp, X):
    """The outputs' marginals of ``q(f)``, ``[L, N]`` each, and the ``[N, L, L]`` covariance at each point."""
    mean, cov, _ = latent_q(gp, X)
    W = mixing(gp)
    v = torch.diagonal(cov, dim1=-2, dim2=-1)  # [Q, N]
    point_cov = torch.einsum("lq,qn,kq->nlk", W, v, W)
    return W @ mean, (W**2) @ v, point_cov


def gaussian_ell(y, mu, var, noise):
    """``E_N(f; mu, var)[log N(y; f, noise)]`` in closed form."""
    return -0.5 * math.log(2 * math.pi) - 0.5 * torch.log(noise) - 0.5 * ((y - mu) ** 2 + var) / noise


def probit_ell(y, mu, var, nodes=120):
    """``E_N(f; mu, var)[log Phi((2y - 1) f)]`` by NumPy's Gauss-Hermite with ``nodes`` points."""
    x, w = np.polynomial.hermite.hermgauss(nodes)
    x = torch.as_tensor(x * math.sqrt(2.0), dtype=mu.dtype)
    w = torch.as_tensor(w / math.sqrt(math.pi), dtype=mu.dtype)
    f = mu.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * x
    return (torch.special.log_ndtr((2 * y.unsqueeze(-1) - 1) * f) * w).sum(-1)


def dense_bound(gp, X, y):
    """The bound summed over the observed entries of ``y`` ``[N, L]`` (``NaN``: missing) minus the latents' KL."""
    mu, var, _ = output_marginals(gp, X)
    yt = y.T
    obs = ~torch.isnan(yt)
    yf = torch.where(obs, yt, torch.zeros_like(yt))
    lik = gp.likelihood
    ell = gaussian_ell(yf, mu, var, lik.noise.detach()) if isinstance(lik, ps.Gaussian) else probit_ell(yf, mu, var)
    return ell[obs].sum() - latent_q(gp, X)[2].sum()


def randomise_q(gp, scale=0.5):
    """Move every ``q(u)`` (and ``q(v)``) of ``gp`` off its initial value, reproducibly from torch's RNG."""
    with torch.no_grad():
        for q in [gp.q_u] + ([gp.q_v] if hasattr(gp, "q_v") else []):
            q.u_loc.copy_(scale * torch.randn_like(q.u_loc))
            M = q.u_loc.shape[-1]
            L = torch.tril(0.2 * torch.randn(q.u_loc.shape[:-1] + (M, M)), -1) + torch.diag_embed(
                0.4 + 0.5 * torch.rand(q.u_loc.shape))
            q.set(q.u_loc, L)
