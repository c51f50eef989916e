r"""The exact last step of a conjugate layer: q(u) and the Gaussian noise set to their optimum on all the data, given
the kernel's hyperparameters and the inducing inputs.

A minibatch natural-gradient step of length :math:`\rho` leaves q(u) and the noise fluctuating about the plateau: the
last iterate is one sample of that fluctuation, and on heavy-tailed data (flight delays) one outlier minibatch near
the end moves the noise and q(u) far from the plateau's centre for tens of steps. For a
:class:`~pyro_sparsegp.Gaussian` likelihood the step of length 1 on the *whole* data set is exact (Hensman, Fusi,
Lawrence 2013, section 3.2: the natural-gradient step of length 1 lands on the optimum of a conjugate bound), so one
pass over the data finishes the run deterministically. With :math:`A = L_{uu}^{-1}K_{uf}` (whitened; :math:`K_{uu}^{-1}
K_{uf}` otherwise), prior precision :math:`P` (:math:`I` whitened, :math:`K_{uu}^{-1}` otherwise), the pass gathers

.. math:: G = \sum_n a_n a_n^T,\quad b = \sum_n a_n y_n,\quad s = \sum_n y_n^2,\quad
          t = \sum_n \big(k_{nn} - q_{nn}\big),

and then alternates the two exact coordinate steps of the bound

.. math:: S = (P + G/\sigma^2)^{-1},\quad m = S\,b/\sigma^2; \qquad
          \sigma^2 = \tfrac1n\big(s - 2m^Tb + m^TGm + \mathrm{tr}(GS) + t\big)

(the first is Titsias 2009's optimal q(u); the second the noise's optimum given q(f), the fixed point of
:func:`~pyro_sparsegp.infer.natgrad.noise_step_from_grads_`). Each raises the full-data bound, so they converge to the
noise that maximises the collapsed bound of Titsias (2009) at the current hyperparameters, with q(u) its optimum: the
centre of the plateau, not a sample from it. Missing outputs (``NaN`` in ``y`` ``[N, L]``) count nowhere: each
output's sums run over its observed rows, and the noise's :math:`n` counts the observed entries.

A :class:`~pyro_sparsegp.DeepGP` (Salimbeni and Deisenroth 2017) with a Gaussian likelihood is conjugate in its
last layer's q(u) given the hidden layers: its bound (their eq. 8) is the last layer's bound averaged over the
hidden samples, so the statistics above are averaged over ``S`` samples per point of the last layer's inputs, drawn
once in the pass, and the finish is the exact optimum of that ``S``-sample estimate (the hidden layers are left as
the loop left them). On kin8nm (``benchmarks/deepgp_uci.py``, M = 100, 1,000 steps of ``fit``, split 0) it raised
the test log-likelihood of DGP 2 from 1.280 to 1.291 and of DGP 3 from 1.342 to 1.357 at ``S = 5``; ``S = 20`` gave
the same.

SOLVE-GP (Shi, Titsias, Mnih 2020) has two families, q(u) q(v⊥), with features :math:`a_n` (as above) and
:math:`d_n = L_c^{-1}c_{vn}` (whitened; :math:`C_{vv}^{-1}c_{vn}` otherwise) and prior precisions :math:`P_u, P_v`.
Its bound (their eq. 8) with a Gaussian likelihood is quadratic in the stacked mean :math:`m = [m_u; m_v]`, so with
:math:`\phi_n = [a_n; d_n]` and :math:`G, b` summed over :math:`\phi_n` the optimal mean is the joint
:math:`m = (P + G/\sigma^2)^{-1}b/\sigma^2` (:math:`P = \mathrm{blockdiag}(P_u, P_v)`), and each covariance its
own block, :math:`S_u = (P_u + G_{uu}/\sigma^2)^{-1}`, :math:`S_v = (P_v + G_{vv}/\sigma^2)^{-1}` (their eqs. 28-29
at the full data); the noise takes :math:`\mathrm{tr}(G_{uu}S_u) + \mathrm{tr}(G_{vv}S_v)` and :math:`t_n = k_{nn} -
\|W_n\|^2 - \|D_n\|^2`. The pass costs :math:`O(NM^2)` once (as :math:`N/B` forward passes
without gradients); the alternations :math:`O(M^3)` each, independent of :math:`N`.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

from ...context.composition import sampled_attributes
from ...likelihoods import Gaussian
from ..natgrad.closed_forms import _A, _targets
from ..natgrad.families import noise_natgrad_likelihood
from ..natgrad.from_grads import _set_constrained
from .distributed import rank_and_world_size

__all__ = ["exact_finish_", "supports_exact_finish", "why_not_exact_finish", "resolve_finish", "finish_run"]

#: Why an LMC layer (``num_latents``) has no exact finish: the optimum of its bound couples the latents' q(u_q).
LMC_REASON = ("its outputs mix latent GPs (num_latents): the optimal q(u) couples the latents, which q(u) keeps "
              "independent, so it has no closed form")


def _families(module) -> list:
    """The Gaussian families the finish sets: ``[q_u]`` (SVGP), ``[q_u, q_v]`` (SOLVE-GP, ODVGP), ``[]`` otherwise."""
    from ...layers import SOLVEGP, SVGP
    from ...layers.solvegp import OrthogonalInputs

    if isinstance(module, SOLVEGP):
        return [module.q_u, module.q_v]
    if isinstance(module, SVGP) and not isinstance(module, OrthogonalInputs):
        return [module.q_u]
    return []


def why_not_exact_finish(module) -> str | None:
    """``None`` if :func:`exact_finish_` applies to ``module``, else the first condition it fails, as a phrase for an
    error message. It applies to an :class:`~pyro_sparsegp.SVGP` or a :class:`~pyro_sparsegp.SOLVEGP` (or a
    :class:`~pyro_sparsegp.DeepGP` whose last layer is one, with no hyperprior anywhere), the layers
    whose bound is conjugate in q(u) (Titsias 2009; Hensman, Fusi, Lawrence 2013, section 3.2; Shi, Titsias, Mnih
    2020, eqs. 28-29), with a :class:`~pyro_sparsegp.Gaussian` likelihood, no mean function, full-covariance families
    (not SOLVE-GP's ODVGP restriction, whose q(v⊥) is the prior's), none frozen with ``requires_grad_(False)`` (the
    finish would overwrite it), and fixed hyperparameters (no ``PyroSample``: read outside a trace it would be a draw
    from its prior). No tensors, so shapes do not apply."""
    from ...layers import DeepGP

    name = type(module).__name__
    if isinstance(module, DeepGP):  # its last layer, given the hidden layers' samples (module docstring)
        if sampled := sampled_attributes(module, names=False):
            where = ", ".join(f"{type(sub).__name__}.{attr}" for sub, attr, _ in sampled)
            return f"{where} is a PyroSample (a hyperprior): read outside a trace it would be a draw from its prior"
        reason = why_not_exact_finish(module.last)
        return None if reason is None else f"its last layer: {reason}"
    fams = _families(module)
    if not fams:
        return (f"{name} is not an SVGP, a SOLVEGP or a DeepGP (an ODVGP's q(v⊥) and other modules have no exact "
                "optimum here)")
    if not isinstance(module.likelihood, Gaussian):
        return f"its likelihood is {type(module.likelihood).__name__}, not Gaussian (only then is q(u)'s optimum exact)"
    if getattr(module, "num_latents", None) is not None:
        return LMC_REASON
    if getattr(module, "mean_function", None) is not None:
        return "it has a mean function"
    if not all(getattr(q, "learn_scale", False) for q in fams):
        return "its q(v⊥) has the prior's covariance (SOLVEGP(odvgp=True)), not one of its own"
    return untouchable(module, fams)


def untouchable(module, families) -> str | None:
    """Why no finish may set ``families`` of ``module`` (either finish): a frozen family, or a ``PyroSample``
    hyperparameter (read outside a trace it is a draw from its prior); ``None`` if neither. No tensors, so shapes
    do not apply."""
    if not all(p.requires_grad for q in families for p in q.parameters()):
        return "a variational family is frozen (requires_grad_(False)); the finish would overwrite it"
    if sampled := sampled_attributes(module, names=False):
        where = ", ".join(f"{type(sub).__name__}.{attr}" for sub, attr, _ in sampled)
        return f"{where} is a PyroSample (a hyperprior): read outside a trace it would be a draw from its prior"
    return None


def supports_exact_finish(module) -> bool:
    """Whether :func:`exact_finish_` applies to ``module`` (:func:`why_not_exact_finish` is ``None``: the conjugate
    layers of Titsias 2009 and Shi, Titsias, Mnih 2020). No tensors, so shapes do not apply."""
    return why_not_exact_finish(module) is None


def _features(layer, X):
    """``([A_i [(L,) M_i, B]], [chol_i [(L,) M_i, M_i]], t [(L,) B])``: per family the features ``A_i`` with
    ``E_q f = sum_i A_i^T m_i`` (whitened ``L_i^{-1} K_{i f}``; else ``K_i^{-1} K_{i f}``-like, through the factor
    ``chol_i`` of the prior covariance ``K_uu`` or ``C_vv``), and ``t = k_nn - sum_i ||W_i||^2``, the variance that no
    inducing variable explains."""
    factors = tuple(layer.strategy.factors(X, consume=True))
    if len(factors) == 5:  # SOLVE-GP: (Luu, Lc, B, D, kdiag), algorithm 1 of Shi, Titsias, Mnih 2020
        Luu, Lc, B, D, kdiag = factors
        W, chols = [B, D], [Luu, Lc]
    else:
        Luu, W0, kdiag = factors
        W, chols = [W0], [Luu]
    t = kdiag - sum(w.pow(2).sum(-2) for w in W)
    A = [_A(layer, c, w) for w, c in zip(W, chols, strict=True)]  # Kuu^{-1} Kuf's analogue per family
    if layer.num_outputs is not None:
        L = layer.num_outputs
        A = [a.expand(L, *a.shape[-2:]) for a in A]
        chols = [c.expand(L, *c.shape[-2:]) for c in chols]
        t = t.expand(L, t.shape[-1])
    return A, chols, t


@torch.no_grad()
def _statistics(layer, batches):
    """``(G [..., K, K], b [..., K], s [...], t [...], n, chols)``: the sums of the module docstring in float64 over
    the ``(X [B, D], y [B] or [B, L])`` of ``batches`` for the stacked features of all families (``K = sum_i M_i``),
    the number of rows ``n`` and the last batch's prior factors."""
    G = b = s = t = chols = None
    n = obs = 0
    for X, y in batches:
        X, y = layer.check_inputs(X, y)
        A, chols, resid = _features(layer, X)
        # the products in float64: Phi Phi^T of float32 features summed in float32 is not positive semi-definite
        # (round-off of 1e-8 of its norm), which a noise near zero turns into an indefinite precision
        Phi = torch.cat(A, dim=-2).double()  # [(L,) K, B]
        yt = _targets(layer, y).to(Phi.dtype)  # [(L,) B]
        seen = ~torch.isnan(yt)  # missing outputs (NaN) count nowhere: each output sums its observed rows
        yt, Phi, resid = yt.nan_to_num(0.0), Phi * seen.unsqueeze(-2), resid.double() * seen
        parts = (Phi @ Phi.mT, (Phi @ yt.unsqueeze(-1)).squeeze(-1), yt.pow(2).sum(-1), resid.clamp(min=0).sum(-1))
        G, b, s, t = parts if G is None else [old + new for old, new in zip((G, b, s, t), parts, strict=True)]
        n, obs = n + X.shape[-2], obs + int(seen.sum())
    if G is None:
        raise ValueError("exact_finish_ got no batches")
    return G, b, s, t, (n, obs), chols


