"""Table 4 of appendix D.3 of Shi, Titsias, Mnih (2020): the cubic-cost operations of one evaluation of the SOLVE-GP
bound (algorithm 1), against SVGP's. Re-exported by :mod:`pyro_sparsegp.bounds.solvegp`."""

from __future__ import annotations

__all__ = ["count_cubic_operations", "cubic_cost"]


# -- appendix D.3, table 4 ------------------------------------------------------------------------------------------
_TABLE4 = {
    "svgp": {
        "matmul": {"N M^2": 1},
        "cholesky": {"M^3": 1},
        "trisolve": {"M^3": 1, "N M^2": 2},
    },
    "solvegp": {
        "matmul": {"N M^2": 1, "N M2^2": 1, "N M M2": 1, "M M2^2": 1},
        "cholesky": {"M^3": 1, "M2^3": 1},
        "trisolve": {"M^3": 1, "M2^3": 1, "N M^2": 2, "N M2^2": 2, "M^2 M2": 1},
    },
}

_SIZES = {
    "N M^2": lambda N, M, M2: N * M * M,
    "N M2^2": lambda N, M, M2: N * M2 * M2,
    "N M M2": lambda N, M, M2: N * M * M2,
    "M M2^2": lambda N, M, M2: M * M2 * M2,
    "M^2 M2": lambda N, M, M2: M * M * M2,
    "M^3": lambda N, M, M2: M**3,
    "M2^3": lambda N, M, M2: M2**3,
}


def count_cubic_operations(M: int, M2: int, method: str) -> dict:
    """Cubic-cost operations of one evaluation of the bound (algorithm 1, un-whitened), table 4 of appendix D.3:
    ``{op: {cost: count}}`` for ``op`` in ``matmul``, ``cholesky``, ``trisolve`` (triangular solves), ``cost`` a
    monomial in ``N`` (the batch size), ``M`` and ``M2`` (the orthogonal inducing points), e.g. ``"N M^2"``.

    ``method="svgp"`` (``M`` inducing points; ``M2`` is ignored) totals 1 matmul, 1 Cholesky and 3 trisolves;
    ``"solvegp"`` totals 4, 2 and 7 (appendix D.3: "we only need to solve 7 triangular matrix equations"). SOLVE-GP
    with ``M2 = 0`` has the SVGP table (the terms in ``M2`` vanish). Counted per forward evaluation; the algorithm-1
    steps they come from are marked in this module's comments. Sizes are plain integers (no tensor shapes); the
    ``N``-dependent costs are per minibatch of ``N`` points.
    """
    if method not in _TABLE4:
        raise ValueError(f"method must be 'svgp' or 'solvegp', got {method!r}")
    if int(M) != M or M < 1 or int(M2) != M2 or M2 < 0:
        raise ValueError(f"need integers M >= 1 and M2 >= 0, got M={M!r}, M2={M2!r}")
    table = _TABLE4[method]
    if method == "solvegp" and M2 == 0:
        return {op: {c: n for c, n in costs.items() if "M2" not in c} for op, costs in table.items()}
    return {op: dict(costs) for op, costs in table.items()}


def cubic_cost(M: int, M2: int, method: str, N: int) -> dict:
    """Table 4 of appendix D.3 (Shi, Titsias, Mnih 2020) evaluated at integer sizes ``M``, ``M2`` and ``N`` (no tensor
    shapes): ``{op: sum of count * cost}`` (multiply-adds up to each operation's constant).

    Divided by ``M**3`` it gives the bars of figure 4, e.g. at ``N = M = M2`` SVGP costs 1/1/3 (matmul/Cholesky/
    trisolve) and SOLVE-GP 4/2/7, and at ``N = 0`` (``M >> N``) SOLVE-GP costs 1/2/3."""
    table = count_cubic_operations(M, M2, method)
    M2 = M2 if method == "solvegp" else 0
    return {op: sum(n * _SIZES[c](N, M, M2) for c, n in costs.items()) for op, costs in table.items()}
