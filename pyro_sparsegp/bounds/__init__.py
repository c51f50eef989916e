"""The papers' closed-form bounds, equation by equation: oracles for tests and for the analytic path.

* :mod:`.svgp` — Hensman, Fusi, Lawrence 2013 and Hensman, Matthews, Ghahramani 2015.
* :mod:`.solvegp` — Shi, Titsias, Mnih 2020 (SOLVE-GP, ODVGP).
"""
