"""What every layer shares apart from its strategy: argument checks at construction, the inputs' and targets'
checks, the data and outputs plates, the mean function laid out like ``f``, and :func:`as_inputs` (a layer's ``f``
as the next layer's inputs). No paper equation: the plumbing of the site contract of ``DESIGN.md``."""

from __future__ import annotations

import contextlib

import torch

from .. import covariances as cov
from .. import inducing as ind
from ..checks.inputs import as_targets, as_tensor
from ..checks.validation import check_data, check_module_args
from ..context import deferred
from ..context.composition import plate as data_plate
from ..context.reporting import warn
from ..likelihoods import _check_finite
from ..likelihoods.base import check_likelihood
from .outputs import check_outputs, check_targets

__all__ = ["as_inputs", "named_data_plate", "sample_marginal", "qf_points", "UntrainableWarning", "LayerData",
           "layer_arguments"]


class UntrainableWarning(UserWarning):
    """A configuration whose ELBO is right but gives no gradient to the parameters (see :class:`SVGP`).
    A warning: implements no paper equation."""


def _outputs_for(likelihood, num_outputs):
    """``num_outputs`` for a layer with ``likelihood``: a likelihood of ``K > 1`` latent functions (multi-class,
    heteroscedastic, ``from_distribution(..., latent_dim=K)``) needs ``K`` outputs and infers it; a mismatch raises,
    naming ``K``."""
    K = getattr(likelihood, "latent_dim", 1)
    if K == 1:
        return num_outputs
    if num_outputs is None:
        return K
    if num_outputs != K:
        what = "classes (latent functions)" if hasattr(likelihood, "num_classes") else "latent functions per point"
        raise ValueError(f"{type(likelihood).__name__} has K = {K} {what}, so the layer needs "
                         f"num_outputs = {K} (or None, which infers it); got num_outputs = {num_outputs}")
    return num_outputs


def layer_arguments(kernel, Z, likelihood, num_outputs, integrate_f, jitter, mean_function, num_latents=None):
    """The checked ``(inducing, num_outputs, integrate_f)`` of a layer: ``Z`` as inducing variables (a tensor, numpy
    array or list: inducing points ``[(L,) M, D]``, ``[(Q,) M, D]`` with ``Q = num_latents`` latent GPs),
    ``num_outputs`` inferred from a multi-class likelihood, ``integrate_f`` defaulting to ``True`` for a likelihood
    that is piecewise constant in ``f`` (whose sampled ``f`` site carries no gradient: ``False`` warns), one set of
    inducing variables per output (per latent GP) only with ``L`` outputs (``Q`` latents), and the outputs' own
    arguments (:func:`~pyro_sparsegp.layers.outputs.check_outputs`). Raises ``ValueError`` naming the offending
    shapes. Argument checks: implements no paper equation."""
    if not isinstance(Z, ind.InducingVariables) and not torch.is_tensor(Z):
        Z = as_tensor(Z, "Z")  # numpy, lists, pandas (pyro_sparsegp.checks.inputs), in the default dtype
    num_outputs = _outputs_for(likelihood, num_outputs)
    check_outputs(kernel, likelihood, num_outputs, num_latents)
    gps = num_outputs if num_latents is None else num_latents  # the independent GPs: outputs, or latents
    if torch.is_tensor(Z):  # inducing points; other inducing variables check themselves (inducing.check)
        check_likelihood(likelihood)
        check_module_args(kernel, Z, likelihood, num_outputs, jitter)
    piecewise = bool(getattr(likelihood, "piecewise_constant", False))
    if integrate_f is None:
        integrate_f = piecewise
    elif piecewise and not integrate_f:
        warn(
            f"{type(likelihood).__name__} is piecewise constant in f: with integrate_f=False the sampled f site "
            "gives an unbiased estimate of the bound but no gradient to the kernel, Z or q(u), so SVI trains "
            "nothing. Use integrate_f=True (the default for it) or fit(..., elbo='analytic') to train.",
            UntrainableWarning,
        )
    inducing = ind.as_inducing(Z)  # a tensor Z: inducing points; or inducing patches (pyro_sparsegp.inducing)
    per_output = tuple(inducing.batch_shape)
    if per_output and (gps is None or per_output != (gps,)):
        which = "num_outputs" if num_latents is None else "num_latents (one set per latent GP)"
        raise ValueError(f"inducing variables with batch shape {per_output} (one set per output) need "
                         f"{which} == {per_output[0]}")
    cov.check(inducing, kernel)
    out = getattr(mean_function, "out_dim", None)
    if out is not None and out != (num_outputs or 1):
        raise ValueError(f"the mean function has {out} outputs but the layer has {num_outputs or 1}")
    return inducing, num_outputs, integrate_f


