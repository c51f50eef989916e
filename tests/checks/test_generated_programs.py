"""Generated programs against ``ps.check_model`` (issue 54, item 1): a seeded generator draws small Pyro programs
(a data plate at dim -1, optionally subsampled with explicit indices, an optional groups plate at dim -2, a latent
part that is a tiny SVGP layer or a plain latent with a Delta guide, a Normal likelihood, 1 or 4 particles,
vectorised or not) and at most one slip (an unsqueeze, an expand to a new left dimension, a squeeze of a singleton, a
transpose of the two right dimensions, a missing minibatch scale).

The oracle is independent of the checker: the program's ``Trace_ELBO(num_particles=K, vectorize_particles=V)`` loss
against the slip-free program's one-particle ``Trace_ELBO()`` loss. Latent noise is removed (Delta guides; the
layer's ``u`` conditioned on a fixed value in model and guide, and inputs ``X`` drawn from the rows of ``Z``, so that
``p(f | u)`` has a variance at the jitter's level), so a correct program agrees to a tight tolerance and a slipped
one differs. Every program whose loss differs (or which Pyro refuses) must raise naming the slipped site, and every
program whose loss agrees must pass."""

import collections
import dataclasses
import random

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.contrib.gp.kernels import RBF
from pyro.infer import Trace_ELBO

import pyro_sparsegp as ps

SLIPS = ("none", "unsqueeze", "expand", "squeeze", "transpose", "scale")
K = 4  # particles; no plate of a program has this size, so a particle dimension is never mistaken for a plate's


@dataclasses.dataclass
class Spec:
    N: int
    B: int  # minibatch (B < N: subsampled with explicit indices)
    G: int  # the groups plate at dim -2 (an SVGP layer's outputs plate, num_outputs=G); 0: none
    in_plate: bool  # y observed inside the groups plate (always when G > 1)
    latent: str  # "svgp" | "plain"
    particles: int
    vectorize: bool
    slip: str
    target: str  # the slipped site: "y", "w" (the plain latent's prior) or "guide" (its guide's loc)
    where: int  # unsqueeze: the dim (from the right); expand: the new size
    nesting: bool  # the ELBO's max_plate_nesting given (else Pyro guesses it)


LAYOUTS = ("flat", "one group, y outside its plate", "groups", "any")
SETTINGS = ((1, False), (K, False), (K, True))  # (num_particles, vectorize_particles)


def draw(rng: random.Random, slip: str, latent: str, setting: tuple, layout: str) -> Spec:
    """A program of the given slip, latent part, particle setting and plates' layout, the rest drawn."""
    N = rng.randint(6, 12)
    subsample = slip == "scale" or rng.random() < 0.4
    B = rng.randint(5, N - 1) if subsample else N
    G = {"flat": 0, "groups": rng.choice([2, 3])}.get(layout, 1) if layout != "any" else rng.choice([0, 1, 2, 3])
    in_plate = G > 1 or (layout == "any" and rng.random() < 0.5)
    own = latent == "svgp" or slip == "scale" or layout == LAYOUTS[1]  # the slip on y
    target = "y" if own else rng.choice(["y", "y", "w", "guide"])
    where = rng.choice([1, 2, 2, 3, 4]) if slip == "unsqueeze" else rng.choice([2, 3])
    return Spec(N, B, G, in_plate, latent, *setting, slip, target, where, rng.random() < 0.3)


def _slipped(spec: Spec, t: torch.Tensor) -> torch.Tensor:
    if spec.slip == "unsqueeze":
        return t.unsqueeze(-min(spec.where, t.dim() + 1))
    if spec.slip == "expand":
        return t.expand(spec.where, *t.shape)
    if spec.slip == "squeeze":
        ones = [d for d in range(-1, -t.dim() - 1, -1) if t.shape[d] == 1]
        return t.squeeze(ones[0]) if ones else t
    if spec.slip == "transpose" and t.dim() >= 2:
        return t.transpose(-1, -2)
    return t


