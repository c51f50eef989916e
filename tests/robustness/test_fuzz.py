"""Fuzzing the public API with bad and good inputs (hypothesis): the constructors of SVGP, SOLVEGP, the likelihoods
and PolyaGamma, the data given to ``model``/``guide``/``analytic_elbo``/``predict``, the natural-gradient steps and
the kernels at extreme lengthscales and offsets. Every case must either work -- and then its result is checked
(finite, the right shape; kernel values against exact differences; Pólya-Gamma densities against the
``polyagamma`` package) -- or raise ``ValueError``/``TypeError`` with a message. NaN returned silently, another
exception, or a check that fails is a bug; so is an error raised for a case whose every choice is valid (each menu
says which of its values are: ``*_valid``), so a bug that makes good data raise cannot pass as a "clear error".

Each fuzzed input is drawn from a *menu* of good and bad values; ``python tests/robustness/test_fuzz.py`` enumerates
every combination of the menus once (a fixed set of cases) and prints the counts per outcome for whatever version of
the package it imports."""

from __future__ import annotations

import collections
import itertools
import math
import sys
import warnings

import numpy as np
import pyro
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyro.contrib.gp.kernels import RBF, Matern32
from pyro.infer import Trace_ELBO

import pyro_sparsegp as ps
from pyro_sparsegp import linalg
from pyro_sparsegp.kernels import kernel_matrix

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# the package's own advisory warnings are allowed (each is tested elsewhere); any other warning is an error
OURS = tuple(
    c for c in (
        getattr(linalg, "CholeskyJitterWarning", None), getattr(linalg, "IllConditionedWarning", None),
        getattr(getattr(ps.infer, "natgrad", None), "NatGradDampingWarning", None),
    ) if c is not None
)


class Wrong(AssertionError):
    """A case returned, but its result is wrong (NaN, shape, value)."""


def run(fn, check=None, valid: bool = False) -> str:
    """``"ok"`` (checked) or ``"error"`` (ValueError/TypeError with a message, for a case that is not ``valid``);
    anything else propagates."""
    with warnings.catch_warnings():
        for c in OURS:
            warnings.simplefilter("ignore", c)
        warnings.filterwarnings("ignore", message=".*(offset that dwarfs|others are ignored).*")
        # Pyro's own warning for an ELBO of a model with y=None (y is then sampled): clear, and not ours
        warnings.filterwarnings("ignore", message="Found vars in model but not guide")
        try:
            out = fn()
        except (ValueError, TypeError) as e:
            if valid:
                raise Wrong(f"a valid case raised {type(e).__name__}: {e}") from e
            if len(str(e)) < 20:
                raise Wrong(f"uninformative error: {e!r}") from e
            return "error"
        if check is not None:
            check(out)
    return "ok"


def _finite(*ts):
    for t in ts:
        if not bool(torch.isfinite(torch.as_tensor(t)).all()):
            raise Wrong("non-finite result returned silently")


def _dtype():
    return torch.get_default_dtype()


def _other_dtype():
    return torch.float32 if _dtype() == torch.float64 else torch.float64


# -- menus -------------------------------------------------------------------------------------------------------
Z_MENU = {
    "good": lambda: torch.randn(5, 2),
    "per_output": lambda: torch.randn(2, 5, 2),
    "numpy": lambda: torch.randn(5, 2).cpu().numpy(),
    "list": lambda: torch.randn(5, 2).tolist(),
    "int": lambda: torch.randint(0, 4, (5, 2)),
    "other_dtype": lambda: torch.randn(5, 2, dtype=_other_dtype()),
    "empty_M": lambda: torch.randn(0, 2),
    "empty_D": lambda: torch.randn(5, 0),
    "1d": lambda: torch.randn(5),
    "4d": lambda: torch.randn(1, 2, 5, 2),
    "nan": lambda: torch.full((5, 2), float("nan")),
    "equal": lambda: torch.zeros(5, 2),
    "three_features": lambda: torch.randn(5, 3),
}
NUM_OUTPUTS = [None, 2, 1, 0, -1, 2.5, True]
JITTER = [None, 0.0, 1e-6, -1.0, float("nan")]
LIKELIHOODS = {
    "gaussian": lambda: ps.Gaussian(0.1),
    "bernoulli": lambda: ps.Bernoulli(),
    "none": lambda: None,
    "not_a_likelihood": lambda: torch.distributions.Normal(0, 1),
}