def named_data_plate(name: str, N: int, subsample_size, num_data, device):
    """The data plate ``"<name>.data"`` (``dim=-1``) over ``N`` rows: a minibatch of ``subsample_size`` drawn by the
    plate, or (``num_data``) the ``N`` given rows standing for a data set of ``num_data`` (the likelihood is scaled by
    ``num_data / N``). The minibatch estimate of Hensman, Fusi, Lawrence 2013, section 3.1. The sites under it are
    ``[..., B]`` (``[..., L, B]`` inside the outputs plate, ``dim=-2``), ``B`` the rows drawn."""
    if num_data is None:
        return data_plate(f"{name}.data", N, subsample_size=subsample_size, dim=-1, device=device)
    return data_plate(f"{name}.data", num_data, subsample=torch.arange(N, device=device), dim=-1)


def as_inputs(f: torch.Tensor, num_outputs: int | None) -> torch.Tensor:
    """A layer's ``f`` as the next layer's inputs ``[..., B, D]`` (see :meth:`SVGP.sample_hidden`): ``f [..., L, B]``
    becomes ``[..., 1, B, L]`` (``[L, B]`` becomes ``[B, L]``), a single output ``[..., B]`` becomes ``[..., B, 1]``.
    The layer-to-layer propagation of the doubly stochastic deep GP (Salimbeni and Deisenroth 2017), where each
    layer's sampled outputs are the next layer's inputs; a reshaping only, no equation of its own."""
    if num_outputs is None:
        return f.unsqueeze(-1)
    h = f.mT
    return h if f.dim() == 2 else h.unsqueeze(-3)


def qf_points(layer, X: torch.Tensor, latent: bool = False):
    """``layer.qf(X)`` for sample-batched inputs ``[..., 1, B, D]``, computed on the points flattened to
    ``[P B, D]``: the marginals are point-wise, and one ``[M, P B]`` projection is one large BLAS call instead of
    ``P`` broadcast ones (the inducing inputs, shared by the samples, are never expanded). Same values and shapes
    (``[..., L, B]`` or ``[..., 1, B]``) as ``layer.qf(X)``: the diagonal of ``q(f)``, Hensman, Matthews, Ghahramani
    2015, eq. 19. ``latent=True``: an LMC layer's ``layer.latent_qf(X)``, ``[..., Q, B]``."""
    qf = layer.latent_qf if latent else layer.qf
    if X.dim() <= 2 or X.shape[-3] != 1:
        return qf(X)
    lead, B = X.shape[:-3], X.shape[-2]
    loc, var = qf(X.reshape(-1, X.shape[-1]))  # [(L,) P B]
    if layer.num_outputs is None:
        return loc.reshape(lead + (1, B)), var.reshape(lead + (1, B))
    L = loc.shape[-2]

    def back(t):
        return t.reshape((L,) + lead + (B,)).movedim(0, -2)

    return back(loc), back(var)