def _hidden_samples(deep, batches, S: int):
    """The last layer's inputs ``h [S B, D_{L-1}]`` and targets ``y [S B]`` (``[S B, L]``) for each ``(X [B, D],
    y)`` of ``batches``: ``S`` samples per point propagated through the hidden layers' marginals (Salimbeni and
    Deisenroth 2017, eq. 7), the targets repeated to match."""
    for X, y in batches:
        X, y = deep.check_inputs(X, y)
        if deep.hidden:
            h = deep.propagate(X, S)[0][-1]  # [S, B, D_{L-1}]
            deep.clear_cache()
        else:
            h = X.expand(S, *X.shape)
        yield h.reshape(-1, h.shape[-1]), y.repeat(S, *([1] * (y.dim() - 1)))


def _reduce_over_ranks(tensors, n):
    """``(tensors summed over the ranks of an initialised process group, n summed)``; unchanged without one. Any
    shapes (float64); one ``all_reduce`` of their concatenation."""
    if rank_and_world_size()[1] == 1:
        return tensors, n
    flat = torch.cat([x.reshape(-1) for x in tensors] + [torch.tensor([float(n)], dtype=torch.float64,
                                                                          device=tensors[0].device)])
    torch.distributed.all_reduce(flat)
    out, i = [], 0
    for x in tensors:
        out.append(flat[i: i + x.numel()].reshape(x.shape))
        i += x.numel()
    return out, int(round(flat[-1].item()))


