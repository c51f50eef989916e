"""The loaders of the bundled count, heteroscedastic and multi-output sets (``pyro_sparsegp.datasets``) against an
independent reading of the same files with pandas: shapes, values, the splits' partition, where NaN is and is not."""

import numpy as np
import pandas as pd
import pytest
import torch

from pyro_sparsegp import datasets as ds

DATA = ds.DATA


def _np(t):
    return t.detach().cpu().double().numpy()


@pytest.fixture(scope="module")
def nmes():
    return pd.read_csv(DATA / "nmes1988" / "data.csv.gz")


def _nmes_design(df):
    """The documented design matrix written independently: raw numeric columns, then 0/1 dummies by name."""
    cols = []
    for c in ds.NMES1988_COLUMNS:
        name, _, level = c.partition("=")
        cols.append(df[name].to_numpy(float) if not level else (df[name] == level).to_numpy(float))
    return np.stack(cols, 1)


def test_nmes1988_splits_partition_the_data_into_90_10(nmes):
    X_all, y_all = _nmes_design(nmes), nmes["visits"].to_numpy(float)
    assert X_all.shape == (4406, 17) and set(np.unique(X_all[:, 5:])) == {0.0, 1.0}
    # the reference levels are dropped: at most one dummy of a factor is on, and each level occurs
    assert (X_all[:, 5:7].sum(1) <= 1).all() and (X_all[:, 8:11].sum(1) <= 1).all() and (X_all[:, 5:].sum(0) > 0).all()
    tests = []
    for split in (0, 1, 9):
        s = ds.load_nmes1988(split=split)
        assert s.X_train.shape == (3965, 17) and s.X_test.shape == (441, 17)
        assert s.y_train.shape == (3965,) and s.y_test.shape == (441,) and s.X_train.dtype == torch.get_default_dtype()
        assert all(torch.isfinite(t).all() for t in (s.X_train, s.y_train, s.X_test, s.y_test))
        # train + test is the whole file, row for row (sorted as tuples of covariates and the count)
        got = np.concatenate([np.c_[_np(s.X_train), _np(s.y_train)], np.c_[_np(s.X_test), _np(s.y_test)]])
        want = np.c_[X_all, y_all]
        order = np.lexsort(got.T[::-1]), np.lexsort(want.T[::-1])
        np.testing.assert_allclose(got[order[0]], want[order[1]], rtol=1e-6)
        tests.append({tuple(r) for r in np.c_[_np(s.X_test), _np(s.y_test)]})
    assert len(tests[0] & tests[1]) < 100 and len(tests[0] & tests[2]) < 100  # different random splits (~44 shared)
    s0 = ds.load_nmes1988(split=0)
    assert torch.equal(s0.y_test, ds.load_nmes1988(split=0).y_test)  # the fixed seed
    # the documented seed: split 1 is the second permutation of default_rng(1988), test rows its first 441
    rng = np.random.default_rng(1988)
    rng.permutation(4406)
    test_rows = np.sort(rng.permutation(4406)[:441])
    np.testing.assert_allclose(_np(ds.load_nmes1988(split=1).X_test), X_all[test_rows], rtol=1e-6)


@pytest.mark.parametrize("split", [-1, 10, 1.0, "0"])
def test_nmes1988_rejects_a_split_outside_the_ten(split):
    with pytest.raises(ValueError, match="split must be an integer in 0..9"):
        ds.load_nmes1988(split=split)


def test_mcycle_is_the_file_in_order():
    df = pd.read_csv(DATA / "mcycle" / "data.csv.gz")
    X, y = ds.load_mcycle()
    assert X.shape == (133, 1) and y.shape == (133,) and torch.isfinite(X).all() and torch.isfinite(y).all()
    np.testing.assert_allclose(_np(X[:, 0]), df["times"], rtol=1e-6)
    np.testing.assert_allclose(_np(y), df["accel"], rtol=1e-6, atol=1e-6)
    assert (X[1:] >= X[:-1]).all() and len(torch.unique(X)) < 133  # sorted by time, with repeated times


@pytest.fixture(scope="module")
def weather():
    df = pd.read_csv(DATA / "nyc_weather" / "data.csv.gz")
    df["t"] = pd.to_datetime(df["time_hour"])
    return df


def _pivot(weather, variable, start, days):
    """``[24 days, 3]`` values of ``variable`` on the hourly grid from ``start`` (UTC), NaN where absent."""
    grid = pd.date_range(pd.Timestamp(start, tz="UTC"), periods=24 * days, freq="h")
    return weather.pivot(index="t", columns="origin", values=variable).reindex(grid)[list(ds.NYC_AIRPORTS)].to_numpy()


