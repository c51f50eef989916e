r"""Convolutional GP layers: a hidden convolutional GP layer and a deep convolutional GP (Blomqvist, Kaski and
Heinonen 2018; Dutordoir et al. 2020; the SOLVE-GP version of Shi, Titsias and Mnih 2020, sec. 4, eq. 11 and
appendix G.2, table 5), plus inducing-patch initialisation.

**Hidden layer** (:class:`ConvLayer`). Input: flattened feature maps ``X`` ``[..., B, H*W*C_in]``. Patches
``x[p]`` (``h x w x C_in``, stride ``s``, ``P_out`` output locations). Output channel ``c`` at location ``p``:
``F[p, c] = m(x)[p, c] + g_c(x[p])``, with ``C_out`` independent GPs ``g_c`` on patches that share one kernel and one
set of ``M`` inducing patches (``u_c = g_c(Z)``, one ``q(u_c)`` per channel; a SOLVE-GP layer adds ``M2``
orthogonal patches ``O``). ``m`` is the identity convolution (``mean="identity"``): the patch's centre pixel (row
``h // 2``, column ``w // 2``), channel ``c`` when ``C_in == C_out``, else the mean over the input channels copied to
every output channel (the skip connection of GPflux1's ``IdentityConvMean``; ``mean="zero"`` for Shi et al.'s
"zero mean function"). Sampling is per image, location and channel from the marginals of ``p(g_c(x[p]) | u_c)``,
ignoring the correlations between locations (Dutordoir et al. 2020; Shi et al. 2020, app. G.2). The output is the
next layer's input, ``[..., B, P_out*C_out]`` (flattened ``[H_out, W_out, C_out]`` feature map).

**Layer contract.** Inputs ``[..., B, D]`` with leading dims (particles, outer plates) left of the outputs plate
(dim -2) and the data plate (dim -1); :meth:`ConvLayer.sample_u` samples the site(s) ``<name>.u`` (``.v``) of shape
``[..., C_out, 1, M]``; :meth:`ConvLayer.sample` returns the reparameterised per-point samples.

**Deep model** (:class:`DeepConvGP`): hidden :class:`ConvLayer` s feeding an output :class:`~pyro_sparsegp.SVGP` or
:class:`~pyro_sparsegp.SOLVEGP` with a :class:`~pyro_sparsegp.kernels.conv.TICK` kernel, indexed inducing patches
and a multi-class likelihood (latent functions integrated by quadrature given ``u``). ``Trace_ELBO`` (or
``TraceMeanField_ELBO`` for analytic KLs) with vectorised particles on ``model``/``guide`` estimates eq. 11 of Shi et
al. (eq. 39 for the variational distribution; SVGP layers: Salimbeni and Deisenroth 2017, eq. 4 with sampled ``u``).
:meth:`DeepConvGP.analytic_elbo` is the estimator that ``fit`` maximises by default: every ``u`` integrated out, each
hidden location and channel sampled from its marginal of ``q`` (Salimbeni and Deisenroth's eq. 7, as GPflux's
convolutional layers sample), the output layer's expectation by quadrature. Its variance is far smaller. Where an
output patch spans several hidden locations the two estimate slightly different objectives: sampling ``u`` keeps the
correlation that ``u`` induces between the locations of one image, the marginals drop it (both drop the correlation
of ``p(F | u)`` between locations, as Dutordoir et al. 2020 and Shi et al., appendix G.2, do). With one hidden
location per output patch, or a point-mass ``q(u)``, they estimate the same bound (tested).
"""

from __future__ import annotations

import math

import torch
from pyro.nn import PyroModule, pyro_method

from ..context.naming import unique_name
from ..inducing import IndexedInducingPatches
from ..kernels.conv import TICK, _image, _pair, output_shape, patches
from .deep import DeepGP
from .solvegp import SOLVEGP
from .svgp import SVGP

__all__ = ["ConvLayer", "DeepConvGP"]


