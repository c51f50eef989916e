"""The argument checks of table 4's operation counts (:func:`pyro_sparsegp.bounds.solvegp.count_cubic_operations`,
Shi, Titsias, Mnih 2020, appendix D.3): the smallest sizes (``M = 1``, ``M2 = 0``) are accepted and each kind of bad
size (not an integer, ``M < 1``, ``M2 < 0``) is refused on its own, whatever the other size."""

import pytest

from pyro_sparsegp.bounds.solvegp import count_cubic_operations, cubic_cost


def test_the_smallest_sizes_are_accepted():
    assert count_cubic_operations(1, 0, "solvegp") == count_cubic_operations(1, 0, "svgp")
    assert cubic_cost(1, 0, "svgp", N=3) == {"matmul": 3, "cholesky": 1, "trisolve": 1 + 2 * 3}


@pytest.mark.parametrize("M, M2", [(1.5, 2), (0, 2), (-3, 2), (2, 0.5), (2, -1), (1.5, -1)])
def test_each_bad_size_is_refused(M, M2):
    with pytest.raises(ValueError, match="M >= 1 and M2 >= 0"):
        count_cubic_operations(M, M2, "solvegp")
