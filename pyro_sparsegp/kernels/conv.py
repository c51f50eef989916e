r"""Convolutional kernels on images: the additive / weighted convolutional kernel of van der Wilk, Rasmussen and
Hensman (2017, "Convolutional Gaussian processes", NeurIPS; arXiv 1709.01894) and the translation-insensitive
convolutional kernel TICK of Dutordoir, van der Wilk, Artemev and Hensman (2020, "Bayesian image classification
with deep convolutional Gaussian processes", AISTATS; arXiv 1902.05888).

An image ``x`` ``[H, W, C]`` (flattened row-major to ``H*W*C`` features: the input rows of every layer) is cut into
``P`` patches ``x[p]`` of ``h x w`` pixels with stride ``s`` ("VALID": ``P_out = ((H-h)//s + 1) * ((W-w)//s + 1)``
locations). A patch-response GP ``g ~ GP(0, k_g)`` (any :mod:`pyro.contrib.gp.kernels` kernel on patches) defines

.. math::

    f(x) = c \sum_p w_p\, g(x[p]), \qquad k_f(x, x') = c^2 \sum_{p, p'} w_p w_{p'}\, k_g(x[p], x'[p'])

(van der Wilk et al. 2017, eq. 6 for ``w = 1`` and eq. 10 for the weighted kernel). **Normalisation** ``c``:
``"mean"`` (default, GPflow's and markvdw/convgp's convention) ``c = 1/P``, so that with unit weights a constant image
has ``k_f = k_g``; ``"sum"`` ``c = 1`` (the paper's and Shi et al. 2020's notation); ``"sqrt"`` ``c = 1/sqrt(P)``.
The three differ by a constant factor ``c^2`` on ``k_f`` and ``c`` on ``Kuf``.

**Colour** (channel handling, markvdw/convgp ``cifar.py``): ``colour="patch"`` (default) takes ``h x w x C`` patches
(dimension ``d = h w C``; the patches of deep convolutional layers); ``colour="channels"`` treats every channel's
``h x w`` patch as a further patch of the same ``g`` (``P = P_out * C`` patches of dimension ``h w``, GPflow's
``colour_channels``), with one weight per (location, channel).

**TICK** (:class:`TICK`): the patch response also depends on the patch location ``t_p`` (row and column in the
output grid), ``g ~ GP(0, k_g(z, z') k_t(t, t'))`` with a Matérn-3/2 ``k_t`` of unit variance and learned lengthscale
``l_t``: ``k_f(x, x') = c^2 sum_{p,p'} w_p w_p' k_g(x[p], x'[p']) k_t(t_p, t_p')``. ``l_t -> inf`` gives back the
translation-invariant kernel.

**Cost and memory.** ``Kuf`` of inducing patches (:func:`pyro_sparsegp.covariances.Kuf`) takes ``O(M B P d)``; the
diagonal ``k_f(x_n, x_n)`` (:meth:`ConvKernel.Kdiag`) takes ``O(B P^2 d)`` (the patch Gram of each image: one
batched matrix product per image chunk, which dominates for large ``P``: 576 patches for 28 x 28 images and 5 x 5
patches). Neither ever holds more than ``chunk_elements`` kernel entries at a time: the sums over patches (``Kuf``)
and over images (diagonal) run in chunks, and with gradients enabled each chunk is recomputed in the backward pass
(activation checkpointing), so the ``[M, B, P]`` tensor is never materialised when it would not fit.
"""

from __future__ import annotations

import math

import torch
from pyro.contrib.gp import kernels as pk
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints
from torch.utils.checkpoint import checkpoint

from .batched import kernel_matrix, matern32