def sample_marginal(layer, X: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
    r"""A reparameterised draw from the layer's marginal :math:`q(f_n \mid x_n)` at every point of ``X`` (``u``
    integrated out; Salimbeni & Deisenroth 2017, eq. 7), laid out as the next layer's inputs.

    :param X: ``[..., B, D]`` (``[S, 1, B, D]`` for samples of the layer below).
    :param num_samples: ``S`` draws when ``X`` carries no sample dimension (``X`` ``[B, D]``), else ``None``.
    :returns: ``[..., 1, B, L]`` (``[S, 1, B, L]`` from a 2-D ``X`` with ``num_samples``).

    An LMC layer draws its latents ``g`` ``[..., Q, B]`` from their marginals and returns ``W g + m(X)``: a draw
    from the joint marginal of the ``L`` outputs at each point, ``N(W m, W diag(v) W^T)`` (Álvarez, Rosasco,
    Lawrence 2012, section 4.2).
    """
    if layer.num_outputs is None:
        raise ValueError(f"layer {layer.name!r} is a hidden layer: give it num_outputs (its width, 1 included)")
    lmc = getattr(layer, "num_latents", None) is not None
    loc, var = qf_points(layer, X, latent=lmc)  # [..., L, B] ([..., Q, B] for an LMC layer's latents)
    shape = loc.shape if num_samples is None else (num_samples,) + loc.shape
    eps = torch.randn(shape, dtype=loc.dtype, device=loc.device)
    f = loc + var.sqrt() * eps
    if lmc:
        f = layer.strategy.mix_sample(f) + layer._mean(X)  # [..., L, B]
    return as_inputs(f, layer.num_outputs)


class LayerData:
    """Mixin of the layers: their plates, their inputs' checks and the mean function laid out like ``f``. Expects
    ``name``, ``num_outputs``, ``kernel``, ``inducing``, ``likelihood`` and ``mean_function`` on the layer. Inputs
    ``X`` ``[..., B, D]``, ``f`` ``[..., B]`` or ``[..., L, B]``. The data plate scales a minibatch's likelihood to
    the whole data set, the stochastic estimate of the sum over points of Hensman, Fusi, Lawrence 2013, eq. 4
    (section 3.1; Hensman, Matthews, Ghahramani 2015, eq. 21, for any likelihood); the rest is plumbing that
    implements no paper equation."""

    # -- the hidden-layer protocol of DeepGP (pyro_sparsegp.layers.deep.LAYER_PROTOCOL) ------------------------------
    @property
    def input_dim(self) -> int:
        """``D``, the features of the inputs ``X [..., B, D]`` (the inducing variables' dimension)."""
        return self.inducing.input_dim(self.kernel)

    @property
    def output_dim(self):
        """``L``, the features this layer gives the next one, whose inputs are ``[..., B, L]`` (``None`` for a single
        output without ``num_outputs``: such a layer cannot be hidden)."""
        return self.num_outputs

    def as_next_inputs(self, f: torch.Tensor) -> torch.Tensor:
        """``f`` ``[..., (L,) B]`` as the next layer's inputs ``[..., (1,) B, L]`` (:func:`as_inputs`)."""
        return as_inputs(f, self.num_outputs)

    def propagate_marginal(self, X: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
        """A reparameterised draw from the marginals of ``q(f)`` at ``X`` ``[..., B, D]`` laid out as the next
        layer's inputs ``[..., 1, B, L]`` (:func:`sample_marginal`, which gives the shapes; Salimbeni & Deisenroth
        2017, eq. 7)."""
        return sample_marginal(self, X, num_samples)

    def clear_cache(self) -> None:
        """Drop the strategy's cached factors (after a closed-form bound or a prediction). No tensors, so shapes do
        not apply."""
        self.strategy.clear()

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

    def create_plates(self, X, y=None, *, subsample_size=None, num_data=None):
        """The data plate ``"<name>.data"`` (``dim=-1``) that :meth:`model` opens for these arguments, drawn from
        this call's own ``X`` ``[..., N, D]``: pass ``create_plates=gp.create_plates`` to an ``AutoGuideList`` (or
        an autoguide) around :meth:`model`, so that the guide also serves other inputs (``Predictive`` on test
        points) instead of reusing the plate of its first call."""
        X = X if isinstance(X, torch.Tensor) else self.check_inputs(X)[0]
        return self._data_plate(X.shape[-2], subsample_size, num_data, X.device)

    def _data_plate(self, N, subsample_size, num_data, device):
        return named_data_plate(self.name, N, subsample_size, num_data, device)

    def check_inputs(self, X, y=None, subsample_size=None, num_data=None, purpose="model"):
        """The layer's data as tensors, checked (:mod:`pyro_sparsegp.checks.inputs`: tensors, numpy, lists, pandas;
        floating data in the module's dtype and device): ``X`` ``[..., N, D]``; ``y`` ``[..., N]`` (one output, or a
        class label per row; ``[N, 1]`` is taken as ``[N]``) or ``[..., N, L]`` for ``L`` outputs of an element-wise
        likelihood, where ``NaN`` marks an output that is not observed (masked out of the bound; a row needs one
        observed output). Returns ``(X, y)``; errors name ``N``, ``D`` and ``L``. Every entry point calls it (``fit``
        once, on the whole data)."""
        X, y = check_data(self, X, y, subsample_size, num_data, purpose)
        D = self.inducing.input_dim(self.kernel)
        if X.dim() < 2 or (not deferred.tracing() and X.shape[-1] != D):
            raise ValueError(
                f"X must be [N, D] with D = {D} features (the inducing inputs' dimension), got shape "
                f"{tuple(X.shape)}"
            )
        _check_finite("X", X)
        if y is not None:
            lik = self.likelihood
            per_output = self.num_outputs is not None and lik is not None and lik.latent_dim == 1
            y = as_targets(y, X.shape[-2], self.num_outputs, per_output, lik)
            check_targets(lik, y, per_output)  # NaN: a missing output (L outputs), else an error
        return X, y

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
