"""Properties of SOLVE-GP's structured covariance (``pyro_sparsegp.variational.structured``; Shi, Titsias, Mnih 2020,
section 3.3): ``q(u, v)`` is the image of ``q(u) q(v_perp)`` under the linear map ``(u, v_perp) -> (u, v_perp + P u)``
with ``P = K_vu K_uu^{-1}``, so its mean and covariance equal ``A m`` and ``A blockdiag(S_u, S_v) A^T`` for the dense
``A = [[I, 0], [P, I]]`` (``P`` by a dense solve); the scale it returns is lower triangular with ``L L^T = S``; and a
Monte Carlo check of the covariance of ``(u, v)`` sampled through that map."""

import torch
from pyro.contrib.gp.kernels import RBF

from pyro_sparsegp.variational.structured import structured_svgp_params


def _case(batch=()):
    torch.manual_seed(1)
    k = RBF(2, lengthscale=torch.tensor(0.8))
    Z, O = torch.randn(4, 2), torch.randn(3, 2)
    Kuu = k(Z) + 1e-6 * torch.eye(4)
    Kuv = k(Z, O)
    m_u, m_v = torch.randn(batch + (4,)), torch.randn(batch + (3,))
    L_u = torch.randn(batch + (4, 4)).tril(-1) * 0.3 + torch.diag_embed(torch.rand(batch + (4,)) + 0.5)
    L_v = torch.randn(batch + (3, 3)).tril(-1) * 0.3 + torch.diag_embed(torch.rand(batch + (3,)) + 0.5)
    return Kuu, Kuv, m_u, L_u, m_v, L_v


def _dense(Kuu, Kuv, m_u, L_u, m_v, L_v):
    P = torch.linalg.solve(Kuu, Kuv).mT  # [M2, M]  Kvu Kuu^{-1}  (Kuu symmetric)
    M, M2 = Kuu.shape[-1], Kuv.shape[-1]
    A = torch.zeros(M + M2, M + M2)
    A[:M, :M], A[M:, M:], A[M:, :M] = torch.eye(M), torch.eye(M2), P
    S0 = torch.block_diag(L_u @ L_u.mT, L_v @ L_v.mT)
    return A @ torch.cat([m_u, m_v]), A @ S0 @ A.mT


def test_structured_mean_and_covariance_are_the_linear_image():
    Kuu, Kuv, m_u, L_u, m_v, L_v = case = _case()
    m, S = structured_svgp_params(*case)
    m_ref, S_ref = _dense(*case)
    torch.testing.assert_close(m, m_ref, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(S, S_ref, rtol=1e-3, atol=1e-4)
    m2, L = structured_svgp_params(*case, return_scale_tril=True)
    torch.testing.assert_close(m2, m)
    assert torch.equal(L, L.tril())
    torch.testing.assert_close(L @ L.mT, S_ref, rtol=1e-3, atol=1e-4)


def test_structured_batched_matches_each_member():
    case = _case((2,))
    m, S = structured_svgp_params(*case)
    assert m.shape == (2, 7) and S.shape == (2, 7, 7)
    for i in range(2):
        Kuu, Kuv, *rest = case
        m_ref, S_ref = _dense(Kuu, Kuv, *(t[i] for t in rest))
        torch.testing.assert_close(m[i], m_ref, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(S[i], S_ref, rtol=1e-3, atol=1e-4)


def test_structured_two_batch_dimensions_on_either_factor():
    """``q(u)`` with batch ``[3, 2]`` and an unbatched ``q(v_perp)``, then the other way round: each member is the
    dense image of its own factors (the batch is the broadcast of both factors' batches)."""
    Kuu, Kuv, m_u, L_u, m_v, L_v = _case((3, 2))
    _, _, m_u0, L_u0, m_v0, L_v0 = _case()
    for args in ((m_u, L_u, m_v0, L_v0), (m_u0, L_u0, m_v, L_v)):
        m, S = structured_svgp_params(Kuu, Kuv, *args)
        assert m.shape == (3, 2, 7) and S.shape == (3, 2, 7, 7)
        for i in range(3):
            for j in range(2):
                member = [t[i, j] if t.dim() > (1 if k % 2 == 0 else 2) else t for k, t in enumerate(args)]
                m_ref, S_ref = _dense(Kuu, Kuv, *member)
                torch.testing.assert_close(m[i, j], m_ref, rtol=1e-3, atol=1e-4)
                torch.testing.assert_close(S[i, j], S_ref, rtol=1e-3, atol=1e-4)


def test_structured_covariance_by_monte_carlo():
    Kuu, Kuv, m_u, L_u, m_v, L_v = case = _case()
    m, S = structured_svgp_params(*case)
    torch.manual_seed(2)
    n = 200_000
    u = m_u + torch.randn(n, 4) @ L_u.mT
    v = m_v + torch.randn(n, 3) @ L_v.mT + u @ torch.linalg.solve(Kuu, Kuv)  # v = v_perp + Kvu Kuu^{-1} u
    uv = torch.cat([u, v], -1)
    C = torch.cov(uv.mT)
    # standard error of a sample covariance entry: sqrt((S_ii S_jj + S_ij^2) / n)
    se = ((S.diagonal()[:, None] * S.diagonal()[None, :] + S.square()) / n).sqrt()
    assert bool(((C - S).abs() < 5 * se + 1e-6).all())
    assert bool(((uv.mean(0) - m).abs() < 5 * (S.diagonal() / n).sqrt() + 1e-6).all())