__all__ = ["patches", "patch_locations", "output_shape", "ConvKernel", "TICK", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 2**25
"""Default largest number of kernel entries one chunk holds (``2^25``: 128 MiB in float32, 256 MiB in float64)."""

NORMALISATIONS = ("mean", "sum", "sqrt")


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def output_shape(image_shape, patch_size, stride=1) -> tuple[int, int]:
    """``(H_out, W_out)`` of the patch grid: ``((H - h)//s + 1, (W - w)//s + 1)`` ("VALID" padding), for an image
    of shape ``(H, W)`` or ``(H, W, C)``; a tuple of ints. Grid arithmetic: implements no paper equation."""
    H, W = image_shape[0], image_shape[1]
    (h, w), (sh, sw) = _pair(patch_size), _pair(stride)
    if h > H or w > W:
        raise ValueError(f"patch {h}x{w} is larger than the image {H}x{W}")
    return (H - h) // sh + 1, (W - w) // sw + 1


def patches(X: torch.Tensor, image_shape, patch_size, stride=1, channels_as_patches: bool = False) -> torch.Tensor:
    """Image patches: the patches :math:`x^{[p]}` of the convolutional GP :math:`f(x) = \\sum_p w_p g(x^{[p]})`
    (Shi, Titsias, Mnih 2020, section 3.3, after van der Wilk et al. 2017).

    :param X: images ``[..., H, W, C]`` or flattened ``[..., H*W*C]`` (row-major ``H, W, C``).
    :param image_shape: ``(H, W, C)`` (or ``(H, W)`` for ``C = 1``).
    :param patch_size: ``h`` or ``(h, w)``. :param stride: ``s`` or ``(s_h, s_w)``.
    :param channels_as_patches: return each channel's patch separately.
    :returns: ``[..., P_out, h*w*C]`` (patch flattened row-major ``h, w, C``; ``P_out`` row-major over the output
        grid), or ``[..., P_out*C, h*w]`` (location-major, then channel) with ``channels_as_patches``.
    """
    H, W, C = _image(image_shape)
    (h, w), (sh, sw) = _pair(patch_size), _pair(stride)
    Ho, Wo = output_shape((H, W), (h, w), (sh, sw))
    if X.shape[-3:] == (H, W, C):
        img = X
    elif X.shape[-1] == H * W * C:
        img = X.reshape(X.shape[:-1] + (H, W, C))
    else:
        raise ValueError(
            f"X of shape {tuple(X.shape)} is neither [..., {H}, {W}, {C}] nor flattened [..., {H * W * C}]"
        )
    p = img.unfold(-3, h, sh).unfold(-3, w, sw)  # [..., Ho, Wo, C, h, w]
    lead = p.shape[:-5]
    if channels_as_patches:
        return p.reshape(lead + (Ho * Wo * C, h * w))
    return p.permute(*range(len(lead)), -5, -4, -2, -1, -3).reshape(lead + (Ho * Wo, h * w * C))


def patch_locations(image_shape, patch_size, stride=1, dtype=None, device=None) -> torch.Tensor:
    """Locations ``t_p`` ``[P_out, 2]``: (row, column) of each patch in the output grid, in grid units, in the order
    of :func:`patches`: the locations of the TICK kernel's location kernel (Dutordoir et al. 2020; Shi, Titsias,
    Mnih 2020, appendix G.2)."""
    Ho, Wo = output_shape(image_shape, patch_size, stride)
    r, c = torch.meshgrid(torch.arange(Ho), torch.arange(Wo), indexing="ij")
    return torch.stack([r.reshape(-1), c.reshape(-1)], -1).to(dtype=dtype or torch.get_default_dtype(), device=device)


def _image(image_shape) -> tuple[int, int, int]:
    if len(image_shape) == 2:
        return int(image_shape[0]), int(image_shape[1]), 1
    if len(image_shape) == 3:
        return tuple(int(s) for s in image_shape)
    raise ValueError(f"image_shape must be (H, W) or (H, W, C), got {tuple(image_shape)}")


class ConvKernel(PyroModule):
    r"""Weighted convolutional kernel (van der Wilk et al. 2017, eq. 10; the additive kernel with ``weighted=False``).

    :param base_kernel: patch-response kernel ``k_g`` (a :class:`pyro.contrib.gp.kernels.Kernel` on ``d`` features:
        ``h*w*C``, or ``h*w`` with ``colour="channels"``); its hyperparameters are trained.
    :param image_shape: ``(H, W, C)`` or ``(H, W)``; inputs are flattened images ``[..., H*W*C]``.
    :param patch_size: ``h`` or ``(h, w)``. :param stride: ``s`` or ``(s_h, s_w)``.
    :param bool weighted: learn one weight per patch ``w_p`` (``PyroParam``, initialised to 1); else ``w = 1``.
    :param str normalisation: ``"mean"`` (``c = 1/P``), ``"sum"`` (``c = 1``) or ``"sqrt"`` (``c = 1/sqrt(P)``).
    :param str colour: ``"patch"`` (``h x w x C`` patches) or ``"channels"`` (each channel's patches are patches of
        the same ``g``).
    :param int chunk_elements: most kernel entries held by one chunk (module docstring).

    Called like a Pyro kernel: ``kernel(X, Z=None, diag=False)`` returns ``k_f`` ``[N, M]`` or its diagonal ``[N]``.
    ``input_dim = H*W*C``, ``patch_dim = d``, ``num_patches = P``.
    """

    def __init__(
        self,
        base_kernel,
        image_shape,
        patch_size,
        stride=1,
        weighted: bool = True,
        normalisation: str = "mean",
        colour: str = "patch",
        chunk_elements: int = CHUNK_ELEMENTS,
    ):
        super().__init__()
        if normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {normalisation!r}")
        if colour not in ("patch", "channels"):
            raise ValueError(f"colour must be 'patch' or 'channels', got {colour!r}")
        H, W, C = _image(image_shape)
        self.image_shape = (H, W, C)
        self.patch_size, self.stride = _pair(patch_size), _pair(stride)
        self.grid = output_shape((H, W), self.patch_size, self.stride)
        self.colour = colour
        h, w = self.patch_size
        per_loc = C if colour == "channels" else 1
        self.num_locations = self.grid[0] * self.grid[1]
        self.num_patches = self.num_locations * per_loc
        self.patch_dim = h * w * (1 if colour == "channels" else C)
        self.input_dim = H * W * C
        self.active_dims = None  # every feature: pyro_sparsegp.kernels.expected_input_dim reads input_dim
        if getattr(base_kernel, "input_dim", self.patch_dim) != self.patch_dim:
            raise ValueError(
                f"base_kernel.input_dim = {base_kernel.input_dim} but patches have {self.patch_dim} features "
                f"({h}x{w}{'' if colour == 'channels' else f'x{C}'})"
            )
        self.base_kernel = base_kernel
        self.normalisation = normalisation
        self.weighted = weighted
        ones = torch.ones(self.num_patches)
        if weighted:
            self.weights = PyroParam(ones, constraints.real)
        else:
            self.register_buffer("_unit_weights", ones)
        self.chunk_elements = int(chunk_elements)

    # -- pieces ------------------------------------------------------------------------------------------------
    def extract(self, X: torch.Tensor) -> torch.Tensor:
        """Patches of flattened images ``X`` ``[..., H*W*C]`` -> ``[..., P, d]`` (:func:`patches`)."""
        return patches(X, self.image_shape, self.patch_size, self.stride, self.colour == "channels")

    def locations(self, dtype=None, device=None) -> torch.Tensor:
        """Patch locations ``[P, 2]`` in output-grid units (with ``colour="channels"`` each location repeats ``C``
        times, channel-minor, like the patches)."""
        t = patch_locations(self.image_shape, self.patch_size, self.stride, dtype, device)
        if self.colour == "channels":
            t = t.repeat_interleave(self.image_shape[2], dim=0)
        return t

    def scale(self) -> float:
        """The normalisation constant ``c``, a Python float (no tensor, so shapes do not apply)."""
        P = self.num_patches
        return {"mean": 1.0 / P, "sum": 1.0, "sqrt": 1.0 / math.sqrt(P)}[self.normalisation]

    def effective_weights(self) -> torch.Tensor:
        """``c * w`` ``[P]``."""
        w = self.weights if self.weighted else self._unit_weights
        return self.scale() * w

    def location_factor(self, T1: torch.Tensor | None, T2: torch.Tensor | None) -> torch.Tensor | None:
        """``k_t(T1, T2)`` ``[..., M, P]`` between location sets ``T1`` ``[..., M, 2]`` and ``T2`` ``[P, 2]``, or
        ``None``: no location kernel (the translation-invariant kernel; TICK overrides it)."""
        return None

    # -- k_f ---------------------------------------------------------------------------------------------------
    def Kdiag(self, X: torch.Tensor) -> torch.Tensor:
        """``k_f(x_n, x_n) = c^2 sum_{p,p'} w_p w_p' k_g(x_n[p], x_n[p']) [k_t(t_p, t_p')]``: ``X`` ``[..., B, H*W*C]``
        -> ``[..., B]``. ``O(B P^2 d)``: one ``[P, P]`` patch Gram per image (a batched matrix product), images in
        chunks of at most ``chunk_elements`` entries, recomputed in the backward pass when chunked. For an RBF
        ``k_g`` the weighted sum is one fused function (:class:`_RBFPatchGramDiag`): forward, one batched product, two
        in-place passes and one matrix-vector product; backward, one batched product with ``[P, P]`` and no pass over
        it (plus one for TICK's location factor), where autograd made about ten; the exponent is clamped at 0, which
        only removes rounding above it."""
        Xp = self.extract(X)  # [..., B, P, d]
        lead, (B, P, d) = Xp.shape[:-3], Xp.shape[-3:]
        Xf = Xp.reshape((-1, P, d))
        w = self.effective_weights()
        kt = self.location_factor(*(2 * (self.locations(X.dtype, X.device),)))

        rbf = type(self.base_kernel) is pk.RBF

        def part(Xc, w, kt):
            if rbf:
                return _RBFPatchGramDiag.apply(Xc / self.base_kernel.lengthscale, w, self.base_kernel.variance, kt)
            K = kernel_matrix(self.base_kernel, Xc)  # [Bc, P, P]
            if kt is not None:
                K = K * kt
            return ((K @ w) * w).sum(-1)

        step = max(1, self.chunk_elements // (P * P))
        n = Xf.shape[0]
        outs = []
        for s in range(0, n, step):
            args = (Xf[s : s + step], w, kt)
            chunked = step < n and torch.is_grad_enabled()
            outs.append(checkpoint(part, *args, use_reentrant=False) if chunked else part(*args))
        return torch.cat(outs).reshape(lead + (B,))

    def Kff(self, X: torch.Tensor, X2: torch.Tensor | None = None) -> torch.Tensor:
        """Full ``k_f(X, X2)`` ``[..., N, N2]`` (``O(N N2 P^2 d)``: for tests, small data and inducing points in image
        space): the patch-pair sum of the module docstring."""
        Xp = self.extract(X)  # [..., N, P, d]
        X2p = Xp if X2 is None else self.extract(X2)
        w = self.effective_weights()
        t = self.locations(X.dtype, X.device)
        kt = self.location_factor(t, t)
        out = []
        for n in range(Xp.shape[-3]):  # one row of images at a time: [..., N2, P, P]
            K = kernel_matrix(self.base_kernel, Xp[..., n, :, :].unsqueeze(-3), X2p)
            if kt is not None:
                K = K * kt
            out.append(((w @ K) * w).sum(-1))  # [..., N2]
        return torch.stack(out, -2)

    def forward(self, X, Z=None, diag=False):
        """Pyro-kernel interface: ``k_f(X, Z)`` ``[N, M]``, or the diagonal ``[N]`` with ``diag=True``."""
        if diag:
            return self.Kdiag(X)
        return self.Kff(X, Z)


class _RBFPatchGramDiag(torch.autograd.Function):
    r"""``out_b = var * sum_{p,p'} w_p w_p' E_bpp'`` with ``E_b = exp(-|xs_p - xs_p'|^2 / 2) [* kt]`` for scaled
    patches ``xs`` ``[Bc, P, d]`` (the conv kernel's diagonal with an RBF ``k_g``). With ``G = var g_b (w w^T) o E_b``
    (symmetric) the gradient with respect to ``xs`` is ``2 (G xs - rowsum(G) o xs)``, and ``G xs = var g_b w o
    (E (w o xs))``, ``rowsum(G) = var g_b w o (E w)``: one batched product with ``E``, no elementwise pass over it."""

    @staticmethod
    def forward(ctx, Xs, w, var, kt):
        n = -0.5 * Xs.pow(2).sum(-1, keepdim=True)  # [Bc, P, 1]
        one = torch.ones_like(n)
        # x_p.x_p' - |x_p|^2/2 - |x_p'|^2/2 as one product: the biases ride in two extra columns
        E = torch.cat([Xs, n, one], -1) @ torch.cat([Xs, one, n], -1).mT  # [Bc, P, P]
        E = E.clamp_(max=0.0).exp_()
        Ek = E if kt is None else E * kt
        Ew = Ek @ w  # [Bc, P]
        quad = (Ew * w).sum(-1)  # [Bc]
        ctx.save_for_backward(Xs, w, var, kt, E, Ew, quad)
        return var * quad

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        Xs, w, var, kt, E, Ew, quad = ctx.saved_tensors
        gv = (g * var).reshape(-1, 1, 1)  # [Bc, 1, 1]
        Ek = E if kt is None else E * kt
        g_xs = g_w = g_var = g_kt = None
        if ctx.needs_input_grad[0]:
            wX = w.unsqueeze(-1) * Xs  # [Bc, P, d]
            g_xs = 2.0 * gv * w.unsqueeze(-1) * (Ek @ wX - Ew.unsqueeze(-1) * Xs)
        if ctx.needs_input_grad[1]:
            g_w = _sum_to_shape(2.0 * gv.squeeze(-1) * Ew, w.shape)
        if ctx.needs_input_grad[2]:
            g_var = _sum_to_shape((g * quad).sum(), var.shape)
        if kt is not None and ctx.needs_input_grad[3]:
            gE = (gv.reshape(-1) @ E.reshape(E.shape[0], -1)).reshape(E.shape[-2:])  # sum_b var g_b E_b  [P, P]
            g_kt = _sum_to_shape(gE * (w.unsqueeze(-1) * w), kt.shape)
        return g_xs, g_w, g_var, g_kt


def _sum_to_shape(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum ``t`` down to ``shape`` (autograd's reduction for broadcast inputs); the same elements in another layout
    (a scalar gradient of a one-element ``[1]`` variance) are reshaped."""
    shape = torch.Size(shape)
    if t.shape == shape:
        return t
    if t.numel() == shape.numel():
        return t.reshape(shape)
    lead = t.dim() - len(shape)
    if lead > 0:
        t = t.sum(tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return (t.sum(dims, keepdim=True) if dims else t).reshape(shape)


class TICK(ConvKernel):
    r"""Translation-insensitive convolutional kernel (Dutordoir et al. 2020, eq. 6): :class:`ConvKernel` times a
    Matérn-3/2 kernel over patch locations, ``k_t(t, t') = (1 + sqrt(3) r / l_t) exp(-sqrt(3) r / l_t)``, of unit
    variance (redundant with ``k_g``'s) and learned lengthscale ``location_lengthscale`` (``PyroParam``, in output-grid
    units; Shi et al. 2020, appendix G.2 initialise it to 3). Its inducing variables carry locations
    (:class:`~pyro_sparsegp.inducing.IndexedInducingPatches`). Other arguments as :class:`ConvKernel`. Inputs are
    flattened images ``[..., H*W*C]``; called like a Pyro kernel it returns ``[N, M]`` (or the diagonal ``[N]``)."""

    def __init__(self, base_kernel, image_shape, patch_size, stride=1, location_lengthscale: float = 3.0, **kwargs):
        super().__init__(base_kernel, image_shape, patch_size, stride, **kwargs)
        self.location_lengthscale = PyroParam(torch.tensor(float(location_lengthscale)), constraints.positive)

    def location_factor(self, T1, T2):
        """``k_t(T1, T2)`` ``[..., M, P]``: the unit-variance Matérn-3/2 of the distances between locations ``T1``
        ``[..., M, 2]`` and ``T2`` ``[P, 2]`` in units of ``location_lengthscale`` (Dutordoir et al. 2020, eq. 6)."""
        if T1 is None or T2 is None:
            raise ValueError("TICK needs patch locations: use IndexedInducingPatches (patches with locations)")
        r2 = (T1.unsqueeze(-2) - T2.unsqueeze(-3)).pow(2).sum(-1) / self.location_lengthscale.pow(2)  # [..., M, P]
        return matern32(r2)