def _prior_precisions(layer, chols) -> list:
    """Per family the prior precision ``[(L,) M_i, M_i]`` in float64: ``I`` whitened, else ``(L_i L_i^T)^{-1}``."""
    out = []
    for c in chols:
        c = c.double()
        if layer.whiten:
            out.append(torch.eye(c.shape[-1], dtype=c.dtype, device=c.device).expand_as(c))
        else:
            out.append(torch.cholesky_inverse(c))
    return out


def _optimum(P, G, b, noise):
    """The optimal ``(m [..., K], [S_i [..., M_i, M_i]])`` for the noise variance ``noise`` (float64): the joint mean
    of the stacked families (the bound is quadratic in it), each family's own covariance (q factorises over
    families: SOLVE-GP's q(u) q(v⊥))."""
    prec, i = G / noise, 0
    for p in P:
        k = p.shape[-1]
        prec[..., i: i + k, i: i + k] += p
        i += k
    Lp = torch.linalg.cholesky(0.5 * (prec + prec.mT))
    m = torch.cholesky_solve((b / noise).unsqueeze(-1), Lp).squeeze(-1)
    if len(P) == 1:  # one family: its covariance is the joint one
        return m, [torch.cholesky_inverse(Lp)]
    blocks, i = [], 0
    for p in P:
        k = p.shape[-1]
        blocks.append(torch.cholesky_inverse(torch.linalg.cholesky(prec[..., i: i + k, i: i + k])))
        i += k
    return m, blocks


