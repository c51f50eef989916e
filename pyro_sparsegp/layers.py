r"""High-level PyroModules. :class:`SVGP` wraps the site contract of ``DESIGN.md``:

=================  ======================================  ==========================================
site               model                                   guide
=================  ======================================  ==========================================
``<name>.u``       ``N(0, Kuu)`` (``N(0, I)`` whitened)    ``q(u) = N(u_loc, u_scale_tril u_scale_tril^T)``
``<name>.f``       ``p(f | u)``                            the same ``p(f | u)``
``y``              ``likelihood.distribution(f)``          —
=================  ======================================  ==========================================

Because the guide samples ``f`` from the same conditional as the model, ``log p(f|u) - log q(f|u)`` cancels and
``Trace_ELBO`` is an unbiased estimate of Hensman, Matthews, Ghahramani (2015) eq. 21 (Hensman 2013 L3 for a
Gaussian likelihood); ``TraceMeanField_ELBO`` makes the KL analytic.
"""

from __future__ import annotations

import contextlib
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule

from . import conditionals as cond
from . import deferred
from . import inducing as ind
from .composition import (
    BoundModule,
    check_plate_alignment,
    draw_hyperparameters,
    layer_method,
    sampled_attributes,
    values_key,
)
from .composition import plate as data_plate
from .distributions import MarginalizedLikelihood
from .distributions.kl import ConditionalNormal
from .inputs import as_targets, as_tensor
from .kernels import kernel_matrix
from .likelihoods import Likelihood, _check_finite
from .linalg import KUU_ADVICE, cholesky, project_chol, solve_lower, whitened_marginals
from .naming import ParamStoreWarning, claim_name, unique_name
from .validation import check_data, check_module_args, check_predict
from .variational import GaussianQ

__all__ = ["SVGP", "as_inputs", "ParamStoreWarning", "UntrainableWarning"]


class _XKey:
    """Cache key of an input tensor, equal for the same inputs in the guide and in the model. A minibatch ``X[idx]``
    is a new tensor in each program (in the modules' own ``model``/``guide`` it carries the tag of ``(X, idx)``;
    in a hand-written program it does not), so two keys are equal when they hold the same tensor at the same version,
    carry the same tag, or hold equal values (``torch.equal``: ``O(B D)``, nothing beside the ``O(M^2 B)`` that a
    cache hit saves). Only the entries of one input live in the cache at a time, so this is never ambiguous."""

    __slots__ = ("x", "version", "tag", "_hash")

    def __init__(self, X):
        self.x, self.version, self.tag = X, X._version, getattr(X, "_psgp_key", None)
        self._hash = hash((tuple(X.shape), X.dtype, X.device))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if not isinstance(other, _XKey):
            return NotImplemented
        if self.x is other.x:
            return self.version == other.version
        if self.tag is not None and self.tag == other.tag:
            return True
        a, b = self.x, other.x
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))



class UntrainableWarning(UserWarning):
    """A configuration whose ELBO is right but gives no gradient to the parameters (see :class:`SVGP`).
    A warning: implements no paper equation."""


def _outputs_for(likelihood, num_outputs):
    """``num_outputs`` for a layer with ``likelihood``: a likelihood of ``K > 1`` latent functions (multi-class) needs
    ``K`` outputs and infers it; a mismatch raises, naming ``K``."""
    K = getattr(likelihood, "latent_dim", 1)
    if K == 1:
        return num_outputs
    if num_outputs is None:
        return K
    if num_outputs != K:
        raise ValueError(f"{type(likelihood).__name__} has K = {K} classes (latent functions), so the layer needs "
                         f"num_outputs = {K} (or None, which infers it); got num_outputs = {num_outputs}")
    return num_outputs