@pytest.mark.parametrize("variable,start,days,airport,hold,hold_days", [
    ("temp", "2013-01-01", 28, "JFK", "2013-01-15", 3),
    ("dewp", "2013-02-10", 20, "EWR", "2013-02-20", 2.5),
])
def test_nyc_weather_grid_nan_pattern_and_held_out_block(weather, variable, start, days, airport, hold, hold_days):
    s = ds.load_nyc_weather(variable, start, days, airport, hold, hold_days)
    ref = _pivot(weather, variable, start, days)  # [24 days, 3]
    a = ds.NYC_AIRPORTS.index(airport)
    h0 = int((pd.Timestamp(hold) - pd.Timestamp(start)) / pd.Timedelta(hours=1))
    block = np.arange(h0, h0 + round(24 * hold_days))
    # the training grid: every hour with at least one report, values as in the file except the held-out block
    rows = np.flatnonzero(np.isfinite(ref).any(1))
    np.testing.assert_array_equal(_np(s.X_train[:, 0]), rows)
    want = ref[rows].copy()
    want[np.isin(rows, block), a] = np.nan
    assert s.y_train.shape == (len(rows), 3) and s.X_train.shape == (len(rows), 1)
    np.testing.assert_allclose(_np(s.y_train), want, rtol=1e-6, equal_nan=True)
    y = _np(s.y_train)
    assert np.isfinite(y).any(1).all() and np.isfinite(_np(s.X_train)).all()
    assert np.isnan(y[np.isin(rows, block), a]).all()  # the block is out of training ...
    others = [i for i in range(3) if i != a]
    assert np.isfinite(y[np.isin(rows, block)][:, others]).mean() > 0.95  # ... but the other airports stay
    assert np.isnan(y).sum() < 0.01 * y.size + len(block)  # few missing hours besides the block
    # the test set: the held-out airport's observed hours of the block, only its column finite
    obs = block[np.isfinite(ref[block, a])]
    np.testing.assert_array_equal(_np(s.X_test[:, 0]), obs)
    np.testing.assert_allclose(_np(s.y_test[:, a]), ref[obs, a], rtol=1e-6)
    assert s.y_test.shape == (len(obs), 3) and np.isnan(_np(s.y_test)[:, others]).all()


def test_nyc_weather_default_window_and_dtype():
    s = ds.load_nyc_weather(dtype=torch.float32)
    assert s.X_train.shape == (666, 1) and s.y_train.shape == (666, 3) and s.X_test.shape == (72, 1)
    assert s.y_train.dtype == torch.float32 and s.X_test[0, 0] == 14 * 24


@pytest.mark.parametrize("kwargs,match", [
    (dict(variable="humid"), "variable must be 'temp' or 'dewp'"),
    (dict(holdout_airport="BOS"), "holdout_airport must be one of"),
    (dict(holdout_start="2013-06-01"), "move it into the window"),
])
def test_nyc_weather_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ds.load_nyc_weather(**kwargs)


def test_standardize_skips_missing_entries_as_pandas_does():
    """``standardize`` on targets with NaN (the weather loader's) uses each column's observed entries only, as
    pandas' ``mean``/``std`` do; it used to return NaN everywhere."""
    s = ds.load_nyc_weather(dtype=torch.float64)
    y, yt, mean, std = ds.standardize(s.y_train, s.y_test)
    frame = pd.DataFrame(_np(s.y_train))
    np.testing.assert_allclose(_np(mean), frame.mean().to_numpy(), rtol=1e-12)
    np.testing.assert_allclose(_np(std), frame.std().to_numpy(), rtol=1e-12)
    assert torch.equal(y.isnan(), s.y_train.isnan()) and torch.equal(yt.isnan(), s.y_test.isnan())
    np.testing.assert_allclose(_np(y), ((frame - frame.mean()) / frame.std()).to_numpy(), rtol=1e-10)
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")], [5.0, float("nan")]])
    with pytest.raises(ValueError, match="at least 2 observed"):
        ds.standardize(x)
    full = torch.tensor([[1.0, 2.0], [3.0, 7.0], [6.0, 9.0]])  # no NaN: the plain mean and unbiased sd
    _, m, sd = ds.standardize(full)
    assert torch.allclose(m, full.mean(0)) and torch.allclose(sd, full.std(0))
