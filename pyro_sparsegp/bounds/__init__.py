"""The papers' closed-form bounds, equation by equation: oracles for tests and for the analytic path.

* :mod:`.svgp` — Hensman, Fusi, Lawrence 2013 and Hensman, Matthews, Ghahramani 2015.
* :mod:`.solvegp` — Shi, Titsias, Mnih 2020 (SOLVE-GP, ODVGP); :mod:`.solvegp_cost` its table 4.
* :mod:`.polya_gamma` — Wenzel et al. 2019 (the Pólya-Gamma augmented bound).

The library imports none of them (``tests/core/test_house_rules.py``); they may import the library. Imported here so
that ``ps.bounds.svgp`` and the others are there for users without an import of their own.
"""

from . import polya_gamma, solvegp, solvegp_cost, svgp  # noqa: F401
