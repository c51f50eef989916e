r"""The Bayesian GPLVM on minibatches, with a per-point or an amortised (encoder) guide for the latent points.

The model (Titsias and Lawrence 2010, "Bayesian Gaussian process latent variable model", with the inducing
variables held explicitly and the latent points as local variables visited a minibatch at a time, as Hensman, Fusi,
Lawrence 2013, section 3.3 suggest): ``N`` observations ``y_n`` ``[D]`` are a smooth map of latent points ``x_n``
``[Q]``,

.. math:: x_n \sim N(0, I_Q),\quad u_d \sim p(u),\quad f_{nd} \mid x_n, u_d \sim p(f \mid u_d)\text{ at }x_n,
   \quad y_{nd} \sim p(y \mid f_{nd}),

``D`` independent GPs sharing the kernel (RBF with one lengthscale per latent dimension by default: ARD switches off
the dimensions the data do not need) and the inducing inputs ``Z`` ``[M, Q]`` (an :class:`~pyro_sparsegp.SVGP` with
``num_outputs=D``). ``NaN`` in ``y`` marks an entry that is not observed: it is masked out of the bound.

The guide is ``q(u) p(f | u) prod_n q(x_n)`` with ``q(x_n) = N(mu_n, diag sigma_n^2)``, and the bound on a minibatch
``B`` of rows is

.. math:: \mathcal{L} = \frac{N}{|B|}\sum_{n\in B}\Big(\mathbb{E}_{q(x_n) q(f_n\mid x_n)}\sum_{d\ \rm observed}
   \log p(y_{nd}\mid f_{nd}) - \mathrm{KL}[q(x_n)\,\|\,N(0, I)]\Big) - \sum_d \mathrm{KL}[q(u_d)\,\|\,p(u_d)],

unbiased for the full-data bound: ``x`` is a site inside the subsampled data plate ``<name>.data``, so Pyro scales its
KL by ``N/|B|`` with the likelihood. Memory per step depends on ``|B|``, ``M``, ``D``, ``Q`` only; the per-point guide
keeps ``[N, Q]`` parameters and gathers the minibatch's rows.

* **Per-point guide** (``encoder=None``): ``mu``, ``sigma`` are ``PyroParam``\ s ``[N, Q]`` (``<name>.x_loc``,
  ``<name>.x_scale``), indexed by the minibatch's row indices. The model's inputs ``X`` are those row indices
  (``[N, 1]``, floating or integer: ``gplvm.rows()``), so :func:`~pyro_sparsegp.infer.fit` draws minibatches of rows
  as for any layer: ``fit(gplvm, gplvm.rows(), Y, batch_size=B)``.
* **Amortised guide** (``encoder=`` any ``nn.Module``): ``q(x_n)`` is computed from ``y_n`` by the encoder, the
  back-constraint of Lawrence and Quiñonero-Candela 2006 made variational (the recognition model of Bui and Turner
  2015): parameters independent of ``N`` and a ``q(x*)`` for a new row in one pass. The encoder receives
  ``[..., B, 2 D]``: ``y`` with ``NaN`` replaced by 0, then the mask of observed entries (1.0 observed, 0.0 missing),
  and returns ``[..., B, 2 Q]``: the means, then the scales before a softplus. :func:`mlp_encoder` builds one.
  The encoder is converted in place to a ``PyroModule`` (``pyro.nn.module.to_pyro_module_``) whose parameters are
  ``PyroParam``\ s, which ``SVI`` records and trains like the GP's (a plain ``nn.Parameter`` of a ``PyroModule`` is
  no parameter site under ``module_local_params``); its ``state_dict`` keys end in ``_unconstrained``.
  The row indices are then not read (any ``X`` with ``N`` rows serves).

``fit`` maximises :meth:`GPLVM.analytic_elbo`: ``x`` drawn from ``q(x)`` by reparameterisation, the expected
log-likelihood given ``x`` and both KLs in closed form (Adam on every parameter: with ``x`` sampled the bound is
stochastic, and the natural steps of a conjugate layer are not safe on it, so the GPLVM offers no natural-gradient
families). :meth:`GPLVM.infer_latent` infers ``q(x*)`` for new rows with the GP frozen (the encoder's output, or the
best of a few candidate points, refined by Adam steps on the rows' own bound), :meth:`GPLVM.reconstruct` predicts
``y*`` from it (the hidden entries of partly observed rows).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.contrib.gp.kernels import RBF
from pyro.nn import PyroModule, PyroParam
from pyro.nn.module import to_pyro_module_
from torch.distributions import constraints

from ..checks.inputs import as_tensor, check_missing
from ..context.composition import plate as data_plate
from ..context.naming import KeepsOwnName, claim_name, unique_name
from ..likelihoods import Gaussian
from .gplvm_inference import LatentInference, encoder_inputs, kl_standard_normal, mlp_encoder, pca_init
from .svgp import SVGP

__all__ = ["GPLVM", "mlp_encoder", "pca_init"]


def _count(v, name: str, allow_none: bool = False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def as_pyro_params_(module) -> None:
    """Convert ``module`` in place to a ``PyroModule`` whose ``nn.Parameter`` objects are ``PyroParam`` objects (same
    values and shapes; unconstrained), so that its parameters are sites of the Pyro programs it runs in."""
    to_pyro_module_(module)
    for sub in module.modules():
        for pname, p in list(sub.named_parameters(recurse=False)):
            if pname.endswith("_unconstrained"):
                continue
            delattr(sub, pname)
            setattr(sub, pname, PyroParam(p.detach().clone(), constraints.real))


class GPLVM(LatentInference, KeepsOwnName, PyroModule):
    r"""A Bayesian GPLVM trained on minibatches of rows (module docstring: Titsias and Lawrence 2010; Hensman, Fusi,
    Lawrence 2013, section 3.3; amortisation as Lawrence and Quiñonero-Candela 2006, Bui and Turner 2015).

    :param int Y_dim: ``D``, the observed dimensions (outputs) per row.
    :param int latent_dim: ``Q``, the latent dimensions.
    :param int num_inducing: ``M``, inducing inputs in the latent space (ignored when ``Z`` is given).
    :param kernel: a kernel on ``[..., Q]`` inputs (default ``RBF(Q)`` with ``Q`` lengthscales of 1), shared by the
        ``D`` outputs.
    :param encoder: ``None`` (the per-point guide, ``[N, Q]`` parameters) or an ``nn.Module`` mapping
        ``[..., B, 2 D]`` (``y`` with ``NaN`` as 0, then the observed mask) to ``[..., B, 2 Q]`` (means, then scales
        before a softplus).
    :param int num_data: ``N``, the rows of the training set: needed by the per-point guide (its parameters).
    :param likelihood: an element-wise likelihood (default ``Gaussian(0.1)``: for data standardised to unit spread).
    :param Z: inducing inputs ``[M, Q]`` (default: ``M`` rows of ``X_init``, or ``N(0, I)`` draws).
    :param X_init: initial latent means ``[N, Q]`` of the per-point guide (default ``0.1 N(0, I)`` draws;
        :func:`pca_init` gives the usual PCA start).
    :param float x_scale: the initial posterior sd of every latent point (per-point guide).
    :param str name: prefix of the sites (``<name>.x``, ``<name>.data``, the GP's ``<name>.gp.u``, ``.f``) and
        parameters. Default ``"gplvm"`` (``"gplvm_2"``, ... while one is alive).
    :param int num_samples: ``S``, draws of ``x`` per row in :meth:`analytic_elbo`.

    Shapes: ``X`` row indices ``[N, 1]`` (or ``[N]``); ``y`` ``[N, D]`` with ``NaN`` where missing; ``x``
    ``[..., B, Q]``; ``f`` ``[..., D, B]``. Read ``gplvm.gp`` for the GP (``gplvm.gp.predict(x)`` maps latent points
    ``[N*, Q]`` to the outputs' ``q(f*)``, each ``[N*, D]``).
    """

    _saving_aliases = {"Z": "gp.inducing.Z", "X_init": "x_loc", "x_scale": "_x_scale0"}

    def __init__(self, Y_dim: int, latent_dim: int, num_inducing: int = 32, kernel=None, encoder=None,
                 num_data: int | None = None, likelihood=None, Z=None, X_init=None, x_scale: float = 0.1,
                 name: str | None = None, num_samples: int = 1, jitter: float | None = None):
        name = unique_name("gplvm") if name is None else name
        super().__init__(name=name)
        D, Q = _count(Y_dim, "Y_dim"), _count(latent_dim, "latent_dim")
        M, N = _count(num_inducing, "num_inducing"), _count(num_data, "num_data", allow_none=True)
        self.num_samples = _count(num_samples, "num_samples")
        if encoder is not None and not isinstance(encoder, torch.nn.Module):
            raise TypeError(f"encoder must be a torch.nn.Module ([..., B, 2 D] -> [..., B, 2 Q]), got "
                            f"{type(encoder).__name__}")
        if encoder is None and N is None:
            raise ValueError("the per-point guide keeps q(x_n) for each of the N training rows: give num_data=N, or an "
                             "encoder (e.g. encoder=ps.layers.gplvm.mlp_encoder(Y_dim, latent_dim))")
        claim_name(self, name)
        self.name, self.Y_dim, self.latent_dim, self.num_inducing, self.num_data = name, D, Q, M, N
        self.jitter, self._x_scale0 = jitter, float(x_scale)
        dtype = torch.get_default_dtype()
        if X_init is not None:
            X_init = as_tensor(X_init, "X_init", dtype)
            if encoder is not None:
                raise ValueError("X_init gives the per-point guide's initial means; an encoder has none: drop X_init")
            if tuple(X_init.shape) != (N, Q):
                raise ValueError(f"X_init gives the per-point guide's initial means [N, Q] = [{N}, {Q}], got "
                                 f"{tuple(X_init.shape)}")
        if Z is None:
            Z = (X_init[torch.randperm(N)[:M]] if X_init is not None and N >= M else torch.randn(M, Q, dtype=dtype))
        Z = as_tensor(Z, "Z", dtype)
        if Z.dim() != 2 or Z.shape[-1] != Q:
            raise ValueError(f"Z must be [M, Q] with Q = {Q} latent dimensions, got {tuple(Z.shape)}")
        self.num_inducing = Z.shape[0]
        kernel = RBF(Q, lengthscale=torch.ones(Q, dtype=dtype)) if kernel is None else kernel
        likelihood = Gaussian(0.1) if likelihood is None else likelihood
        if getattr(likelihood, "latent_dim", 1) != 1:
            raise ValueError(f"the GPLVM needs an element-wise likelihood (one y per output); "
                             f"{type(likelihood).__name__} has {likelihood.latent_dim} latent functions")
        self.gp = SVGP(kernel, Z.detach().clone(), likelihood, num_outputs=D, name=f"{name}.gp", jitter=jitter)
        if encoder is not None:
            as_pyro_params_(encoder)  # its parameters become PyroParams: sites that SVI records and trains
        self.encoder = encoder
        if encoder is None:
            loc = 0.1 * torch.randn(N, Q, dtype=dtype) if X_init is None else X_init.detach().clone()
            self.x_loc = PyroParam(loc, constraints.real)
            self.x_scale = PyroParam(torch.full((N, Q), float(x_scale), dtype=dtype), constraints.positive)

    # -- accessors --------------------------------------------------------------------------------------------------
    @property
    def kernel(self):
        """The GP's kernel (a module, so shapes do not apply)."""
        return self.gp.kernel

    @property
    def likelihood(self):
        """The GP's likelihood (a module, so shapes do not apply)."""
        return self.gp.likelihood

    def rows(self) -> torch.Tensor:
        """The training rows' indices ``[N, 1]``, the ``X`` of ``fit(gplvm, gplvm.rows(), Y)``."""
        if self.num_data is None:
            raise ValueError("rows() needs num_data (the per-point guide's N); with an encoder pass any X with N rows, "
                             "e.g. torch.arange(N).unsqueeze(-1)")
        return torch.arange(self.num_data).unsqueeze(-1)

    def natgrad_families(self) -> list:
        """None: ``x`` is sampled in the bound, on which the plain natural step of a conjugate layer is unsafe; ``fit``
        trains ``q(u)`` with Adam (a list of modules, no tensors: shapes do not apply)."""
        return []

    # -- checks -----------------------------------------------------------------------------------------------------
    def check_inputs(self, X, y=None, *args, **kwargs):
        """``(X, y)`` checked: ``X`` row indices ``[N, 1]`` or ``[N]`` (whole numbers in ``[0, num_data)`` for the
        per-point guide), ``y`` ``[N, D]`` in the module's dtype with ``NaN`` where missing (a row needs one observed
        entry). Returns them in the layout given (``y`` as a tensor)."""
        X = X if isinstance(X, torch.Tensor) else as_tensor(X, "X", floating=False)
        if X.dim() == 2 and X.shape[-1] != 1 or X.dim() > 2 or X.dim() == 0:
            raise ValueError(f"a GPLVM's X holds the rows' indices, [N, 1] or [N] (gplvm.rows()), got shape "
                             f"{tuple(X.shape)}: the latent inputs are inferred, not given")
        if y is not None:
            y = as_tensor(y, "y", self.gp.Z.dtype, self.gp.Z.device)
            if y.dim() != 2 or y.shape[-1] != self.Y_dim or y.shape[0] != X.shape[0]:
                raise ValueError(f"y must be [N, D] = [{X.shape[0]}, {self.Y_dim}] (one row per index of X), got "
                                 f"{tuple(y.shape)}")
            self.likelihood.check_y(check_missing(y))  # a row with nothing observed is refused
        return X, y

    def _rows(self, X) -> torch.Tensor:
        """Row indices ``[B]`` (long) of ``X`` ``[B, 1]`` or ``[B]``, checked against ``num_data``."""
        rows = (X.squeeze(-1) if X.dim() == 2 else X)
        rows = rows.round().long() if rows.is_floating_point() else rows.long()
        if self.encoder is None and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_data):
            raise ValueError(f"X holds row indices outside [0, {self.num_data}) (num_data): the per-point guide has "
                             "a q(x_n) for the training rows only; infer_latent(Y_new) gives q(x*) for new rows")
        return rows

    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The data plate ``"<name>.data"`` (``dim=-1``) of :meth:`model` for these arguments (``X`` ``[N, 1]`` row
        indices): pass ``create_plates=gplvm.create_plates`` to an ``AutoGuideList`` around :meth:`model`."""
        return self._plate(self._rows(self.check_inputs(X)[0]), subsample_size, num_data)

    def _plate(self, rows, subsample_size, num_data):
        if num_data is not None:  # rows is a minibatch of a data set of num_data rows: scale N / B
            return data_plate(f"{self.name}.data", num_data, subsample=rows, dim=-1)
        return data_plate(f"{self.name}.data", len(rows), subsample_size=subsample_size, dim=-1)

    def _batch(self, rows, y, idx, subsample_size, num_data):
        if num_data is not None or subsample_size is None:
            return rows, y
        return rows[idx], (None if y is None else y[idx])

    # -- the program ------------------------------------------------------------------------------------------------
    def q_x(self, rows: torch.Tensor, y) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loc, scale)`` of ``q(x_n)``, each ``[B, Q]``: the per-point parameters at ``rows`` ``[B]``, or the
        encoder at ``y`` ``[B, D]`` (``NaN`` where missing)."""
        if self.encoder is None:
            return self.x_loc[rows], self.x_scale[rows]
        if y is None:
            raise ValueError("the encoder guide computes q(x_n) from y_n: pass y")
        out = self.encoder(encoder_inputs(y))
        if out.shape[-1] != 2 * self.latent_dim:
            raise ValueError(f"the encoder returned {out.shape[-1]} features per row; it must return 2 Q = "
                             f"{2 * self.latent_dim} (the means, then the scales before a softplus)")
        loc, raw = out[..., : self.latent_dim], out[..., self.latent_dim:]
        return loc, torch.nn.functional.softplus(raw) + 1e-6

    @pyro.nn.pyro_method
    def model(self, X, y=None, *, subsample_size=None, num_data=None):
        """``u ~ p(u)`` outside the data plate; in it ``x ~ N(0, I)`` ``[..., B, Q]``, ``f ~ p(f | u)`` at ``x``
        ``[..., D, B]`` and ``y`` ``[B, D]`` observed (``NaN`` entries masked). Returns ``f``."""
        X, y = self.check_inputs(X, y)
        rows = self._rows(X)
        u = self.gp.sample_u()
        with self._plate(rows, subsample_size, num_data) as idx:
            rows, yb = self._batch(rows, y, idx, subsample_size, num_data)
            zeros = torch.zeros(len(rows), self.latent_dim, dtype=self.gp.Z.dtype, device=self.gp.Z.device)
            x = pyro.sample(f"{self.name}.x", dist.Normal(zeros, 1.0).to_event(1))
            f = self.gp.sample_f(x, u)
            self.gp._observe(f, yb)
        return f

    @pyro.nn.pyro_method
    def guide(self, X, y=None, *, subsample_size=None, num_data=None) -> dict:
        """``q(u)``; in the data plate ``q(x_n)`` (:meth:`q_x`, ``x`` ``[..., B, Q]``) and ``p(f | u)`` at the drawn
        ``x`` (``f`` ``[..., D, B]``). Returns the drawn values by site name (so that it can be a part of
        ``AutoGuideList``)."""
        X, y = self.check_inputs(X, y)
        rows = self._rows(X)
        u = self.gp.sample_u(guide=True)
        out = {f"{self.gp.name}.u": u}
        with self._plate(rows, subsample_size, num_data) as idx:
            rows, yb = self._batch(rows, y, idx, subsample_size, num_data)
            loc, scale = self.q_x(rows, yb)
            x = out[f"{self.name}.x"] = pyro.sample(f"{self.name}.x", dist.Normal(loc, scale).to_event(1))
            out[f"{self.gp.name}.f"] = self.gp.sample_f(x, u, guide=True)
        return out

    def analytic_elbo(self, X, y, num_data: int | None = None) -> torch.Tensor:
        """The bound of the module docstring on the minibatch ``X`` ``[B, 1]``, ``y`` ``[B, D]``: ``S`` draws of
        ``x`` from ``q(x)`` (reparameterised), the expected log-likelihood of the observed entries given ``x`` and
        both KLs in closed form; ``num_data / B`` times the rows' terms minus ``KL[q(u) || p(u)]``. Returns ``()``;
        what ``fit`` maximises."""
        X, y = self.check_inputs(X, y)
        loc, scale = self.q_x(self._rows(X), y)
        ell = self.expected_log_lik(y, loc, scale, self.num_samples)
        kl_u = self.gp.kl_divergence(consume=True).sum()
        self.gp.strategy.clear()
        kl_x = kl_standard_normal(loc, scale).sum()
        return (num_data or X.shape[0]) / X.shape[0] * (ell - kl_x) - kl_u