_NAMES = itertools.count()


def _fresh_name(base: str) -> str:
    """A name no live module holds, for the cases that do not fuzz the constructor's default name: the default
    (``"gp"``, held by the previous example's module until the garbage collector frees it) makes every construction
    run a full ``gc.collect()`` (``context.naming.unique_name``), about 0.1 s of an example in a test process's heap,
    which is most of what these small examples cost. ``test_fuzz_svgp_constructor`` keeps the default name."""
    return f"{base}{next(_NAMES)}"


def build_svgp(z, num_outputs, jitter, whiten, lik):
    return ps.SVGP(RBF(2), Z_MENU[z](), LIKELIHOODS[lik](), num_outputs=num_outputs, jitter=jitter, whiten=whiten)


def constructor_case(z, num_outputs, jitter, whiten, lik):
    def check(gp):
        m, v = gp.predict(torch.randn(7, gp.Z.shape[-1]))
        L = gp.num_outputs
        shape = (7,) if L is None else (7, L)  # predict returns [N, L]
        if m.shape != shape or v.shape != shape:
            raise Wrong(f"predict shapes {tuple(m.shape)}, {tuple(v.shape)}, expected {shape}")
        _finite(m, v)
        if not bool((v > 0).all()):
            raise Wrong("non-positive predictive variance")

    valid = ((z in ("good", "numpy", "list", "equal") or (z == "per_output" and num_outputs == 2))
             and num_outputs in (None, 1, 2) and not isinstance(num_outputs, bool)
             and jitter in (None, 0.0, 1e-6) and lik in ("gaussian", "bernoulli", "none"))
    return run(lambda: build_svgp(z, num_outputs, jitter, whiten, lik), check, valid)


X_MENU = {
    "good": lambda: torch.randn(12, 2),
    "numpy": lambda: torch.randn(12, 2).cpu().numpy(),
    "list": lambda: torch.randn(12, 2).tolist(),
    "other_dtype": lambda: torch.randn(12, 2, dtype=_other_dtype()),
    "int": lambda: torch.randint(0, 3, (12, 2)),
    "wrong_D": lambda: torch.randn(12, 3),
    "empty": lambda: torch.randn(0, 2),
    "nan": lambda: torch.randn(12, 2).index_fill_(0, torch.tensor([3]), float("nan")),
    "1d": lambda: torch.randn(12),
    "offset": lambda: torch.randn(12, 2) + 1e4,
}
Y_MENU = {
    "good": lambda n: torch.randint(0, 2, (n,)).to(_dtype()),
    "long": lambda n: torch.randint(0, 2, (n,)),
    "bool": lambda n: torch.randint(0, 2, (n,)).bool(),
    "numpy": lambda n: torch.randint(0, 2, (n,)).to(_dtype()).cpu().numpy(),
    "short": lambda n: torch.zeros(max(n - 1, 0)),
    "nan": lambda n: torch.full((n,), float("nan")),
    "two": lambda n: torch.full((n,), 2.0),
    "none": lambda n: None,
}
SUBSAMPLE = [None, 4, 12, 13, 0, -3, 2.5]
ENTRY = ["trace_elbo", "analytic", "predict"]


