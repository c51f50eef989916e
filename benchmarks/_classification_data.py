"""Loaders of the binary classification datasets in ``../shared/data`` used by the classification benchmarks
(labels mapped to {0, 1}), and of the bundled-in-shared MNIST test images."""
from __future__ import annotations

import gzip

import numpy as np
import scipy.io as sio
from _common import SHARED_DATA

DATA = SHARED_DATA  # ../shared/data, or $PSGP_SHARED_DATA

RAETSCH = {
    "thyroid": "thyroid/raetsch_xt/thyroid.mat",
    "heart": "heart/raetsch_xt/heart-statlog.mat",
    "twonorm": "twonorm/raetsch_xt/twonorm.mat",
    "german": "german/raetsch_xt/german.mat",
    "waveform": "waveform/raetsch_xt/waveform.mat",
    "cancer": "breast_cancer/raetsch_xt/breast_cancer.mat",
    "flare solar": "flare_solar/raetsch_xt/flare_solar.mat",
    "diabetes": "diabetis/raetsch_xt/pimadiabetes.mat",
}


def _pmlb(path):
    with gzip.open(path, "rt") as fh:
        header = fh.readline().strip().split("\t")
        data = np.loadtxt(fh, delimiter="\t")
    t = header.index("target")
    return np.delete(data, t, axis=1), data[:, t]


def load_binary(name):
    """``(X [n, d], y [n])`` with labels in {0, 1} (the source's positive class, or +1, becomes 1)."""
    if name in RAETSCH:
        d = sio.loadmat(DATA / RAETSCH[name])
        X, t = d["data"].astype(float), d["target"].ravel().astype(float)
    elif name == "ringnorm":
        X, t = _pmlb(DATA / "ringnorm" / "pmlb" / "ring.tsv.gz")
    elif name == "banana":
        X, t = _pmlb(DATA / "banana" / "pmlb" / "banana.tsv.gz")
    else:
        raise KeyError(name)
    return X, (t > 0).astype(float)


def _idx(path):
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_mnist_test():
    """The 10,000 MNIST test images (pixels scaled to [0, 1], flattened) and their digit labels."""
    d = DATA / "mnist" / "gpflow_partial"
    X = _idx(d / "t10k-images-idx3-ubyte.gz").reshape(10000, -1).astype(float) / 255.0
    y = _idx(d / "t10k-labels-idx1-ubyte.gz").astype(float)
    return X, y


def stratified_split(y, frac, rng):
    train = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        train.extend(idx[: max(1, int(round(frac * len(idx))))])
    train = np.array(sorted(train))
    return train, np.setdiff1d(np.arange(len(y)), train)