def _expected_residual(G, b, s, m, S):
    """``sum_n E_q (y_n - f_n)^2`` without the unexplained variance: ``s - 2 m^T b + m^T G m + sum_i tr(G_ii S_i)``."""
    out = s - 2 * (m * b).sum(-1) + (m * (G @ m.unsqueeze(-1)).squeeze(-1)).sum(-1)
    i = 0
    for Si in S:
        k = Si.shape[-1]
        out = out + (G[..., i: i + k, i: i + k] * Si).sum((-2, -1))
        i += k
    return out


@torch.no_grad()
def exact_finish_(svgp, batches, num_data: int | None = None, max_iter: int = 500, tol: float = 1e-10,
                  num_samples: int | None = None) -> int:
    r"""Set q(u) and the learnable noise of ``svgp`` to their joint optimum on the data of ``batches`` (module
    docstring: Titsias 2009's optimal q(u) alternated with the noise's optimum, Hensman, Fusi, Lawrence 2013, eq. 4),
    in place. Under an initialised ``torch.distributed`` process group each rank passes its own share of
    the data and the statistics are summed over ranks.

    :param svgp: a module for which :func:`supports_exact_finish` holds (else a ``ValueError`` names the condition
        it fails, :func:`why_not_exact_finish`).
    :param batches: an iterable of ``(X [B, D], y [B] or [B, L])`` covering the data once.
    :param num_data: the data set's size ``N`` if ``batches`` cover only part of it (a loader that drops its last
        batch): the statistics are scaled by ``N / n``, as the minibatch bound is. Default: the rows seen.
    :param max_iter: at most this many alternations (q(u), then the noise).
    :param num_samples: a :class:`~pyro_sparsegp.DeepGP`'s samples of the hidden layers per point (default its
        ``num_samples``); other modules ignore it.
    :param tol: stop when the noise's relative change is below ``tol``.
    :returns: the number of alternations taken (0 for a fixed noise: q(u) alone is set, once).
    """
    from ...layers import DeepGP

    if (reason := why_not_exact_finish(svgp)) is not None:
        raise ValueError(f"exact_finish_ cannot finish this module: {reason}")
    per_point = 1
    if isinstance(svgp, DeepGP):  # the last layer on S samples of its inputs per point, each weighted 1 / S
        per_point = num_samples or svgp.num_samples
        svgp, batches = svgp.last, _hidden_samples(svgp, batches, per_point)
    G, b, s, t, (n, obs), chols = _statistics(svgp, batches)
    (G, b, s, t), n = _reduce_over_ranks([G, b, s, t], n)
    obs = _reduce_over_ranks([torch.zeros(1, dtype=torch.float64, device=G.device)], obs)[1]
    n = n / per_point  # data points seen
    scale = (1.0 if num_data is None else num_data / n) / per_point
    G, b, s, t = G * scale, b * scale, s * scale, t * scale
    count = obs * scale  # scalar observations sharing the noise (N L, less the missing ones)
    P = _prior_precisions(svgp, chols)
    lik = noise_natgrad_likelihood(svgp)
    noise = svgp.likelihood.noise.detach().double()
    low = float(getattr(svgp.likelihood._pyro_params.get("noise", (None,))[0], "lower_bound", 0.0) or 0.0)
    info = torch.finfo(svgp.likelihood.noise.dtype)  # inside the constraint's support (greater_than(1e-4)) once cast
    low = low * (1 + 8 * info.eps) + info.tiny
    m, S = _optimum(P, G, b, noise)  # a LinAlgError here leaves the module as it was
    steps = 0
    while lik is not None and steps < max_iter:  # the noise's objective given q is unimodal: clamping is its optimum
        new = ((_expected_residual(G, b, s, m, S) + t).sum() / count).clamp(min=low)
        try:
            m_new, S_new = _optimum(P, G, b, new)
        except torch.linalg.LinAlgError:  # a noise near zero (noise-free data): the last alternation that factorised
            break  # stands (each one raised the bound)
        steps += 1
        change = float((new - noise).abs() / noise)
        noise, m, S = new, m_new, S_new
        if change < tol:
            break
    factors = [torch.linalg.cholesky(Si) for Si in S]  # all factorised before anything is written
    i = 0
    for q, Li in zip(_families(svgp), factors, strict=True):
        k = Li.shape[-1]
        dtype = q.u_loc.dtype
        q.set(m[..., i: i + k].to(dtype), Li.to(dtype))
        i += k
    if lik is not None:
        _set_constrained(lik, "noise", lik.noise_unconstrained, noise.to(lik.noise_unconstrained.dtype))
    return steps