def data_case(lik, x, y, subsample, entry):
    torch.manual_seed(0)
    gp = ps.SVGP(RBF(2), torch.randn(4, 2), LIKELIHOODS[lik](), name=_fresh_name("data"))
    X = X_MENU[x]()
    n = len(X) if hasattr(X, "__len__") else 0
    Y = Y_MENU[y](n)

    def fn():
        if entry == "trace_elbo":
            pyro.set_rng_seed(1)
            return Trace_ELBO().loss(gp.model, gp.guide, X, Y, subsample_size=subsample)
        if entry == "analytic":
            return gp.analytic_elbo(X, Y).detach()
        return gp.predict(X, full=subsample is not None)[:2]

    valid = (x in ("good", "numpy", "list", "other_dtype", "int", "offset")
             and (y in ("good", "long", "bool", "numpy") or (y == "none" and entry != "analytic")
                  or (y == "two" and lik == "gaussian"))
             and (entry != "trace_elbo" or subsample in (None, 4, 12)))
    return run(fn, lambda out: _finite(*(out if isinstance(out, tuple) else (out,))), valid)


NATGRAD_LR = [0.5, 1.0, 0.0, -0.1, 1.5, float("nan"), "0.1", True]
NATGRAD_LIK = ["gaussian", "bernoulli", "logit", "polya_gamma", "robustmax"]


def natgrad_case(lik, lr):
    torch.manual_seed(0)
    X = torch.randn(30, 2)
    L = None
    if lik == "robustmax":
        likelihood, y, L = ps.RobustMax(3), (X[:, 0] > 0).long() + (X[:, 1] > 0).long(), 3
    else:
        likelihood = {"gaussian": ps.Gaussian(0.1), "bernoulli": ps.Bernoulli(), "logit": ps.Bernoulli("logit"),
                      "polya_gamma": ps.PolyaGammaLogit()}[lik]
        y = (X[:, 0] > 0).to(X.dtype)
    gp = ps.SVGP(RBF(2), X[:6].clone(), likelihood, num_outputs=L, name=_fresh_name("natgrad"))
    step = ps.infer.natgrad.natgrad_step_for(likelihood)

    def check(_):
        S = gp.q_u.u_scale_tril.detach()
        _finite(gp.q_u.u_loc, S)
        if not bool((S.diagonal(dim1=-2, dim2=-1) > 0).all()):
            raise Wrong("q(u) scale lost positive definiteness")

    valid = lr in (0.5, 1.0) and not isinstance(lr, bool)
    return run(lambda: [step(gp, X, y, lr=lr) for _ in range(3)], check, valid)


LIKELIHOOD_ARGS = [
    ("Gaussian", (0.1,)), ("Gaussian", (0.0,)), ("Gaussian", (-1.0,)), ("Gaussian", (float("nan"),)),
    ("Gaussian", (float("inf"),)), ("Gaussian", ([0.1, 0.2],)), ("Gaussian", (0.1, 0)), ("Gaussian", (0.1, 2.5)),
    ("Bernoulli", ("probit",)), ("Bernoulli", ("logistic",)), ("Bernoulli", ("logit", -3)),
    ("RobustMax", (3,)), ("RobustMax", (1,)), ("RobustMax", (3.5,)), ("RobustMax", (3, 0.0)),
    ("RobustMax", (3, 1.5)), ("Softmax", (3,)), ("Softmax", (3, 0)), ("PolyaGammaLogit", ()),
    ("PolyaGammaLogit", (0,)),
]

VALID_LIKELIHOOD_ARGS = [("Gaussian", (0.1,)), ("Bernoulli", ("probit",)), ("RobustMax", (3,)), ("Softmax", (3,)),
                         ("PolyaGammaLogit", ())]


def likelihood_case(name, args):
    def check(lik):
        K = getattr(lik, "num_classes", None)
        f_loc = torch.randn(5) if K is None else torch.randn(K, 5)
        f_var = torch.rand(f_loc.shape) + 0.1
        y = (torch.rand(5) > 0.5).to(f_loc.dtype) if K is None else torch.randint(0, K, (5,))
        _finite(lik.expected_log_prob(y, f_loc, f_var))

    return run(lambda: getattr(ps, name)(*args), check, valid=(name, args) in VALID_LIKELIHOOD_ARGS)