class ConvLayer(PyroModule):
    """Hidden convolutional GP layer (module docstring).

    :param base_kernel: patch kernel ``k_g`` on ``h*w*C_in`` features (e.g. ``RBF``; Shi et al.: lengthscale and
        variance 5).
    :param image_shape: ``(H, W, C_in)`` of the input feature map.
    :param patch_size: ``h`` or ``(h, w)``. :param stride: ``s``. :param int out_channels: ``C_out``.
    :param torch.Tensor Z: inducing patches ``[M, h*w*C_in]`` (shared by the channels).
    :param O: orthogonal inducing patches ``[M2, h*w*C_in]``: a SOLVE-GP layer; ``None``: SVGP.
    :param bool whiten: Shi et al. use no whitening in multi-layer models (the default here).
    :param str mean: ``"identity"`` or ``"zero"``.

    ``gp`` is the underlying :class:`~pyro_sparsegp.SVGP` / :class:`~pyro_sparsegp.SOLVEGP` over patches with
    ``num_outputs = C_out``. ``output_image_shape = (H_out, W_out, C_out)``; ``output_dim = H_out*W_out*C_out``.
    """
    # constructor arguments kept under another attribute (dotted path): read by saving.describe
    _saving_aliases = {"base_kernel": "gp.kernel", "Z": "gp.inducing", "O": "gp.orthogonal", "whiten": "gp.whiten",
                      "jitter": "gp.jitter"}

    def __init__(
        self,
        base_kernel,
        image_shape,
        patch_size,
        stride,
        out_channels: int,
        Z: torch.Tensor,
        O: torch.Tensor | None = None,  # noqa: E741 (the paper's name)
        whiten: bool = False,
        mean: str = "identity",
        name: str | None = None,
        jitter: float | None = None,
    ):
        name = unique_name("conv") if name is None else name
        super().__init__(name=name)
        if mean not in ("identity", "zero"):
            raise ValueError(f"mean must be 'identity' or 'zero', got {mean!r}")
        self.image_shape = _image(image_shape)
        self.patch_size, self.stride = _pair(patch_size), _pair(stride)
        self.out_channels = int(out_channels)
        Ho, Wo = output_shape(self.image_shape, self.patch_size, self.stride)
        self.output_image_shape = (Ho, Wo, self.out_channels)
        self.num_locations = Ho * Wo
        self.output_dim = Ho * Wo * self.out_channels
        self.mean = mean
        self.name = name
        if O is None:
            self.gp = SVGP(base_kernel, Z, None, num_outputs=self.out_channels, whiten=whiten, name=name, jitter=jitter)
        else:
            self.gp = SOLVEGP(base_kernel, Z, O, None, num_outputs=self.out_channels, whiten=whiten, name=name,
                              jitter=jitter)

    def extract(self, X: torch.Tensor) -> torch.Tensor:
        """Patches as GP inputs: ``X`` ``[..., B, H*W*C_in]`` -> ``[..., B*P_out, h*w*C_in]``."""
        p = patches(X, self.image_shape, self.patch_size, self.stride)
        return p.reshape(p.shape[:-3] + (-1, p.shape[-1]))

    def mean_function(self, X: torch.Tensor) -> torch.Tensor:
        """The identity-convolution mean ``[..., B, P_out, C_out]`` (module docstring), or zeros."""
        p = patches(X, self.image_shape, self.patch_size, self.stride)  # [..., B, P, h*w*C_in]
        if self.mean == "zero":
            return p.new_zeros(p.shape[:-1] + (self.out_channels,))
        (h, w), C = self.patch_size, self.image_shape[2]
        centre = ((h // 2) * w + w // 2) * C
        pix = p[..., centre : centre + C]  # [..., B, P, C_in]
        if C == self.out_channels:
            return pix
        return pix.mean(-1, keepdim=True).expand(pix.shape[:-1] + (self.out_channels,))

    # -- the hidden-layer protocol of DeepGP (pyro_sparsegp.layers.deep.LAYER_PROTOCOL) ------------------------------
    @property
    def input_dim(self) -> int:
        """``H*W*C_in``, the features of a flattened input feature map ``X`` ``[..., B, H*W*C_in]``."""
        return math.prod(self.image_shape)

    @property
    def strategy(self):
        """The variational strategy of the GP over patches (its ``sites`` name the layer's sample sites). An
        object, not a tensor, so shapes do not apply."""
        return self.gp.strategy

    def clear_cache(self) -> None:
        """Drop the cached factors of the GP over patches. No tensors, so shapes do not apply."""
        self.gp.strategy.clear()

    @pyro_method
    def sample_u(self, guide: bool = False):
        """Sample site ``<name>.u`` (SOLVE-GP: and ``<name>.v``), ``[..., C_out, 1, M]``, from the prior or ``q``."""
        return self.gp.sample_u(guide)

    def sample_hidden(self, X: torch.Tensor, u, guide: bool = False) -> torch.Tensor:
        """:meth:`sample` at ``X`` given ``u`` (no sample site: the draw is reparameterised from the marginals of
        ``p(F | u)``, which cancel between model and guide). ``[..., 1, B, P_out*C_out]``."""
        Xp = self.extract(X)
        loc, var = self.gp.moments(Xp, u, consume=True)  # [..., C_out, B*P]; reuses the prior's Cholesky factor
        return self._to_map(loc + var.sqrt() * torch.randn_like(loc), X)

    def _to_map(self, f: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        """``f`` ``[..., C_out, B*P]`` -> feature map plus the mean, laid out as the next layer's inputs (the layer
        contract, :func:`pyro_sparsegp.layers.base.as_inputs`): ``[B, P*C_out]`` for ``f`` ``[C_out, B*P]``, else
        ``[..., 1, B, P*C_out]`` (the outputs' plate dimension stays as a singleton)."""
        B, P, C = X.shape[-2], self.num_locations, self.out_channels
        F = f.reshape(f.shape[:-1] + (B, P)).movedim(-3, -1)  # [..., B, P, C]
        if f.dim() > 2:
            F = F.unsqueeze(-4)  # [..., 1, B, P, C]
        F = F + self.mean_function(X)  # X [..., (1,) B, D] -> [..., (1,) B, P, C]
        return F.reshape(F.shape[:-2] + (P * C,))

    @pyro_method
    def sample(self, X: torch.Tensor, u=None) -> torch.Tensor:
        """Reparameterised per-location, per-channel samples of ``p(F | u)`` at ``X`` ``[..., B, H*W*C_in]`` from
        the marginals: ``[B, P_out*C_out]``, or ``[..., 1, B, P_out*C_out]`` when ``u`` or ``X`` carry particle or
        plate dimensions (``X``'s dim -3 stands at the outputs' plate dimension, as in every layer). ``u=None``:
        sample the model's site ``<name>.u`` here (its prior's factorisation is then reused)."""
        return self.sample_hidden(X, self.sample_u() if u is None else u)

    def propagate_marginal(self, X: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
        """A reparameterised sample from the marginals of ``q(F)`` at ``X`` (``u`` integrated out: Salimbeni and
        Deisenroth 2017, eq. 7, per location and channel): ``[..., B, P_out*C_out]``
        (``[num_samples, ..., 1, B, P_out*C_out]`` with ``num_samples``: the marginals are computed once). Keeps the
        layer's factors for :meth:`kl_divergence` (``consume=True``)."""
        mean, var = self.gp.qf(self.extract(X))
        shape = mean.shape if num_samples is None else (num_samples,) + mean.shape
        f = mean + var.sqrt() * torch.randn(shape, dtype=mean.dtype, device=mean.device)
        return self._to_map(f, X)

    @torch.no_grad()
    def sample_marginal(self, X: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
        """:meth:`propagate_marginal` without gradients (for prediction), with its shapes (e.g. ``[B, P_out*C_out]``
        from ``X`` ``[B, H*W*C_in]``)."""
        out = self.propagate_marginal(X, num_samples)
        self.clear_cache()
        return out

    def kl_divergence(self, consume: bool = False) -> torch.Tensor:
        """The layer's KL terms summed over channels: ``KL[q(u) || p(u)]`` (and ``KL[q(v⊥) || p⊥(v⊥)]``)."""
        return self.gp.kl_divergence(consume).sum()


class DeepConvGP(DeepGP):
    """Deep convolutional GP: hidden :class:`ConvLayer` s, then an output layer with a TICK kernel: the
    doubly stochastic deep GP of Salimbeni and Deisenroth 2017 with convolutional layers, as in the deep
    convolutional GP experiments of Shi, Titsias, Mnih 2020 (appendix G.2; with SOLVE-GP layers, their eq. 11). A
    :class:`~pyro_sparsegp.DeepGP` (its model, guide, ``analytic_elbo``, ``predict``, ``predict_proba`` and
    ``predictive_log_prob``) whose last layer samples ``u`` in the model (``marginalize_last=False``) and integrates
    ``f`` given ``u`` by quadrature; this class only checks the configuration.

    :param hidden: list of :class:`ConvLayer` (each one's ``output_image_shape`` is the next one's input).
    :param output: :class:`~pyro_sparsegp.SVGP` or :class:`~pyro_sparsegp.SOLVEGP` with a
        :class:`~pyro_sparsegp.kernels.conv.TICK` kernel on the last hidden feature map, inducing
        :class:`~pyro_sparsegp.inducing.IndexedInducingPatches`, ``num_outputs = K`` classes, a multi-class
        likelihood and ``integrate_f=True``.
    :param int num_samples: ``S`` samples propagated by :meth:`analytic_elbo`.

    ``X`` ``[B, H*W*C]`` (flattened images), ``y`` ``[B]``; :meth:`predict_proba` gives ``[N, K]``.
    """

    def __init__(self, hidden: list, output: SVGP, num_samples: int = 1, name: str | None = None):
        if not isinstance(output.kernel, TICK) or not isinstance(output.inducing, IndexedInducingPatches):
            raise ValueError("the output layer needs a TICK kernel and IndexedInducingPatches")
        if not output.integrate_f or output.likelihood is None:
            raise ValueError("the output layer needs a likelihood and integrate_f=True")
        hidden = list(hidden)
        for a, b in zip(hidden, hidden[1:] + [None], strict=True):
            nxt = output.kernel.image_shape if b is None else b.image_shape
            if tuple(a.output_image_shape) != tuple(nxt):
                raise ValueError(f"layer {a.name} outputs {a.output_image_shape}, the next layer takes {nxt}")
        super().__init__(hidden + [output], num_samples, marginalize_last=False, name=name)

    @property
    def output(self) -> SVGP:
        """The output layer (``self.last``). A module, not a tensor, so shapes do not apply."""
        return self.last
