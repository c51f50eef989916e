"""Shared by the export tests (tests/deploy): a random ``q`` and a deep GP's ``predict`` with the draws an exported
program bakes in."""

import torch


def random_q(q, scale=0.3):
    """A random ``q`` (mean, lower-triangular scale with a positive diagonal): a stronger test than a trained one."""
    with torch.no_grad():
        q.u_loc = torch.randn_like(q.u_loc)
        L = (torch.randn_like(q.u_scale_tril) * scale).tril()
        L.diagonal(dim1=-2, dim2=-1).copy_(torch.rand(L.shape[:-1]) * 0.5 + 0.3)
        q.u_scale_tril = L


def deep_predict(dgp, X, S, seed, monkeypatch, width=2):
    """``dgp.predict`` with the draws an exported program bakes in (``eps [S, width]`` per hidden layer from ``seed``,
    shared by the points; one hidden layer), and its mixture's mean and variance ``[N]``."""
    eps = torch.randn(S, width, generator=torch.Generator().manual_seed(seed))
    randn = torch.randn

    def same_draws(*shape, **kwargs):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, torch.Size)) else shape
        return eps[:, :, None].expand(shape).to(kwargs.get("dtype") or torch.get_default_dtype()).clone()

    monkeypatch.setattr(torch, "randn", same_draws)
    loc, var = dgp.predict(X, num_samples=S)
    monkeypatch.setattr(torch, "randn", randn)
    mean = loc.mean(0)
    return mean, var.mean(0) + (loc - mean).square().mean(0)
