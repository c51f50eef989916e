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
=============  ===============  =============================================================================

Every loader returns float tensors in the default dtype (or ``dtype``).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Split", "load_powerplant", "load_kin8nm", "load_snelson", "load_banana", "load_mnist_subset", "standardize"]

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


def standardize(train: torch.Tensor, *others: torch.Tensor):
    """Shift and scale by the training mean and standard deviation (per column); returns the transformed tensors
    followed by ``(mean, std)``. ``train [N, D]`` (or ``[N]``) and each of ``others`` ``[T, D]`` keep their shapes;
    ``mean`` and ``std`` are ``[D]`` (or ``[]``)."""
    mean, std = train.mean(0), train.std(0).clamp(min=1e-12)
    return ((train - mean) / std, *[(o - mean) / std for o in others], mean, std)