def resolve_finish(module, finish, elbo, natgrad_lr, loader, average, num_steps, epochs) -> tuple[bool, str | None]:
    """Whether :func:`~pyro_sparsegp.infer.fit` ends with :func:`exact_finish_`: ``"exact"`` (where it applies, else
    a ``ValueError``), ``None``, or ``"auto"``: exact for an SVGP, SOLVE-GP or DeepGP with a Gaussian likelihood
    trained by natural gradients on the closed-form bound from ``X, y`` or a ``dataset`` (not a loader, which may be
    endless), without ``average`` (``fit`` passes it only where the average would set the families that the finish
    sets: not a DeepGP's hidden layers' average under ``NaturalPolicy(layers="all")``), in a run of at least one epoch
    (``epochs`` = steps x global batch / N; the pass then costs at most the forward passes of the training). The
    finish is the full-data natural step of length 1 of Hensman, Fusi, Lawrence 2013, section 3.2. Returns
    ``(finish, skipped)``: ``skipped`` says why ``"auto"`` left out a finish the module could take (a loader, Adam
    on q(u), a run under one epoch), for fit's progress line, else ``None``. No tensors, so shapes do not apply."""
    if finish not in ("auto", "exact", None):
        raise ValueError(f'NaturalPolicy.finish must be "auto", "exact" or None, got {finish!r}')
    if finish == "exact":
        if (reason := why_not_exact_finish(module)) is not None:
            raise ValueError(f'NaturalPolicy(finish="exact") cannot finish this module: {reason}')
        if average is not None:
            raise ValueError('NaturalPolicy.average and finish="exact" both set q(u) and the noise at the end: '
                             "choose one")
        return True, None
    chosen_otherwise = finish is None or num_steps == 0 or elbo != "analytic" or average is not None
    if chosen_otherwise or not supports_exact_finish(module):
        return False, None
    if loader is not None:
        return False, ('the data come from a loader, which may be endless (NaturalPolicy(finish="exact") makes one '
                       "pass of it)")
    if natgrad_lr is None:
        return False, 'q(u) was trained by Adam (natgrad=None); NaturalPolicy(finish="exact") adds the finish'
    if epochs < 1:
        return False, (f"the run saw {epochs:.2g} of an epoch, less than the pass would read "
                       '(NaturalPolicy(finish="exact") forces it)')
    return True, None