PG_B = [1.0, 2.0, 3.0, 2.5, 10.0, 60.5, 100.0, 0.0, -1.0, float("nan")]
PG_C = [0.0, 1.5, -4.0, 40.0]
PG_TERMS = [200, 2, 0, -5]


def pg_case(b, c, num_terms, x):
    def fn():
        d = ps.distributions.PolyaGamma(torch.tensor(b), torch.tensor(c), num_terms=num_terms, validate_args=True)
        return d, d.log_prob(torch.tensor(x))

    def check(out):
        d, lp = out
        _finite(lp)
        # independent reference: the polyagamma package's pdf, where it is reliable (it loses all digits for large x:
        # at x = 25 it gives log p(x | 1, 0) = -64, where the leading term of the series is log(2 pi) - 25 pi^2 / 2)
        if b == int(b) and b <= 5 and num_terms >= 50 and x <= 5:
            from polyagamma import polyagamma_pdf

            ref = float(np.log(polyagamma_pdf(x, h=b, z=c)))
            if math.isfinite(ref) and ref > -200 and abs(lp.item() - ref) > 1e-6 * max(1.0, abs(ref)):
                raise Wrong(f"log density {lp.item()} vs polyagamma {ref}")

    # the documented exact range of log_prob (enough series terms; b <= 50) -- beyond it a refusal is the contract
    valid = math.isfinite(b) and 0 < b <= 50 and num_terms >= 50 and x > 0
    return run(fn, check, valid)


PG_X = [0.05, 0.3, 1.0, 4.0, 25.0, -1.0, 0.0]


def kernel_case(log10_ls, offset, dtype, kernel):
    if dtype == torch.float32 and offset > 1e6:
        return "skipped"  # float32 cannot hold such inputs (InputPrecisionWarning covers them)
    torch.manual_seed(0)
    ls = 10.0**log10_ls
    X64 = torch.rand(20, 2, dtype=torch.float64) * 3 * ls
    X64 = torch.cat([X64, X64[:3] + 1e-3 * ls])  # near-duplicates
    k = kernel(2, lengthscale=torch.tensor(ls, dtype=dtype), variance=torch.tensor(1.3, dtype=dtype))
    Xd = (X64 + offset).to(dtype)

    def check(K):
        if not torch.equal(K.diagonal(), torch.full((len(Xd),), 1.3, dtype=dtype)):
            raise Wrong("the diagonal of k(X, X) is not the variance")
        # independent: Pyro's kernel of the differences of the (cast) inputs, formed in float64
        Xr = Xd.double()
        diff = (Xr[:, None] - Xr[None]).reshape(-1, 2)
        f64 = torch.float64
        kr = kernel(2, lengthscale=torch.tensor(ls, dtype=f64), variance=torch.tensor(1.3, dtype=f64))
        ref = kr(diff, torch.zeros(1, 2, dtype=torch.float64)).reshape(K.shape)
        tol = 2e-4 if dtype == torch.float32 else 1e-8
        if (K.double() - ref).abs().max() > tol:
            raise Wrong(f"kernel error {(K.double() - ref).abs().max().item():.2e}")

    return run(lambda: kernel_matrix(k, Xd).detach(), check, valid=True)


def solvegp_case(o):
    menu = dict(Z_MENU)
    return run(
        lambda: ps.SOLVEGP(RBF(2), torch.randn(5, 2), menu[o](), ps.Gaussian(0.1), name=_fresh_name("solvegp")),
        lambda gp: _finite(*gp.predict(torch.randn(6, 2))),
        valid=o in ("good", "numpy", "list", "equal"),
    )


