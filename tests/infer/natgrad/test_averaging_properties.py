"""Properties of the Polyak-Ruppert iterate average (``pyro_sparsegp.infer.natgrad.averaging``; Polyak and Juditsky
1992): the written-back q(u) has as precision the mean of the iterates' precisions and as ``precision @ mean`` the
mean of theirs (dense inverses), the noise is the mean of the noise variances; steps before ``start`` are left out;
``mark``/``rewind`` drop a window's contributions; no step averaged writes nothing; a family whose averaged precision
is too ill-conditioned keeps its last iterate (named in ``kept``, with a warning unless ``warn=False``)."""

import pytest
import torch

import pyro_sparsegp as ps
from pyro_sparsegp.infer.natgrad.averaging import IterateAverage
from pyro_sparsegp.variational import GaussianQ


def _random_q(q, seed):
    g = torch.Generator().manual_seed(seed)
    M = q.u_loc.shape[-1]
    A = torch.randn(q.u_loc.shape[:-1] + (M, M), generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(A @ A.mT / M + 0.5 * torch.eye(M, dtype=torch.float64))
    q.set(torch.randn(q.u_loc.shape, generator=g, dtype=torch.float64).to(q.u_loc.dtype), L.to(q.u_loc.dtype))


@pytest.mark.float64
def test_average_of_natural_parameters_and_noise():
    q, lik = GaussianQ(3, num_outputs=2), ps.Gaussian(0.5)
    avg = IterateAverage([q], [lik], start=2)
    precs, etas, noises = [], [], []
    for step in range(6):
        _random_q(q, step)
        with torch.no_grad():
            lik.noise = torch.tensor(0.1 * (step + 1))
        avg.update(step)
        if step >= 2:
            S = q.u_scale_tril.detach() @ q.u_scale_tril.detach().mT
            P = torch.linalg.inv(S)
            precs.append(P)
            etas.append((P @ q.u_loc.detach().unsqueeze(-1)).squeeze(-1))
            noises.append(0.1 * (step + 1))
    assert avg.count == 4
    assert avg.write_() is True
    P_bar, eta_bar = sum(precs) / 4, sum(etas) / 4
    S_new = q.u_scale_tril.detach() @ q.u_scale_tril.detach().mT
    torch.testing.assert_close(torch.linalg.inv(S_new), P_bar, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(q.u_loc.detach(), torch.linalg.solve(P_bar, eta_bar.unsqueeze(-1)).squeeze(-1))
    assert float(lik.noise.detach()) == pytest.approx(sum(noises) / 4)
    assert avg.kept == []


@pytest.mark.float64
def test_mark_and_rewind_drop_a_window():
    q = GaussianQ(2)
    ref = IterateAverage([q])
    avg = IterateAverage([q])
    for step in range(3):
        _random_q(q, step)
        ref.update(step)
        avg.update(step)
    avg.mark()
    for step in range(3, 5):  # a window redone: its iterates must not count twice
        _random_q(q, 10 + step)
        avg.update(step)
    avg.rewind()
    assert avg.count == 3
    for a, b in zip(avg.averages()[0], ref.averages()[0], strict=True):
        torch.testing.assert_close(a, b)
    empty = IterateAverage([q])
    empty.mark()
    empty.update(0)
    empty.rewind()
    assert empty.count == 0 and empty.sums is None and empty.averages() == [] and empty.write_() is False


def test_ill_conditioned_average_keeps_the_last_iterate():
    q = GaussianQ(2)
    q.set(torch.zeros(2), torch.diag(torch.tensor([1.0, 1e-6])))  # precision condition number 1e12
    with pytest.warns(RuntimeWarning, match="keeps its last iterate"):
        avg = IterateAverage([q])
        avg.update(0)
        (m, L), = avg.averages()
    torch.testing.assert_close(L, q.u_scale_tril.detach().double())
    assert len(avg.kept) == 1
    quiet = IterateAverage([q], warn=False)
    quiet.update(0)
    quiet.averages()
    assert len(quiet.kept) == 1
    fine = GaussianQ(2)
    fine.set(torch.zeros(2), torch.diag(torch.tensor([1.0, 1e-3])))  # condition number 1e6: averaged
    ok = IterateAverage([fine])
    ok.update(0)
    ok.averages()
    assert ok.kept == []
