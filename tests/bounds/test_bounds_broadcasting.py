"""Leading batch dimensions of the dense oracles (:mod:`pyro_sparsegp.bounds`: "leading batch dimensions allowed on
every argument", broadcast as usual): evaluated on a batch, every bound, KL and parameter map equals the stack of its
values on the members of the batch, one call per member. Checked with one argument batched at a time (a batch
dimension the others lack must not be dropped) and with every argument batched in its own broadcastable pattern
(kernel matrices ``[2, 1]``, the rest ``[3]``, ``[2, 3]`` or ``[1, 3]``), including a batch of two dimensions under
the kernel matrices (``[..., M, M]`` read from the right). The oracle is the unbatched call itself."""

import itertools

import pytest
import torch

from pyro_sparsegp.bounds import polya_gamma as PG
from pyro_sparsegp.bounds import solvegp as SG
from pyro_sparsegp.bounds import svgp as SV
from pyro_sparsegp.likelihoods import Gaussian

N, M, M2 = 6, 3, 4
EVENT = dict(Kuu=2, Kuv=2, Kvv=2, Kuf=2, Kvf=2, Kff=2, kff_diag=1, y=1, noise_var=0, m=1, L=2, m_u=1, L_u=2, m_v=1,
             L_v=2, c=1)
KERNEL = ("Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "Kff", "kff_diag")


def _kernel_group(batch):
    """Kuu, Kuv, Kvv, Kuf, Kvf, Kff, kff_diag of one RBF over shared points, its lengthscale batched ``batch``."""
    g = torch.Generator().manual_seed(1)
    P = (torch.rand(M + M2 + N, 2, generator=g) * 4 - 2).to(torch.get_default_dtype())
    ls = torch.linspace(0.6, 1.0, max(1, int(torch.tensor(batch).prod()))).reshape(batch + (1, 1))
    J = 1.3 * torch.exp(-0.5 * (P[:, None] - P[None]).pow(2).sum(-1) / ls**2)
    J = J + 1e-3 * torch.eye(len(P))
    u, v, f = slice(0, M), slice(M, M + M2), slice(M + M2, None)
    return dict(Kuu=J[..., u, u], Kuv=J[..., u, v], Kvv=J[..., v, v], Kuf=J[..., u, f], Kvf=J[..., v, f],
                Kff=J[..., f, f], kff_diag=J[..., f, f].diagonal(dim1=-2, dim2=-1))


def _perturbed(name, K, batch):
    """One kernel matrix batched on its own, its members still valid together with the unbatched others: a
    covariance plus ``c I`` (``c >= 0``; ``C_vv`` stays positive definite), a cross-covariance scaled by ``f <= 1``."""
    n = int(torch.tensor(batch).prod())
    c = torch.linspace(0.0, 0.5, n).reshape(batch + (1,) * K.dim())
    if name in ("Kuu", "Kvv", "Kff"):
        return K + c * torch.eye(K.shape[-1])
    if name == "kff_diag":
        return K + c
    return K * (1 - c)


def _value(name, batch, binary=False):
    """A random argument ``name`` with batch dimensions ``batch``."""
    ev = {"y": (N,), "c": (N,), "noise_var": (), "m": (M,), "m_u": (M,), "m_v": (M2,), "L": (M, M), "L_u": (M, M),
          "L_v": (M2, M2)}[name]
    if name == "y":
        return (torch.rand(batch + ev) < 0.5).to(torch.get_default_dtype()) if binary else torch.randn(batch + ev)
    if name in ("noise_var", "c"):
        return torch.rand(batch + ev) + 0.3
    if name.startswith("L"):
        L = torch.tril(0.3 * torch.randn(batch + ev), -1)
        return L + torch.diag_embed(torch.rand(batch + ev[:1]) + 0.5)
    return torch.randn(batch + ev)


def _member(x, idx):
    """The member ``idx`` (an index into the full batch) of a broadcastable argument."""
    if not torch.is_tensor(x):
        return x
    ev = EVENT_OF[id(x)]
    b = x.shape[: x.dim() - ev]
    ix = tuple(0 if n == 1 else i for n, i in zip(b, idx[len(idx) - len(b):], strict=True))
    return x[ix]


EVENT_OF = {}


def _args(names, layout, binary=False):
    """Arguments ``names`` (kernel matrices first) with the batch of ``layout[name]`` (kernel group: ``"kernel"``)."""
    out = dict(_kernel_group(layout.get("kernel", ())))
    for n in KERNEL:
        if n in layout:
            out[n] = _perturbed(n, out[n], layout[n])
    for n in names:
        if n not in KERNEL:
            out[n] = _value(n, layout.get(n, ()), binary)
    for n, t in out.items():
        EVENT_OF[id(t)] = EVENT[n]
    return {n: out[n] for n in names}


def _check(fn, names, layout, binary=False, **kw):
    args = _args(names, layout, binary)
    full = fn(**args, **kw)
    outs = full if isinstance(full, tuple) else (full,)
    batch = torch.broadcast_shapes(*(t.shape[: t.dim() - EVENT[n]] for n, t in args.items()))
    for idx in itertools.product(*map(range, batch)):
        one = fn(**{n: _member(t, idx) for n, t in args.items()}, **kw)
        for a, b in zip(outs, one if isinstance(one, tuple) else (one,), strict=True):
            lead = a.shape[: a.dim() - b.dim()]  # an output need not depend on every argument: it broadcasts
            assert torch.broadcast_shapes(lead, batch) == batch
            ix = tuple(0 if n == 1 else i for n, i in zip(lead, idx[len(idx) - len(lead):], strict=True))
            torch.testing.assert_close(a[ix], b, rtol=1e-5, atol=1e-6)


def _elp(y, f_loc, f_var):
    return Gaussian(0.2).expected_log_prob(y, f_loc, f_var)


CASES = {
    "gauss_kl": (SV.gauss_kl, ["m", "L", "Kuu"], {}),
    "gauss_kl_whitened": (lambda m, L: SV.gauss_kl(m, L), ["m", "L"], {}),
    "exact_log_marginal": (SV.exact_log_marginal, ["y", "noise_var", "Kff"], {}),
    "titsias_bound": (SV.titsias_bound, ["y", "noise_var", "Kuu", "Kuf", "kff_diag"], {}),
    "qf_dense": (SV.qf_dense, ["Kuu", "Kuf", "kff_diag", "m", "L"], {}),
    "l3_bound": (SV.l3_bound, ["y", "noise_var", "Kuu", "Kuf", "kff_diag", "m", "L"], {}),
    "kl_sparse_bound": (lambda y, **a: SV.kl_sparse_bound(y, _elp, **a), ["y", "Kuu", "Kuf", "kff_diag", "m", "L"],
                        {}),
    "kl_sparse_bound_whitened": (lambda y, **a: SV.kl_sparse_bound(y, _elp, whiten=True, **a),
                                 ["y", "Kuu", "Kuf", "kff_diag", "m", "L"], {}),
    "optimal_qu": (SV.optimal_qu, ["y", "noise_var", "Kuu", "Kuf"], {}),
    "pg_bound": (PG.pg_bound, ["y", "Kuu", "Kuf", "kff_diag", "m", "L"], {"binary": True}),
    "pg_bound_c": (PG.pg_bound, ["y", "Kuu", "Kuf", "kff_diag", "m", "L", "c"], {"binary": True}),
    "pg_bound_whitened": (lambda **a: PG.pg_bound(whiten=True, **a), ["y", "Kuu", "Kuf", "kff_diag", "m", "L"],
                          {"binary": True}),
    "whiten_params": (SG.whiten_params, ["Kuu", "Kuv", "Kvv", "m_u", "L_u", "m_v", "L_v"], {}),
    "unwhiten_params": (SG.unwhiten_params, ["Kuu", "Kuv", "Kvv", "m_u", "L_u", "m_v", "L_v"], {}),
    "kl_terms": (SG.kl_terms, ["Kuu", "Kuv", "Kvv", "m_u", "L_u", "m_v", "L_v"], {}),
    "solvegp_marginals": (SG.solvegp_marginals, ["Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "kff_diag", "m_u", "L_u", "m_v",
                                                 "L_v"], {}),
    "solvegp_elbo_whitened": (lambda y, **a: SG.solvegp_elbo(y, _elp, whiten=True, **a),
                              ["y", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "kff_diag", "m_u", "L_u", "m_v", "L_v"], {}),
    "collapsed": (SG.solvegp_collapsed_bound, ["y", "noise_var", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "kff_diag", "m_v",
                                               "L_v"], {}),
    "odvgp": (SG.odvgp_bound, ["y", "noise_var", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "kff_diag", "m_v"], {}),
    "odvgp_whitened": (lambda **a: SG.odvgp_bound(whiten=True, **a),
                       ["y", "noise_var", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf", "kff_diag", "m_v"], {}),
    "optimal_q_v": (SG.solvegp_optimal_q_v, ["y", "noise_var", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf"], {}),
    "optimal_q_v_whitened": (lambda **a: SG.solvegp_optimal_q_v(whiten=True, **a),
                             ["y", "noise_var", "Kuu", "Kuv", "Kvv", "Kuf", "Kvf"], {}),
    "tight": (SG.solvegp_tight_bound, ["y", "noise_var", "Kuu", "Kuf", "Kff"], {}),
    "structured": (SG.structured_svgp_params, ["Kuu", "Kuv", "m_u", "L_u", "m_v", "L_v"], {}),
    "structured_tril": (lambda **a: SG.structured_svgp_params(return_scale_tril=True, **a),
                        ["Kuu", "Kuv", "m_u", "L_u", "m_v", "L_v"], {}),
}
PATTERNS = [(3,), (2, 3), (1, 3)]


def _layouts(names):
    """One argument batched ``[3]`` at a time (each kernel matrix on its own, and all of them as one group), then all
    at once: the kernel matrices ``[2, 1]`` and each other argument its own pattern; then the kernel matrices alone
    ``[2, 3]``."""
    groups = ["kernel"] + [n for n in names if n not in KERNEL]
    yield from ({g: (3,)} for g in names + ["kernel"])
    yield {g: ((2, 1) if g == "kernel" else PATTERNS[i % 3]) for i, g in enumerate(groups)}
    yield {"kernel": (2, 3)}


@pytest.mark.float64
@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_is_the_stack_of_its_members(case):
    torch.manual_seed(0)
    fn, names, kw = CASES[case]
    for layout in _layouts(names):
        _check(fn, names, layout, **kw)