# -- the hypothesis tests ----------------------------------------------------------------------------------------
@FUZZ
@given(st.sampled_from(list(Z_MENU)), st.sampled_from(NUM_OUTPUTS), st.sampled_from(JITTER), st.booleans(),
       st.sampled_from(list(LIKELIHOODS)))
def test_fuzz_svgp_constructor(z, num_outputs, jitter, whiten, lik):
    constructor_case(z, num_outputs, jitter, whiten, lik)


@FUZZ
@given(st.sampled_from(list(Z_MENU)))
def test_fuzz_solvegp_constructor(o):
    solvegp_case(o)


@FUZZ
@given(st.sampled_from(["gaussian", "bernoulli"]), st.sampled_from(list(X_MENU)), st.sampled_from(list(Y_MENU)),
       st.sampled_from(SUBSAMPLE), st.sampled_from(ENTRY))
def test_fuzz_data(lik, x, y, subsample, entry):
    data_case(lik, x, y, subsample, entry)


@FUZZ
@given(st.sampled_from(NATGRAD_LIK), st.sampled_from(NATGRAD_LR))
def test_fuzz_natgrad(lik, lr):
    natgrad_case(lik, lr)


@FUZZ
@given(st.sampled_from(LIKELIHOOD_ARGS))
def test_fuzz_likelihood_constructors(args):
    likelihood_case(*args)


@pytest.mark.float64
@FUZZ
@given(st.sampled_from(PG_B), st.sampled_from(PG_C), st.sampled_from(PG_TERMS), st.sampled_from(PG_X))
def test_fuzz_polya_gamma(b, c, num_terms, x):
    pg_case(b, c, num_terms, x)


@FUZZ
@given(st.floats(-8, 8), st.sampled_from([0.0, 2000.0, 1.7e9]), st.sampled_from([torch.float64, torch.float32]),
       st.sampled_from([RBF, Matern32]))
def test_fuzz_kernels_at_extreme_lengthscales_and_offsets(log10_ls, offset, dtype, kernel):
    kernel_case(log10_ls, offset, dtype, kernel)


# -- every menu combination once, for the counts per outcome ------------------------------------------------------
def _enumerate():
    yield from (("constructor", constructor_case, a) for a in itertools.product(
        Z_MENU, NUM_OUTPUTS, JITTER, [True, False], LIKELIHOODS))
    yield from (("solvegp", solvegp_case, (o,)) for o in Z_MENU)
    yield from (("data", data_case, a) for a in itertools.product(
        ["gaussian", "bernoulli"], X_MENU, Y_MENU, SUBSAMPLE, ENTRY))
    yield from (("natgrad", natgrad_case, a) for a in itertools.product(NATGRAD_LIK, NATGRAD_LR))
    yield from (("likelihood", likelihood_case, a) for a in LIKELIHOOD_ARGS)
    yield from (("polya_gamma", pg_case, a) for a in itertools.product(PG_B, PG_C, PG_TERMS, PG_X))
    yield from (("kernel", kernel_case, a) for a in itertools.product(
        [-8, -6, -3, 0, 3, 8], [0.0, 2000.0, 1.7e9], [torch.float64, torch.float32], [RBF, Matern32]))


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(True)
    counts = collections.defaultdict(collections.Counter)
    for group, fn, args in _enumerate():
        pyro.clear_param_store()
        try:
            out = fn(*args)
            out = {"ok": "handled", "error": "clear error"}.get(out, out)
        except Wrong as e:
            out, err = "wrong (or a valid case raised)", e
        except Exception as e:  # noqa: BLE001
            out, err = "unclear", e
        if out in ("wrong (or a valid case raised)", "unclear") and "-v" in sys.argv:
            print(group, args, type(err).__name__, str(err)[:150])
        counts[group][out] += 1
        counts["total"][out] += 1
    for g, c in counts.items():
        print(f"{g:12s} {sum(c.values()):5d} {dict(c)}")