def finish_run(module, source, num_data: int, show: bool) -> None:
    """fit's last pass (:func:`exact_finish_` over ``source.one_pass()`` of a
    :class:`~pyro_sparsegp.infer.training.batches.BatchSource`), with a line on ``stderr`` where
    progress is shown (a pass over a large data set takes a while after the bar's 100%): the rows it saw, which for
    a loader (a ``drop_last`` one, or a shard per rank) may be fewer than ``num_data``, scaled up to it. The batches
    are ``(X [B, D], y [B] or [B, L])``; nothing is returned (Titsias 2009's optimum is written into ``module``).
    Where the optimum cannot be factorised even in float64 (no such case is known since the statistics are summed in
    float64), a ``RuntimeWarning`` says so and the module keeps the trained state: the run is not lost."""
    start, rows = time.perf_counter(), [0]

    def counted(batches):
        for Xb, yb in batches:
            rows[0] += Xb.shape[0]
            yield Xb, yb

    try:
        exact_finish_(module, counted(source.one_pass()), num_data=num_data)
    except torch.linalg.LinAlgError as exc:  # the run is never lost at its last line: the trained state stands
        warnings.warn(f"fit: no exact finish: its {num_data}-point optimum could not be factorised in float64 "
                      f"({str(exc).splitlines()[0][:120]}); the module keeps the state the training left",
                      RuntimeWarning, stacklevel=3)
        return
    if show:
        rank = " on this rank" if source.world_size > 1 else ""  # X, y or a dataset: the ranks' blocks cover N
        seen = (f"on all {num_data} points" if source.loader is None or rows[0] == num_data else
                f"on the {rows[0]} rows of one pass of the loader{rank}, scaled to num_data = {num_data}")
        noise = float(module.likelihood.noise.detach())
        what = "the last layer's q(u)" if hasattr(module, "last") else "q(u)"
        print(f"fit: exact finish of {what} and the noise {seen} ({time.perf_counter() - start:.1f} s): noise "
              f"{noise:.4g}", file=sys.stderr, flush=True)