def build(spec: Spec, seed: int):
    """``(model, guide)`` of the program ``spec`` and of its slip-free version, and the slipped site's name."""
    gen = torch.Generator().manual_seed(seed)
    M = 3
    Z = torch.randn(M, 1, generator=gen)
    X = Z[torch.randint(M, (spec.N,), generator=gen)]  # X from Z's rows: p(f | u) is (nearly) a point mass
    y = torch.randn(*([spec.G] if spec.G > 1 else []), spec.N, generator=gen)
    idx = torch.randperm(spec.N, generator=gen)[: spec.B].sort().values if spec.B < spec.N else None
    w_loc = torch.randn(*y.shape, generator=gen)
    if spec.latent == "svgp":
        L = spec.G or None
        layer = ps.SVGP(RBF(1), Z, num_outputs=L, name=f"gen{seed}")  # a free name: no search for one
        u0 = torch.randn(*((L, 1) if L else ()), M, generator=gen)
        groups = layer.outputs_plate if L else _no_plate
    else:
        layer = None
        groups = (lambda: pyro.plate("groups", spec.G, dim=-2)) if spec.G else _no_plate

    def program(slip: bool):
        sl = (lambda t: _slipped(spec, t)) if slip else (lambda t: t)
        scale_slip = slip and spec.slip == "scale"

        def data():
            return pyro.plate("data", spec.N, subsample=idx) if idx is not None else pyro.plate("data", spec.N)

        def observe(loc, i, g):
            if scale_slip:  # the minibatch observed in a plate of its own: scale 1 where the data plate's is N/B
                with pyro.plate("obs", spec.B, dim=-1), g if spec.in_plate else _no_plate():
                    return pyro.sample("y", dist.Normal(loc, 1.0), obs=y[..., i])
            with g if spec.in_plate else _no_plate():
                return pyro.sample("y", dist.Normal(loc, 1.0), obs=y[..., i])

        def model():
            if layer is not None:
                u = layer.sample_u()
                with data() as i:
                    f = layer.sample_f(X[i], u)
                    if not scale_slip:
                        observe(sl(f), i, groups())
                if scale_slip:
                    observe(f, i, groups())
                return
            mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
            g = groups()
            with data() as i:
                with g:
                    w = pyro.sample("w", dist.Normal(sl(mu) if spec.target == "w" else mu, 1.0))
                if not scale_slip:
                    observe(sl(w) if spec.target == "y" else w, i, g)
            if scale_slip:
                observe(w, i, g)

        def guide():
            if layer is not None:
                u = layer.sample_u(guide=True)
                with data() as i:
                    layer.sample_f(X[i], u, guide=True)
                return
            pyro.sample("mu", dist.Delta(torch.tensor(0.3)))
            with data() as i, groups():
                loc = w_loc[..., i]
                pyro.sample("w", dist.Delta(sl(loc) if spec.target == "guide" else loc))

        if layer is not None:
            data_ = {f"{layer.name}.u": u0}
            aux = poutine.infer_config(guide, lambda msg: {"is_auxiliary": True} if msg["name"] in data_ else {})
            model, guide = poutine.condition(model, data=data_), poutine.condition(aux, data=data_)
        return model, guide

    return program(True), program(False), ("w" if spec.target in ("w", "guide") else "y")


class _no_plate:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _elbo(spec: Spec):
    kw = {"max_plate_nesting": 2 if spec.G else 1} if spec.nesting else {}
    return Trace_ELBO(num_particles=spec.particles, vectorize_particles=spec.vectorize, **kw)


def _loss(elbo, model, guide):
    try:
        return elbo.loss(model, guide)
    except (ValueError, RuntimeError):
        return None


def outcome(spec: Spec, seed: int):
    """``(oracle, check)``: the oracle "agrees", "differs" or "refused" (Pyro raised); the check "passed", "raised"
    (naming the slipped site) or what it said otherwise."""
    (model, guide), (ref_model, ref_guide), site = build(spec, seed)
    reference = Trace_ELBO().loss(ref_model, ref_guide)
    loss = _loss(_elbo(spec), model, guide)
    # p(f | u)'s jitter-level variance moves a correct program's loss by < 4e-4 (float64), < 0.04 (float32); the
    # smallest slip measured moves it by 1.2 (the losses are 7 to 60)
    tol = 1e-2 if torch.get_default_dtype() == torch.float64 else 0.2
    oracle = "refused" if loss is None else "agrees" if abs(loss - reference) <= tol else "differs"
    try:
        ps.check_model(model, guide, elbo=_elbo(spec))
    except ps.ModelShapeError as e:
        return oracle, "raised" if site in e.sites else f"named {e.sites}: {e}"
    except (ValueError, RuntimeError) as e:
        return oracle, "raised" if f"site {site}" in str(e) or f"'{site}'" in str(e) else f"{type(e).__name__}: {e}"
    return oracle, "passed"


def _specs():
    """Every slip x latent part x particle setting x plates' layout once: 6 x 2 x 3 x 4 = 144 programs."""
    rng = random.Random(54)
    combos = [(s, lat, st, lay) for s in SLIPS for lat in ("svgp", "plain") for st in SETTINGS for lay in LAYOUTS]
    return [(draw(rng, *combo), n) for n, combo in enumerate(combos)]


def test_the_checker_raises_exactly_on_the_programs_whose_elbo_is_wrong():
    """144 programs (every slip x latent part x particle setting x plates' layout): a loss that differs from the
    slip-free one-particle loss, or that Pyro refuses, comes with an error naming the slipped site; a loss that agrees
    with none. Not vacuous: every slip kind changed some program's loss silently (Pyro accepted it) and was caught."""
    table, wrong = collections.Counter(), []
    for spec, seed in _specs():
        oracle, check = outcome(spec, seed)
        table[spec.slip, oracle, check if check in ("raised", "passed") else "other"] += 1
        if (oracle == "agrees") != (check == "passed") or check not in ("raised", "passed"):
            wrong.append((spec, oracle, check))
    assert not wrong, f"{len(wrong)} programs judged wrongly, e.g.\n" + "\n".join(map(str, wrong[:5]))
    assert {slip for slip, _, _ in table} == set(SLIPS)
    for slip in SLIPS[1:]:  # each slip kind: some programs whose loss changed silently, all caught
        assert table[slip, "differs", "raised"] >= 1, (slip, table)
    assert table["none", "agrees", "passed"] == len(LAYOUTS) * 2 * len(SETTINGS)  # every slip-free program passes
    assert sum(n for (_, o, _), n in table.items() if o == "agrees") >= 40, table
