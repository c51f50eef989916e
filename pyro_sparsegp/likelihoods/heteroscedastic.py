r"""The heteroscedastic Gaussian likelihood: two latent functions per observation, the mean and the log noise
standard deviation (a chained GP, Saul, Hensman, Vehtari, Lawrence 2016; the variational heteroscedastic GP of
Lázaro-Gredilla and Titsias 2011). Shapes follow :mod:`.multilatent`: ``f [..., 2, B]``, the observed site and the
expected log-likelihood ``[..., 1, B]``, the predictive ``[..., B]``.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch

from ..linalg import gauss_hermite
from .multilatent import _VAR_FLOOR, _MultiLatent

__all__ = ["HeteroscedasticGaussian"]


class HeteroscedasticGaussian(_MultiLatent):
    r""":math:`y = g + e^{h} \epsilon`, :math:`\epsilon \sim N(0, 1)`, with two latent functions: ``f[..., 0, :]``
    is the mean :math:`g` and ``f[..., 1, :]`` the log noise *standard deviation* :math:`h` (``latent_dim = 2``: a
    layer infers ``num_outputs = 2``). No parameters of its own: the noise is the second GP (give it a constant mean
    function for a starting noise level other than :math:`e^0 = 1`).

    **Expected log-likelihood**, closed form under :math:`q(g) q(h) = N(m_g, v_g) N(m_h, v_h)` (the data term of
    the chained-GP bound of Saul, Hensman, Vehtari, Lawrence 2016, "Chained Gaussian processes", which is that of
    Hensman, Matthews, Ghahramani 2015, eq. 21, with two latents; Lázaro-Gredilla and Titsias 2011, "Variational
    heteroscedastic Gaussian process regression", use the log *variance* :math:`2h`), through
    :math:`\mathbb{E} e^{-2h} = e^{-2 m_h + 2 v_h}`:

    .. math:: \mathbb{E}_q \log p(y \mid g, h) = -\tfrac12 \log 2\pi - m_h
              - \tfrac12 \big((y - m_g)^2 + v_g\big)\, e^{-2 m_h + 2 v_h}.

    **Predictive**: :math:`p(y_*) = \int N(y_*; m_g, v_g + e^{2h}) N(h; m_h, v_h) dh` (``g`` integrated exactly),
    by Gauss-Hermite quadrature over :math:`h` with :meth:`num_nodes` nodes: a ``MixtureSameFamily`` of Normals,
    batch ``[..., B]``, whose mean is :math:`m_g` exactly and whose variance is
    :math:`v_g + \sum_i w_i e^{2 h_i} \approx v_g + e^{2 m_h + 2 v_h}`.

    Shapes: ``f`` and the marginals ``[..., 2, B]``; ``y`` ``[B]``, ``[..., 1, B]`` or ``[..., B]``;
    :meth:`expected_log_prob` ``[..., 1, B]``; :meth:`predictive` batch ``[..., B]``.

    :param int num_gh: Gauss-Hermite nodes of the predictive (and, per latent, of the generic
        :meth:`quadrature_expected_log_prob`).
    """

    def __init__(self, num_gh: int = 20):
        super().__init__(2, num_gh)

    def _flat_distribution(self, f):
        return dist.Normal(f[..., 0, :], f[..., 1, :].exp())

    def expected_log_prob(self, y, f_loc, f_var):
        """The closed form of the class docstring, ``[..., 1, B]`` for marginals ``[..., 2, B]``."""
        self._check_f(f_loc)
        y = self._as_values(self._site_shaped(y, f_loc), f_loc)
        m_g, m_h = f_loc[..., 0:1, :], f_loc[..., 1:2, :]
        v_g, v_h = f_var[..., 0:1, :], f_var[..., 1:2, :]
        return -0.5 * math.log(2 * math.pi) - m_h - 0.5 * ((y - m_g).pow(2) + v_g) * (2 * v_h - 2 * m_h).exp()

    def predictive(self, f_loc, f_var):
        """The Gauss-Hermite mixture over the noise latent of the class docstring, batch ``[..., B]``."""
        self._check_f(f_loc)
        f_loc, f_var = torch.broadcast_tensors(f_loc, f_var)
        m_g, m_h = f_loc[..., 0, :], f_loc[..., 1, :]
        v_g, v_h = f_var[..., 0, :].clamp(min=0), f_var[..., 1, :].clamp(min=_VAR_FLOOR)
        x, w = gauss_hermite(self.num_nodes(v_h), f_loc.dtype, f_loc.device)
        h = m_h.unsqueeze(-1) + v_h.sqrt().unsqueeze(-1) * x  # [..., B, n]
        scale = (v_g.unsqueeze(-1) + (2 * h).exp()).sqrt()
        component = dist.Normal(m_g.unsqueeze(-1).expand_as(scale), scale)
        return dist.MixtureSameFamily(dist.Categorical(probs=w.expand(scale.shape)), component)