def as_inputs(f: torch.Tensor, num_outputs: int | None) -> torch.Tensor:
    """A layer's ``f`` as the next layer's inputs ``[..., B, D]`` (see :meth:`SVGP.sample_hidden`): ``f [..., L, B]``
    becomes ``[..., 1, B, L]`` (``[L, B]`` becomes ``[B, L]``), a single output ``[..., B]`` becomes ``[..., B, 1]``.
    The layer-to-layer propagation of the doubly stochastic deep GP (Salimbeni and Deisenroth 2017), where each
    layer's sampled outputs are the next layer's inputs; a reshaping only, no equation of its own."""
    if num_outputs is None:
        return f.unsqueeze(-1)
    h = f.mT
    return h if f.dim() == 2 else h.unsqueeze(-3)


class Factors:
    """The factors of a layer at a set of inputs: ``Kuu`` ``[(L,) M, M]``, its Cholesky factor ``Luu``, ``Kuf``
    ``[..., (L|1,) M, B]``, ``kdiag`` (``diag Kff``, ``[..., (1,) B]``) and the projection ``W = Luu^{-1} Kuf``,
    formed on first use by :func:`~pyro_sparsegp.linalg.project_chol` (the marginals of ``q(f)`` do not need it:
    :func:`~pyro_sparsegp.linalg.whitened_marginals` forms it inside a fused function). Unpacks as
    ``(Luu, W, kdiag)``."""

    __slots__ = ("Kuu", "Luu", "Kuf", "kdiag", "_W")

    def __init__(self, Kuu, Luu, Kuf, kdiag):
        self.Kuu, self.Luu, self.Kuf, self.kdiag, self._W = Kuu, Luu, Kuf, kdiag, None

    @property
    def W(self) -> torch.Tensor:
        """``Luu^{-1} Kuf`` ``[..., (L|1,) M, B]``, gradient straight to ``Kuu`` (:func:`project_chol`)."""
        if self._W is None:
            (self._W,) = project_chol(self.Kuu, self.Luu, self.Kuf)
        return self._W

    def __iter__(self):
        return iter((self.Luu, self.W, self.kdiag))


def _take(X, idx):
    Xb = X[..., idx, :]
    Xb._psgp_key = (id(X), X._version, tuple(X.shape), id(idx))
    return Xb


