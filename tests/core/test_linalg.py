"""The fused projection ``project_chol``, the fused marginals ``whitened_marginals`` and ``gram``: same values as
the plain triangular solve and product, and the
same gradients as autograd through ``torch.linalg.cholesky`` and ``solve_triangular`` (the independent reference),
with broadcast batch dimensions, several right-hand sides, a gradient also reaching the factor ``L`` through another
path, and under ``gradcheck``; ``add_diag`` keeps its input intact."""

import pytest
import torch

from pyro_sparsegp.linalg import add_diag, cholesky, gram, project_chol, solve_lower, whitened_marginals


def _spd(shape, M):
    A = torch.randn(*shape, M, M)
    return A @ A.mT + M * torch.eye(M)


def _reference(K, Rs, use_L):
    L = torch.linalg.cholesky(K)
    Ws = [torch.linalg.solve_triangular(L, R, upper=False) for R in Rs]
    return Ws, L


def _fused(K, Rs, use_L):
    L = cholesky(K, jitter=0.0)
    return list(project_chol(K, L, *Rs)), L


@pytest.mark.float64
@pytest.mark.parametrize(
    "k_batch, r_batches",
    [((), [()]), ((), [(), (3,)]), ((2,), [(4, 2), (2,)]), ((2, 1), [(2, 3), ()])],
    ids=["plain", "two_rhs", "broadcast_rhs", "broadcast_K"],
)
@pytest.mark.parametrize("use_L", [False, True], ids=["W_only", "W_and_L"])
def test_project_chol_matches_autograd_through_cholesky(k_batch, r_batches, use_L):
    M = 5
    K0 = _spd(k_batch, M)
    Rs0 = [torch.randn(*b, M, 3 + i) for i, b in enumerate(r_batches)]
    grads, values = {}, {}
    for name, f in (("ref", _reference), ("fused", _fused)):
        torch.manual_seed(1)
        K = K0.clone().requires_grad_()
        Rs = [R.clone().requires_grad_() for R in Rs0]
        Ws, L = f(K, Rs, use_L)
        loss = sum((W.sin() * torch.randn(W.shape)).sum() for W in Ws)
        if use_L:  # a second path through L (as an un-whitened KL takes): its gradient must add up at K
            loss = loss + (L.diagonal(dim1=-2, dim2=-1).log().sum() + (L * torch.randn(L.shape)).sum())
        grads[name] = torch.autograd.grad(loss, [K, *Rs])
        values[name] = Ws
    for a, b in zip(values["ref"], values["fused"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads["ref"], grads["fused"], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _gradcheck_through_cholesky(fn, *args):
    """``gradcheck`` of ``fn(K, chol(K), *args)`` in ``K`` (symmetrised, 4 x 4) and ``args``."""
    def f(K, *a):
        K = 0.5 * (K + K.mT)
        return fn(K, torch.linalg.cholesky(K), *a)

    return torch.autograd.gradcheck(f, (_spd((), 4).requires_grad_(), *args))


@pytest.mark.float64
def test_project_chol_gradcheck():
    R1, R2 = torch.randn(4, 3, requires_grad=True), torch.randn(2, 4, 2, requires_grad=True)
    assert _gradcheck_through_cholesky(project_chol, R1, R2)


@pytest.mark.float64
def test_gram_gradcheck_and_value():
    A = torch.randn(3, 6, 4, requires_grad=True)
    torch.testing.assert_close(gram(A), A.mT @ A)
    assert torch.autograd.gradcheck(gram, (A,))


def test_project_chol_refuses_double_backward():
    K = _spd((), 3).requires_grad_()
    (W,) = project_chol(K, torch.linalg.cholesky(K), torch.randn(3, 2))
    (g,) = torch.autograd.grad(W.pow(2).sum(), K, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), K)


def test_add_diag_leaves_its_input_and_broadcasts():
    A = torch.randn(2, 3, 3)
    before = A.clone()
    out = add_diag(A, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(A, before)
    torch.testing.assert_close(out - A, torch.diag_embed(torch.tensor([[1.0] * 3, [2.0] * 3])))
    torch.testing.assert_close(add_diag(torch.zeros(3, 3), torch.ones(4)), torch.eye(3).expand(4, 3, 3))


@pytest.mark.float64
@pytest.mark.parametrize(
    "k_batch, r_batch, q_batch",
    [((), (), ()), ((3,), (3,), (3,)), ((3,), (5, 3), (3,)), ((), (4, 1), ()), ((), (1,), (3,)), ((3,), (4, 1), (3,)),
     ((3,), (2, 1), ())],
    ids=["plain", "outputs", "particles", "broadcast_rhs", "shared_Z", "shared_rhs", "shared_q"],
)
@pytest.mark.parametrize("with_K", [True, False], ids=["from_Kuf", "from_W"])
def test_whitened_marginals_match_autograd(k_batch, r_batch, q_batch, with_K):
    """``(m^T W, |C^T W|^2 - |W|^2)`` and its gradients (to K, Kuf or W, m, C) against autograd through
    ``torch.linalg.cholesky``, ``solve_triangular`` and the plain products, with batch dimensions that broadcast
    (particles, outputs sharing inducing inputs, one q for several outputs), a second path through ``L``."""
    M, B = 5, 7
    K = _spd(k_batch, M).requires_grad_()
    R = torch.randn(*r_batch, M, B, requires_grad=True)
    m = torch.randn(*q_batch, M, requires_grad=True)
    C = torch.randn(*q_batch, M, M).tril().requires_grad_()
    out = torch.broadcast_shapes(k_batch + (1,), r_batch + (1,), q_batch + (1,))[:-1] + (B,)
    g_loc, g_var = torch.randn(out), torch.randn(out)

    def ref():
        L = torch.linalg.cholesky(K)
        W = torch.linalg.solve_triangular(L, R, upper=False)
        loc = (m.unsqueeze(-2) @ W).squeeze(-2)
        return loc, (C.mT @ W).pow(2).sum(-2) - W.pow(2).sum(-2), L

    def fused():
        L = cholesky(K, jitter=0.0)
        if with_K:
            return (*whitened_marginals(R, m, C, K, L), L)
        W = torch.linalg.solve_triangular(L, R, upper=False)
        return (*whitened_marginals(W, m, C), L)

    res = {}
    for name, f in (("ref", ref), ("fused", fused)):
        loc, dvar, L = f()
        loss = (loc * g_loc).sum() + (dvar * g_var).sum() + (L * torch.ones_like(L)).tril().sum()
        res[name] = (loc, dvar, *torch.autograd.grad(loss, [K, R, m, C]))
    for a, b in zip(res["ref"], res["fused"], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.float64
def test_whitened_marginals_gradcheck():
    R, m, C = (torch.randn(*shape, requires_grad=True) for shape in ((2, 4, 3), (4,), (4, 4)))
    assert _gradcheck_through_cholesky(lambda K, L, R, m, C: whitened_marginals(R, m, C, K, L), R, m, C)


@pytest.mark.parametrize("layout", ["row_major", "column_major", "one_column", "expanded"])
@pytest.mark.parametrize("transpose", [False, True])
def test_solve_lower_any_layout(layout, transpose):
    """``solve_lower`` solves from the right for row-major right-hand sides; every layout gives the dense answer."""
    M = 6
    L = torch.linalg.cholesky(_spd((2,), M))
    R = {"row_major": torch.randn(2, M, 9), "column_major": torch.randn(2, 9, M).mT, "one_column": torch.randn(2, M, 1),
         "expanded": torch.randn(M, 9).expand(2, M, 9)}[layout]
    A = L.mT if transpose else L
    torch.testing.assert_close(solve_lower(L, R, transpose), torch.linalg.inv(A) @ R)