class SVGP(PyroModule):
    r"""Sparse variational GP (Hensman, Fusi, Lawrence 2013; Hensman, Matthews, Ghahramani 2015).

    :param kernel: a :class:`pyro.contrib.gp.kernels.Kernel` (its hyperparameters are trained).
    :param Z: initial inducing inputs ``[M, D]`` (shared) or ``[L, M, D]`` (one set per output), or any
        :class:`~pyro_sparsegp.inducing.InducingVariables` (e.g. inducing patches of a convolutional kernel); read
        back as ``gp.Z`` (the tensor) and ``gp.inducing`` (the module).
    :param likelihood: a :class:`~pyro_sparsegp.likelihoods.Likelihood`, or ``None`` for a hidden layer.
    :param int num_outputs: ``L`` independent outputs (``None``: a single output, or, for a likelihood of ``K``
        latent functions such as :class:`~pyro_sparsegp.RobustMax` ``(K)``, ``K``: it is inferred).
    :param bool whiten: put the prior ``N(0, I)`` on ``v = Luu^{-1} u`` instead of ``N(0, Kuu)`` on ``u``.
    :param str name: prefix of the sample sites (and, under Pyro's global parameter store, of the parameters).
        ``None`` (default): ``"gp"``, or ``"gp_2"``, ``"gp_3"``, ... while a module of that name is alive, so that
        two modules never share parameters (:mod:`pyro_sparsegp.naming`).
    :param bool integrate_f: observe ``y`` from :class:`MarginalizedLikelihood` (``f`` integrated out given ``u``;
        same bound, lower variance) instead of sampling the ``<name>.f`` site. The default (``None``) integrates for
        likelihoods that are piecewise constant in ``f``, such as robust-max, whose sampled ``f`` site carries no
        gradient (``False`` warns for them), and samples ``f`` otherwise.
    :param mean_function: a :class:`~pyro_sparsegp.mean_functions.MeanFunction` ``m`` (default: zero): the layer
        models ``f = m(X) + g`` with ``g ~ GP(0, k)`` and ``u = g(Z)``, so ``m(X)`` ``[..., B, L]`` is added, per
        output, to the mean of ``p(f | u)`` and of ``q(f)`` (Salimbeni & Deisenroth 2017, section 3).

    Shapes (``B`` points, ``L`` outputs):

    ==================  ====================  =====================================
    method              input                 output
    ==================  ====================  =====================================
    ``model/guide``     ``X [N, D]``, y       ``f [B]`` or ``f [L, B]``
    ``sample_f``        ``X [..., B, D]``     ``f [..., B]`` or ``[..., L, B]``
    ``predict``         ``X [..., N, D]``     ``(mean, var)`` each ``[..., N]`` or ``[..., N, L]``
    ==================  ====================  =====================================

    ``y`` is ``[N]`` for one output, ``[N, L]`` for ``L`` outputs of an element-wise likelihood and ``[N]`` for a
    likelihood of ``L`` latent functions (``likelihood.latent_dim == L``, e.g. robust-max).
    """

    def __init__(
        self,
        kernel,
        Z: torch.Tensor,
        likelihood: Likelihood | None = None,
        num_outputs: int | None = None,
        whiten: bool = True,
        name: str | None = None,
        integrate_f: bool | None = None,
        jitter: float | None = None,
        mean_function=None,
    ):
        name = unique_name("gp") if name is None else name
        super().__init__(name=name)  # parameters are "<name>.inducing.Z", "<name>.q_u.u_loc", ... in Pyro's store
        if not isinstance(Z, ind.InducingVariables) and not torch.is_tensor(Z):
            Z = as_tensor(Z, "Z")  # numpy, lists, pandas (pyro_sparsegp.inputs), in the default dtype
        num_outputs = _outputs_for(likelihood, num_outputs)
        if torch.is_tensor(Z):  # inducing points; other inducing variables check themselves (inducing.check)
            check_module_args(kernel, Z, likelihood, num_outputs, jitter)
        claim_name(self, name)
        piecewise = bool(getattr(likelihood, "piecewise_constant", False))
        if integrate_f is None:
            integrate_f = piecewise
        elif piecewise and not integrate_f:
            warnings.warn(
                f"{type(likelihood).__name__} is piecewise constant in f: with integrate_f=False the sampled f site "
                "gives an unbiased estimate of the bound but no gradient to the kernel, Z or q(u), so SVI trains "
                "nothing. Use integrate_f=True (the default for it) or fit(..., elbo='analytic') to train.",
                UntrainableWarning,
                stacklevel=2,
            )
        inducing = ind.as_inducing(Z)  # a tensor Z: inducing points; or inducing patches (pyro_sparsegp.inducing)
        per_output = tuple(inducing.batch_shape)
        if per_output and (num_outputs is None or per_output != (num_outputs,)):
            raise ValueError(f"inducing variables with batch shape {per_output} (one set per output) need "
                             f"num_outputs == {per_output[0]}")
        inducing.check(kernel)
        self.kernel = kernel
        self.inducing = inducing
        self.likelihood = likelihood
        self.num_outputs = num_outputs
        self.whiten = whiten
        self.name = name
        self.integrate_f = integrate_f
        self.jitter = jitter
        out = getattr(mean_function, "out_dim", None)
        if out is not None and out != (num_outputs or 1):
            raise ValueError(f"the mean function has {out} outputs but the layer has {num_outputs or 1}")
        self.mean_function = mean_function
        M = inducing.num_inducing
        scale_tril = None
        if not whiten and not sampled_attributes(kernel, names=False):  # start at q(u) = p(u) (unless theta is sampled)
            with torch.no_grad():
                scale_tril = cholesky(ind.Kuu(inducing, kernel), jitter)
        self.q_u = GaussianQ(M, num_outputs, scale_tril)
        self._cache = {}

    @property
    def Z(self) -> torch.Tensor:
        """The inducing inputs (or inducing patches) ``[M, d]`` or ``[L, M, d]``: ``self.inducing.Z``."""
        return self.inducing.Z

    @Z.setter
    def Z(self, value):
        self.inducing.Z = value

    @Z.deleter
    def Z(self):
        del self.inducing.Z

    # -- covariances, computed once per ELBO evaluation ---------------------------------------------------------
    def _param_key(self):
        return values_key(self)

    def _kuu_chol(self, consume: bool):
        """``(Kuu, Luu)``, each ``[M, M]`` or ``[L, M, M]``; cached like :meth:`_stats`."""
        key = ("luu", self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        Kuu = ind.Kuu(self.inducing, self.kernel)
        out = (Kuu, cholesky(Kuu, self.jitter, warn_singular=not self.whiten and KUU_ADVICE))
        if not consume:
            self._cache = {key: out}
        return out

    def _luu(self, consume: bool):
        return self._kuu_chol(consume)[1]

    @layer_method
    def _stats(self, X: torch.Tensor, consume: bool) -> Factors:
        """:class:`Factors` (``Kuu``, ``Luu``, ``Kuf``, ``kff_diag``, and ``W`` on first use) for inputs ``X``
        ``[..., B, D]``; it unpacks as ``(Luu, W, kff_diag)``.

        One-shot cache: the guide (``consume=False``) always computes them afresh and keeps them; the model
        (``consume=True``), which Pyro runs after the guide with the same parameters, takes them out if the key
        (inputs, parameter storage and versions, grad mode) matches, else computes its own. So each ELBO
        evaluation pays for one Cholesky and one solve, and nothing stale is ever read twice."""
        key = ("stats", _XKey(X), self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        Kuu, Luu = self._kuu_chol(consume)
        Xk = self._align(X)
        Kuf = ind.Kuf(self.inducing, self.kernel, Xk)  # [..., (L|1,) M, B]
        kdiag = ind.Kff_diag(self.kernel, Xk)  # [..., (1,) B]
        stats = Factors(Kuu, Luu, Kuf, kdiag)
        if not consume:
            self._cache[key] = stats
        return stats

    def _align(self, X):
        """Inputs laid out against ``f``: ``X [..., B, D]``'s batch dimensions broadcast like any Pyro batch, so
        X's dim -3 stands at f's dim -2, the outputs dimension of a layer with ``L`` outputs; a 2-D ``X`` gets that
        singleton here (``[1, B, D]``)."""
        if self.num_outputs is not None and X.dim() == 2:
            return X.unsqueeze(-3)
        return X

    def _mean(self, X):
        """The mean function at ``X`` ``[..., B, D]`` laid out like ``f``: ``[..., B]`` or ``[..., L, B]`` (``0.0``
        without one). ``m(X)`` ``[..., K, B, L]`` with ``K`` in ``{1, L}`` (X's dim -3 stands at f's dim -2):
        output ``l`` reads row ``l`` (or the only row) of ``X``."""
        if self.mean_function is None:
            return 0.0
        m = self.mean_function(X)
        L = self.num_outputs or 1
        if m.shape[-1] != L:
            raise ValueError(f"the mean function gave {m.shape[-1]} outputs at inputs {tuple(X.shape)}; expected {L}")
        if self.num_outputs is None:
            return m.squeeze(-1)
        if X.dim() == 2 or m.shape[-3] == 1:
            return (m if X.dim() == 2 else m.squeeze(-3)).mT
        return torch.diagonal(m, dim1=-3, dim2=-1).mT

    # -- distributions ------------------------------------------------------------------------------------------
    @layer_method
    def prior(self, Luu: torch.Tensor | None = None) -> dist.MultivariateNormal:
        """``p(u) = N(0, Kuu)`` (``N(0, I)`` when whitened), batch shape ``()`` or ``[L, 1]``."""
        M = self.inducing.num_inducing
        batch = () if self.num_outputs is None else (self.num_outputs, 1)
        zeros = torch.zeros(batch + (M,), dtype=self.inducing.dtype, device=self.inducing.device)
        if self.whiten:
            return dist.Normal(zeros, 1.0).to_event(1)
        if Luu is None:
            Luu = self._luu(consume=False)
        if self.num_outputs is not None or Luu.dim() > 2:  # the data plate's singleton (and the outputs')
            Luu = Luu.unsqueeze(-3)
            Luu = Luu.expand(torch.broadcast_shapes(Luu.shape[:-2], batch) + (M, M))
        return dist.MultivariateNormal(zeros, scale_tril=Luu)

    @layer_method
    def posterior(self) -> dist.MultivariateNormal:
        """``q(u)``, batch shape ``()`` or ``[L, 1]``."""
        return self.q_u()

    @layer_method
    def conditional(self, X: torch.Tensor, u: torch.Tensor, consume: bool = False) -> dist.Normal:
        """``p(f | u)`` at inputs ``X`` ``[..., B, D]``: a Normal with batch shape ``[..., B]`` or ``[..., L, B]``.

        The guide builds it and keeps it; the model, which Pyro replays with the guide's ``u``, takes the same
        object, so the two sites cost one evaluation."""
        us = u if isinstance(u, tuple) else (u,)  # SOLVE-GP passes (u, v)
        key = ("cond", _XKey(X), tuple((id(t), t._version) for t in us), self._param_key())
        if consume and key in self._cache:
            return self._cache.pop(key)
        loc, var = self._moments(X, u, consume)
        fn = ConditionalNormal(loc, var.sqrt())
        if not consume:
            self._cache[key] = fn
        return fn

    def _moments(self, X, u, consume):
        """Mean and variance of ``p(f | u)`` at ``X``, each ``[..., B]`` or ``[..., L, B]``."""
        Luu, W, kdiag = self._stats(X, consume)
        loc = cond.conditional_loc(u, W, None if self.whiten else Luu) + self._mean(X)
        return loc, cond.conditional_var(kdiag, W).expand_as(loc)

    @layer_method
    def qf(self, X: torch.Tensor, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Marginals of ``q(f)`` at ``X`` ``[..., B, D]`` (Hensman 2015 eq. 19, diagonal): ``(mean, var)``, each
        ``[..., B]`` for a single output or ``[..., L, B]`` for ``L`` outputs (the mean function added to the mean)."""
        st = self._stats(X, consume)
        m, C = cond.whitened_q(self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else st.Luu)
        loc, dvar = whitened_marginals(st.Kuf, m, C, st.Kuu, st.Luu)  # W = Luu^{-1} Kuf formed inside
        return loc + self._mean(X), cond.clamp_var(st.kdiag + dvar)

    # -- sites --------------------------------------------------------------------------------------------------
    def outputs_plate(self):
        """The layer's outputs plate (``<name>.outputs``, ``dim=-2``, size ``L``) as drawn in this program by
        :meth:`sample_u`: enter it to observe per-output sites of your own (e.g. ``y.mT`` ``[L, B]`` of a
        multi-output regression written by hand). A null context for a single-output layer."""
        return self._outputs_plate()

    def _outputs_plate(self, new: bool = False):
        # Pyro forbids constructing two plates of the same name in one trace, so each program builds the outputs
        # plate once, in sample_u (the layer's first site), and its other sites enter that same object.
        if self.num_outputs is None:
            return contextlib.nullcontext()
        if new or getattr(self, "_plate", None) is None:
            self._plate = data_plate(f"{self.name}.outputs", self.num_outputs, dim=-2)  # joins AutoGuideList's
        return self._plate

    @layer_method(guide_arg="guide")
    def sample_u(self, guide: bool = False) -> torch.Tensor:
        """Sample site ``<name>.u`` from ``p(u)`` (model) or ``q(u)`` (guide). Call outside the data plate.
        Returns ``u`` ``[..., M]`` (single output) or ``[..., L, 1, M]`` (one row per output: the outputs plate is at
        ``dim=-2`` of the batch shape, so a singleton precedes the event dimension ``M``);
        with ``whiten=True`` the site is the whitened ``v`` with prior ``N(0, I)``. The inducing variables of
        Hensman, Fusi, Lawrence 2013 (section 3.1, with :math:`q(u) = N(m, S)`)."""
        draw_hyperparameters(self)  # PyroSample hyperparameters are sites here, outside the data plate
        with self._outputs_plate(new=True):
            if guide:
                return pyro.sample(f"{self.name}.u", self.posterior())
            return pyro.sample(f"{self.name}.u", self.prior(None if self.whiten else self._luu(consume=True)))

    @layer_method
    def sample_f(self, X: torch.Tensor, u: torch.Tensor, guide: bool = False) -> torch.Tensor:
        """Sample site ``<name>.f`` from ``p(f | u)`` at ``X`` ``[..., B, D]``. Call inside the data plate."""
        with self._outputs_plate():
            fn = self.conditional(X, u, consume=not guide)
            check_plate_alignment(fn.loc, f"{self.name}.f", None if self.num_outputs is None else -2)
            return pyro.sample(f"{self.name}.f", fn)

    def sample_hidden(self, X: torch.Tensor, u, guide: bool = False) -> torch.Tensor:
        """:meth:`sample_f`, laid out as the next layer's inputs: ``f [..., L, B]`` becomes ``[..., 1, B, L]``
        (``[B, L]`` when ``f`` is ``[L, B]``; a single output ``[..., B]`` becomes ``[..., B, 1]``): the outputs move
        to the feature dimension and their plate dimension stays as a singleton, so particle and plate dimensions
        keep their places (see :func:`as_inputs`). Call inside the data plate."""
        return as_inputs(self.sample_f(X, u, guide=guide), self.num_outputs)

    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The data plate ``"<name>.data"`` (``dim=-1``) that :meth:`model` opens for these arguments, drawn from
        this call's own ``X`` ``[..., N, D]``: pass ``create_plates=gp.create_plates`` to an ``AutoGuideList`` (or
        an autoguide) around :meth:`model`, so that the guide also serves other inputs (``Predictive`` on test
        points) instead of reusing the plate of its first call."""
        X = X if isinstance(X, torch.Tensor) else self.check_inputs(X)[0]
        return self._data_plate(X.shape[-2], subsample_size, num_data, X.device)

    def _data_plate(self, N, subsample_size, num_data, device):
        if num_data is None:
            return data_plate(f"{self.name}.data", N, subsample_size=subsample_size, dim=-1, device=device)
        return data_plate(f"{self.name}.data", num_data, subsample=torch.arange(N, device=device), dim=-1)

    def check_inputs(self, X, y=None, subsample_size=None, num_data=None, purpose="model"):
        """The layer's data as tensors, checked (:mod:`pyro_sparsegp.inputs`: tensors, numpy, lists, pandas; floating
        data in the module's dtype and device): ``X`` ``[..., N, D]``; ``y`` ``[..., N]`` (one output, or a class
        label per row; ``[N, 1]`` is taken as ``[N]``) or ``[..., N, L]`` for ``L`` outputs of an element-wise
        likelihood. Returns ``(X, y)``; errors name ``N``, ``D`` and ``L``. Every entry point calls it (``fit``
        once, on the whole data)."""
        X, y = check_data(self, X, y, subsample_size, num_data, purpose)
        D = self.inducing.input_dim(self.kernel)
        if X.dim() < 2 or X.shape[-1] != D:
            raise ValueError(
                f"X must be [N, D] with D = {D} features (the inducing inputs' dimension), got shape "
                f"{tuple(X.shape)}"
            )
        _check_finite("X", X)
        if y is not None:
            lik = self.likelihood
            per_output = self.num_outputs is not None and lik is not None and lik.latent_dim == 1
            y = as_targets(y, X.shape[-2], self.num_outputs, per_output)
            if self.likelihood is not None and deferred.active() is None:  # else fit checked y once (deferred.py)
                self.likelihood.check_y(y)
        return X, y

    def _observe(self, f_or_q, y):
        lik = self.likelihood
        if lik is None:
            return
        if y is not None and self.num_outputs is not None and lik.latent_dim == 1:
            y = y.mT  # [L, B]
        ctx = self._outputs_plate() if lik.latent_dim == 1 else contextlib.nullcontext()
        with ctx:
            if self.integrate_f:
                loc, var = f_or_q
                pyro.sample("y", MarginalizedLikelihood(BoundModule(lik), loc, var), obs=y)
            else:
                lik(f_or_q, y, prefix=self.name)

    @layer_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """Generative model. ``subsample_size``: the plate draws a minibatch of ``X``; ``num_data``: ``X`` already
        is a minibatch of a data set of that size (the likelihood is scaled by ``num_data / len(X)``).
        ``X`` ``[..., N, D]``; ``y`` ``[..., N]`` (single output) or ``[..., N, L]``; returns ``f`` ``[..., B]`` or
        ``[..., L, B]`` (the moments ``(loc, var)`` when ``integrate_f``). With :meth:`guide`, ``Trace_ELBO``
        estimates the bound of Hensman, Matthews, Ghahramani 2015, eq. 21."""
        X, y = self.check_inputs(X, y, subsample_size, num_data)
        u = self.sample_u()
        with self._data_plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            Xb = X if num_data is not None or subsample_size is None else _take(X, idx)
            yb = y if y is None or num_data is not None or subsample_size is None else y[idx]
            if self.integrate_f:
                f = self._moments(Xb, u, consume=True)
            else:
                f = self.sample_f(Xb, u)
            self._observe(f, yb)
        return f

    @layer_method
    def guide(self, X, y=None, *, subsample_size=None, num_data=None):
        """Variational distribution: ``q(u) p(f | u)``. Returns the drawn latent values by site name (a dict, as
        Pyro's autoguides do, so that it can be a part of ``AutoGuideList``). ``X`` ``[..., N, D]``, ``y`` as in
        :meth:`model`; ``u`` ``[..., M]`` or ``[..., L, 1, M]``, ``f`` ``[..., B]`` or ``[..., L, B]`` (Hensman,
        Matthews, Ghahramani 2015, eqs. 18 and 21: :math:`q(f) = \\int p(f|u) q(u) du`)."""
        X, y = self.check_inputs(X, y, subsample_size, num_data)
        u = self.sample_u(guide=True)
        with self._data_plate(X.shape[-2], subsample_size, num_data, X.device) as idx:
            Xb = X if num_data is not None or subsample_size is None else _take(X, idx)
            if self.integrate_f:
                self._stats(Xb, consume=False)
                f = None
            else:
                f = self.sample_f(Xb, u, guide=True)
            if self.likelihood is not None:
                ctx = self._outputs_plate() if self.likelihood.latent_dim == 1 else contextlib.nullcontext()
                with ctx:
                    self.likelihood.guide(lambda: self.qf(Xb), prefix=self.name)
        out = {f"{self.name}.u": u[0], f"{self.name}.v": u[1]} if isinstance(u, tuple) else {f"{self.name}.u": u}
        if f is not None:
            out[f"{self.name}.f"] = f
        return out

    @layer_method
    def analytic_elbo(self, X, y, num_data: int | None = None) -> torch.Tensor:
        """The bound in closed form on a minibatch, without sampling (Hensman 2015 eq. 21; for
        :class:`~pyro_sparsegp.PolyaGammaLogit` the augmented bound of Wenzel et al. 2019 at the optimal ``c``):
        ``num_data / B * sum_n E_q[log p(y_n | f_n)] - KL[q || p]``, an unbiased estimate of the full-data bound.
        This is what ``fit(..., elbo="analytic")`` maximises."""
        X, y = self.check_inputs(X, y, purpose="elbo")
        loc, var = self.qf(X)  # factorises once and keeps the factors for the KL
        kl = self.kl_divergence(consume=True)
        self._cache.clear()
        yt = y.mT if (self.num_outputs is not None and self.likelihood.latent_dim == 1) else y
        scale = (num_data or X.shape[-2]) / X.shape[-2]
        return scale * self.likelihood.expected_log_prob(yt, loc, var).sum() - kl.sum()

    def kl_divergence(self, consume: bool = False) -> torch.Tensor:
        """KL[q || p] of the inducing variables (registered closed forms), batch shape ``()`` or ``[L, 1]``.
        ``consume=True`` reuses the Cholesky factor that the last :meth:`qf` computed (one factorisation for the
        whole closed-form bound)."""
        prior = self.prior(None if self.whiten else self._luu(consume))
        return torch.distributions.kl_divergence(self.posterior(), prior)

    @layer_method
    @torch.no_grad()
    def predict(self, X: torch.Tensor, full: bool = False, batch_size: int | None = None):
        """Mean and variance of ``q(f*)`` at ``X`` ``[..., N, D]`` (no gradients); with ``full=True`` also the
        predictive distribution of ``y*`` from the likelihood, shaped like the training targets (``[..., N]``, or
        ``[..., N, L]``). ``X`` is processed in chunks of ``batch_size`` rows (default: as many as keep the
        ``[L, M, rows]`` projection within 2^24 elements), so memory is bounded."""
        X, _ = self.check_inputs(X, None, purpose="predict")
        batch_size = check_predict(self, full, batch_size)
        multi = self.num_outputs is not None
        Xq = X.unsqueeze(-3) if multi and X.dim() > 2 else X
        parts = [self.qf(Xq[..., i : i + batch_size, :]) for i in range(0, max(X.shape[-2], 1), batch_size)]
        mean, var = (torch.cat(t, -1) for t in zip(*parts, strict=True))  # [..., (L,) N]
        out = (mean.movedim(-2, -1), var.movedim(-2, -1)) if multi else (mean, var)
        if full:
            if self.likelihood is None:
                raise ValueError("predict(full=True) needs a likelihood; this layer has none (a hidden layer)")
            return out + (self.likelihood.predictive(mean, var),)
        return out

    @layer_method
    def qf_full(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Mean ``[..., (L,) N]`` and full covariance ``[..., (L,) N, N]`` of :math:`q(f^*)` at ``X [N, D]``:
        :math:`K_{**} - W^T W + A^T S A` with :math:`W = L_{uu}^{-1} K_{u*}` and :math:`A = W` (whitened) or
        :math:`L_{uu}^{-T} W` (Hensman, Fusi, Lawrence 2013, eq. 7, at test inputs)."""
        Xk = self._align(X)
        terms, proj = self._full_terms(X)
        self._cache.clear()
        cov = kernel_matrix(self.kernel, Xk) - sum(P.mT @ P for P in proj)  # [(L|1,) N, N]
        mean = self._mean(X)
        for W, loc, tril, L in terms:
            A = W if L is None else solve_lower(L, W, transpose=True)
            mean = mean + (loc.unsqueeze(-2) @ A).squeeze(-2)
            SA = tril.mT @ A
            cov = cov + SA.mT @ SA
        return mean, cov

    def _full_terms(self, X):
        """``([(W, m, S^{1/2}, L or None)], [W])``: each set of inducing variables' projection, mean, scale and
        (unwhitened) prior factor, and the projections whose Gram matrices the prior covariance loses."""
        Luu, W, _ = self._stats(X, consume=False)
        return [(W, self.q_u.u_loc, self.q_u.u_scale_tril, None if self.whiten else Luu)], [W]

    @torch.no_grad()
    def sample_posterior(self, X: torch.Tensor, num_samples: int = 1) -> torch.Tensor:
        """Joint draws of ``f*`` from :math:`q(f^*)` at ``X [N, D]`` with its full covariance (smooth function
        draws, not independent marginals): ``[num_samples, N]`` or ``[num_samples, N, L]``."""
        X, _ = self.check_inputs(X, None)
        mean, cov = self.qf_full(X)
        # low-rank by nature: a raised jitter only adds a little independent noise to the draws
        L = cholesky(0.5 * (cov + cov.mT), self.jitter, warn_singular=False, warn_jitter=False)
        eps = torch.randn((num_samples,) + mean.shape, dtype=mean.dtype, device=mean.device)
        f = mean + (L @ eps.unsqueeze(-1)).squeeze(-1)
        return f.movedim(-2, -1) if self.num_outputs is not None else f
