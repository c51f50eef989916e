"""The deep-GP UCI benchmark's tabulation (benchmarks/deepgp_uci.py): rows of the diagnostic models are tabulated
(they once crashed the summary), and the paired deep SOLVE-GP - DGP 2 line reports the training-bound difference
that separates a worse bound from a worse generalisation. Pure Python on hand-made rows: no training."""

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
    """The benchmark script ``benchmarks/NAME.py`` imported as a module (its folder on ``sys.path`` while importing,
    for its ``_common`` import)."""
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def uci():
    return _bench("deepgp_uci")


def _row(model, split, ll, elbo=None):
    r = {"dataset": "energy", "model": model, "split": split, "test_ll": ll, "rmse": 1.0, "train_s": 1.0}
    if elbo is not None:
        r["train_elbo"] = elbo
    return r


def test_summary_tabulates_diagnostic_models(uci):
    rows = [_row(m, s, -0.5 - 0.1 * s) for m in ("dgp2", "solve1", "solve2_MM", "svgp_solve") for s in (0, 1)]
    summary = uci.summarize(rows)
    assert [s["model"] for s in summary] == ["dgp2", "solve1", "svgp_solve", "solve2_MM"]
    assert all(s["splits"] == 2 and s["test_ll"] == pytest.approx(-0.55) for s in summary)


def test_paired_line_reports_the_training_bound_difference(uci):
    rows = [_row("dgp2", 0, -0.4, 1.20), _row("solve2", 0, -0.6, 1.17),
            _row("dgp2", 1, -0.9, 0.50), _row("solve2", 1, -1.0, 0.49)]
    lines = uci.paired_solve_vs_dgp2(rows)
    assert "deep SOLVE-GP - DGP 2 = -0.1500 nats" in lines[0]
    assert "training bound per point -0.0200" in lines[0]
    assert lines[-1].endswith("on 0/1 sets")
    # rows without the bound (older JSON files) are still paired, with no bound figure
    old = [{k: v for k, v in r.items() if k != "train_elbo"} for r in rows]
    assert "training bound" not in uci.paired_solve_vs_dgp2(old)[0]


@pytest.mark.float64  # identities to ~1e-8 on float64 data
def test_training_bound_adds_chunks_to_the_full_data_bound(uci):
    """Chunked evaluation equals the one-batch bound (same noise draws: a one-layer model has none)."""
    import pyro_sparsegp as ps

    torch.manual_seed(0)
    X = torch.randn(50, 2, dtype=torch.float64)
    y = X.sum(-1).sin()
    dgp = ps.deep.build_deep_gp(X, [], ps.Gaussian(0.1), num_inducing=8)
    with torch.no_grad():
        full = dgp.analytic_elbo(X, y).item() / len(X)
        chunked = uci.training_bound(dgp, X, y, repeats=1, chunk=7)
    assert chunked == pytest.approx(full, rel=1e-10)


@pytest.mark.float64  # identities to ~1e-8 on float64 data
def test_lift_starts_at_the_solvegp_bound_and_trains_both(uci):
    """``--lift``: the DGP over ``Z ∪ O`` starts at the trained deep SOLVE-GP's bound (section 3.3: a one-layer model
    has no sampling, so exactly), and both continuations train (their bounds rise) without touching each other."""
    from types import SimpleNamespace

    import pyro_sparsegp as ps

    torch.manual_seed(0)
    X = torch.randn(60, 2, dtype=torch.float64)
    y = X.sum(-1).sin() + 0.1 * torch.randn(60, dtype=torch.float64)
    dgp = ps.deep.build_deep_gp(X, [], ps.Gaussian(0.1), num_inducing=4, num_orthogonal=4)
    args = SimpleNamespace(batch=60, lr=0.01, adam_only=False, test_samples=5, lift=30)
    with torch.no_grad():
        before = uci.training_bound(dgp, X, y, repeats=1)
    out = uci.lift(dgp, X, y, (X[:10], y[:10], 1.0), 0, args)
    assert out["lift_start_elbo"] == pytest.approx(before, rel=1e-8)
    assert out["cont_elbo"] > before and out["lift_elbo"] > before
    assert out["lift_steps"] == 30 and all(v == v for v in out.values())


@pytest.mark.parametrize("model", ["conv_rbf", "tick_rbf"])
def test_convgp_sum_models_build_predict_and_train(model):
    """The conv + RBF rows of benchmarks/convgp_mnist.py: M patches + M images in one q(u), predictions are class
    probabilities, and a few steps of the benchmark's training loop move both inducing sets."""
    from types import SimpleNamespace

    convgp_mnist = _bench("convgp_mnist")
    import pyro_sparsegp as ps

    # --natgrad: tick_rbf's q(u) takes natural steps of 0.1 (the output layer), conv_rbf's Adam (the default)
    args = SimpleNamespace(variance=5.0, lengthscale=1.0, location_lengthscale=3.0, per_centre=5, eval_batch=16,
                           iters=3, anneal_every=2, lr=0.01, batch=8, natgrad=0.1 if model == "tick_rbf" else None)
    X, y = torch.rand(40, 784), torch.randint(0, 10, (40,)).to(torch.get_default_dtype())
    gp, predict = convgp_mnist.build(model, X, 3, args)
    assert isinstance(gp.kernel, ps.SumKernel) and gp.inducing.num_inducing == 6
    probs = predict(X[:5])
    assert probs.shape[-2:] == (5, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    before = [p.Z.detach().clone() for p in gp.inducing.parts]
    q_before = gp.q_u.u_loc.detach().clone()
    convgp_mnist.train(gp, X, y, args, on_step=lambda it, loss: None)
    assert all(not torch.equal(p.Z.detach(), b) for p, b in zip(gp.inducing.parts, before, strict=True))
    assert not torch.equal(gp.q_u.u_loc.detach(), q_before)



@pytest.mark.parametrize("model", ["deep2", "deep3_solve"])
def test_convgp_deep_models_follow_table_5(model):
    """The deep rows of benchmarks/convgp_mnist.py (Shi et al. 2020, table 5): deep2 = 5x5/1 conv (10 channels), TICK
    4x4/2; deep3 = 5x5/1 conv, 4x4/2 conv (10 channels), TICK 5x5/1; SOLVE-GP layers carry M + M patches. Every
    layer's inducing patches come from samples of the layers below (k-means), q(u) starts at the prior, and the
    benchmark's loop trains the deepest hidden layer."""
    from types import SimpleNamespace

    convgp_mnist = _bench("convgp_mnist")

    args = SimpleNamespace(variance=5.0, lengthscale=1.0, location_lengthscale=3.0, per_centre=5, eval_batch=16,
                           iters=2, anneal_every=2, lr=0.01, batch=8, particles=1, samples=2, natgrad=None)
    X, y = torch.rand(40, 784), torch.randint(0, 10, (40,)).to(torch.get_default_dtype())
    gp, predict = convgp_mnist.build(model, X, (3, 4), args)
    depth, solve = convgp_mnist.DEEP[model]
    assert [h.output_image_shape for h in gp.hidden] == [(24, 24, 10), (11, 11, 10)][:depth]
    assert gp.output.kernel.patch_size == ((4, 4) if depth == 1 else (5, 5))
    assert gp.output.inducing.Z.shape[-2] == 4 and (not solve or gp.output.O.shape[-2] == 4)
    assert all(h.gp.inducing.Z.shape[-2] == 3 for h in gp.hidden)
    probs = predict(X[:5])
    assert probs.shape[-2:] == (5, 10)
    before = gp.hidden[-1].gp.inducing.Z.detach().clone()
    convgp_mnist.train(gp, X, y, args, on_step=lambda it, loss: None)
    assert not torch.equal(gp.hidden[-1].gp.inducing.Z.detach(), before)

def test_convgp_run_saves_and_continues_from_saved_parameters(tmp_path):
    """benchmarks/convgp_mnist.py --save writes each trained model's state_dict; --init-from starts the same model
    from it (a longer run continues where the saved one ended)."""
    from types import SimpleNamespace

    convgp_mnist = _bench("convgp_mnist")

    args = SimpleNamespace(variance=5.0, lengthscale=1.0, location_lengthscale=3.0, per_centre=5, eval_batch=16,
                           iters=2, anneal_every=2, lr=0.01, batch=8, natgrad=None, log_every=1, curve_every=0,
                           timing_only=True, save=str(tmp_path), init_from=None)
    X, y = torch.rand(40, 784), torch.randint(0, 10, (40,)).to(torch.get_default_dtype())
    convgp_mnist.run("fashion", "tick", 3, (X, y, X[:8], y[:8]), args)
    saved = torch.load(tmp_path / "fashion_tick.pt")
    args.save, args.init_from = None, str(tmp_path)
    loaded = {}  # the parameters the second run starts training from (a fresh build would hold the initial ones)
    real_train = convgp_mnist.train
    convgp_mnist.train = lambda gp, *a, **k: loaded.update({k_: v.clone() for k_, v in gp.state_dict().items()})
    try:
        convgp_mnist.run("fashion", "tick", 3, (X, y, X[:8], y[:8]), args)
    finally:
        convgp_mnist.train = real_train
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


# linear_operator (GPyTorch's) decorates with the deprecated torch.jit.script at import
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_time_to_accuracy_rows_carry_both_gpytorch_ratios_and_the_curve():
    """benchmarks/time_to_accuracy.py: a few steps of GPyTorch's NGD recipe, GPyTorch-Adam and ours (from the shared
    rows and from the greedy-variance start) on a toy set; every row has the reach/ratio columns against
    GPyTorch-NGD's and GPyTorch-Adam's final test LL, its set-up time and its curve."""
    import pyro

    pytest.importorskip("gpytorch")
    tta = _bench("time_to_accuracy")
    pyro.settings.set(module_local_params=True)
    torch.manual_seed(0)
    X, Xt = torch.randn(300, 2), torch.randn(50, 2)
    y, yt = X.sum(-1).sin(), Xt.sum(-1).sin()
    Z = X[:8]
    runs = {"gpytorch_ngd": tta.run_gpytorch(X, y, Xt, yt, Z, 4, 2, 1.0, ngd=True),
            "gpytorch": tta.run_gpytorch(X, y, Xt, yt, Z, 4, 2, 1.0),
            "ours": tta.run_ours(X, y, Xt, yt, Z, 4, 2, 1.0),
            "ours_greedy": tta.run_ours(X, y, Xt, yt, Z, 4, 2, 1.0, start="greedy")}
    rows = tta.cell_rows(runs, {"dataset": "toy"})
    assert [r["model"] for r in rows] == ["gpytorch_ngd", "gpytorch", "ours", "ours_greedy"]
    # the greedy selection's time is training time: on the clock before the first step
    assert 0 < rows[3]["setup_s"] <= rows[3]["curve"][0][0]
    for r in rows:
        assert {"test_ll", "nlpd", "rmse", "seconds", "setup_s", "reach_s", "ratio_ngd", "reach_adam_s", "ratio_adam",
                "stay_s", "ratio_stay_ngd"} <= set(r)
        assert r["nlpd"] == -r["test_ll"] and len(r["curve"]) == len(runs[r["model"]].points) >= 2
        assert all(len(p) == 2 for p in r["curve"]) and r["curve"][-1][1] == r["test_ll"]
    assert rows[0]["ratio_ngd"] == 1.0 and rows[1]["ratio_adam"] == 1.0 and rows[0]["ratio_stay_ngd"] == 1.0


def _dgp_args(**kw):
    import argparse

    base = dict(dgp_models=["dgp2"], dgp_seeds=[0], dgp_steps=6, dgp_methods=["nat_all", "nat_all_last"],
                eval_samples=100, progress_every=0, workers=1, time_limit=math.inf, device="cpu", log_dir=None)
    return argparse.Namespace(**(base | kw))


def test_natgrad_dgp_rows_run_the_chosen_methods(capsys, monkeypatch):
    """benchmarks/natgrad_nonconjugate.py --part dgp --dgp-methods: a few steps of DGP 2 on kin8nm with natural steps
    on every layer (the hidden layers from half, 80% or all of the steps), with and without the hidden layers' average
    (also beside the default), and
    every layer after default steps (``nat_late``); the rows are the methods asked for, and each changes the model.
    ``--eval-samples`` adds the many-sample test log-likelihood, ``--progress-every`` a line per that many steps."""
    import pyro

    nn = _bench("natgrad_nonconjugate")
    pyro.settings.set(module_local_params=True)
    # the first 200 of kin8nm's 819 test rows (the training rows, and so every trajectory, unchanged): the metrics
    # (100-, 300- and 100-sample predictions per test row) were most of each run's cost. Measured: test_ll_many -
    # test_ll -0.0017 (0.0006 on all 819 rows), far inside 0.05; a many-sample path that dropped the targets' scale
    # (``- log(sy)``, 1.35 nats here) or averaged another mixture would still fail it
    load = nn._kin8nm
    monkeypatch.setattr(nn, "_kin8nm", lambda: (lambda X, y, Xt, yt, sy: (X, y, Xt[:200], yt[:200], sy))(*load()))
    args = _dgp_args(eval_samples=300, progress_every=3)
    methods = ("nat_all", "nat_all_last", "nat_all_start", "nat_all_80", "default_avg", "nat_late")
    rows = nn.kin8nm_rows(args, [("dgp2", 0, m) for m in methods], 6)
    assert [r["method"] for r in rows] == list(methods)
    # 6 steps leave the hidden q(u) near its 1e-5 initial scale: an average keeps its last iterate, loudly where it
    # was asked for (default_avg), with a progress line under average="auto" (nat_all)
    assert [r["failure"] for r in rows] == ["", "", "", "", "last iterate kept", ""]
    assert all(math.isfinite(r["test_ll"]) for r in rows)
    # six trajectories (nat_late: 3 default steps, then 3), but nat_all kept its last iterate: nat_all_last's
    assert len({r["train_elbo"] for r in rows}) == 5 and rows[0]["train_elbo"] == rows[1]["train_elbo"]
    # 300 samples against 100: the same mixture, closer to its limit (the 100-sample estimate is biased low)
    assert all(abs(r["test_ll_many"] - r["test_ll"]) < 0.05 and r["se_max"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert out.count("# progress dgp2") == 12  # steps 3 and 6 of each run
    assert "nat_late seed 0: step 3," in out and "nat_late seed 0: step 6," in out  # counted across its two fits


def test_natgrad_dgp_summary_pairs_the_seeds():
    """The DGP summary: per-method means with their standard error over seeds, and the paired difference
    ``nat_all - default`` over the seeds that finished both (a stopped run has no metrics and is left out)."""
    nn = _bench("natgrad_nonconjugate")
    rows = [{"likelihood": "dgp3", "method": m, "seed": s, "test_ll": ll, "rmse": 0.1, "train_elbo": b,
             "wall_s": 1.0, "failure": ""}
            for m, s, ll, b in [("default", 0, 1.0, -0.3), ("nat_all", 0, 1.1, -0.2), ("default", 1, 2.0, -0.3),
                                ("nat_all", 1, 1.8, -0.1), ("default", 2, 1.5, -0.3)]]
    rows.append({"likelihood": "dgp3", "method": "nat_all", "seed": 2, "steps": 40, "failure": "stopped"})
    # seed 0 again on a GPU (no RMSE or time recorded): counted in the means, never paired with the CPU's default
    rows.append({"likelihood": "dgp3", "method": "nat_all", "seed": 0, "test_ll": 1.3, "train_elbo": -0.3,
                 "failure": "", "device": "cuda: X"})
    out = {r["method"]: r for r in nn.summary(rows)}
    assert out["nat_all"]["seeds"] == 3 and math.isclose(out["nat_all"]["test_ll"], 1.4)
    assert math.isclose(out["nat_all"]["train_elbo"], -0.2) and math.isclose(out["nat_all"]["rmse"], 0.1)
    assert out["default"]["seeds"] == 3 and math.isclose(out["default"]["test_ll"], 1.5)
    assert math.isclose(out["default"]["test_ll_se"], 0.5 / math.sqrt(3))  # sample sd 0.5 over 3 seeds
    pair = out["nat_all - default"]
    assert pair["seeds"] == 2 and math.isclose(pair["test_ll"], -0.05) and math.isclose(pair["train_elbo"], 0.15)
    assert math.isclose(pair["test_ll_se"], math.sqrt(0.045) / math.sqrt(2))  # differences 0.1, -0.2


def test_natgrad_dgp_summarize_joins_files(tmp_path, monkeypatch, capsys):
    """``--summarize A.json B.json``: no runs; the DGP rows of both files (other rows left out) in one table and one
    summary, paired across the files, written with ``--json``; the shipped record parses the same way."""
    import json

    nn = _bench("natgrad_nonconjugate")
    row = {"likelihood": "dgp2", "steps": 5, "rmse": 0.1, "train_elbo": -0.2, "wall_s": 1.0, "failure": ""}
    (tmp_path / "a.json").write_text(json.dumps([row | {"method": "default", "seed": 3, "test_ll": 1.25},
                                                 {"dataset": "digits", "method": "ep", "accuracy": 0.9}]))
    (tmp_path / "b.json").write_text(json.dumps([row | {"method": "nat_all", "seed": 3, "test_ll": 1.5}]))
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["x", "--summarize", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--json", str(out)])
    nn.main()
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["default", "nat_all", "default", "nat_all", "nat_all - default"]
    assert rows[-1]["seeds"] == 1 and math.isclose(rows[-1]["test_ll"], 0.25)
    assert "1.2500" in capsys.readouterr().out  # four decimals
    record = json.loads((BENCH / "records" / "natgrad_dgp_kin8nm.json").read_text())
    assert {r["method"] for r in nn.summary(record)} >= {"default", "nat_all", "nat_all - default"}
    assert all(r["steps"] == 5000 and r["source"] for r in record)


def test_natgrad_dgp_parallel_runs_match_and_stop(tmp_path):
    """``--workers 2``: the runs in processes of the benchmark give the rows of the same runs in this process; with
    ``--time-limit`` reached before a run starts, every run is reported "stopped" at step 0 (none is lost)."""
    import pyro

    nn = _bench("natgrad_nonconjugate")
    pyro.settings.set(module_local_params=True)
    jobs = [("dgp2", 0, "default"), ("dgp2", 1, "nat_all")]
    stopped = nn.parallel_rows(_dgp_args(workers=2, time_limit=0.0, log_dir=str(tmp_path / "a")), jobs, 3)
    assert [(r["seed"], r["steps"], r["failure"]) for r in stopped] == [(0, 0, "stopped"), (1, 0, "stopped")]
    par = nn.parallel_rows(_dgp_args(workers=2, log_dir=str(tmp_path / "b")), jobs, 3)
    assert sorted(f.name for f in (tmp_path / "b").iterdir()) == [
        "dgp2_0_default.json", "dgp2_0_default.log", "dgp2_1_nat_all.json", "dgp2_1_nat_all.log"]
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the benchmark's (its processes set it), also in the float32 suite
    try:
        here = [nn.dgp_row(_dgp_args(), *job, 3) for job in jobs]
    finally:
        torch.set_default_dtype(dtype)
    for a, b in zip(sorted(par, key=lambda r: r["seed"]), here, strict=True):
        assert (a["method"], a["seed"], a["failure"]) == (b["method"], b["seed"], "")
        assert math.isclose(a["train_elbo"], b["train_elbo"], rel_tol=1e-6)


def test_svi_natgrad_choices_runs_each_method_on_both_programs():
    """benchmarks/svi_natgrad_choices.py: two steps of each method on the grid's SVGP and SOLVE-GP and on the
    hand-written deep GP give finite losses; the methods are the step lengths and warm-ups they name."""
    import math

    import pyro
    from pyro.infer import Trace_ELBO

    ch = _bench("svi_natgrad_choices")
    pyro.settings.set(module_local_params=True)
    opt = ch._optim("ng0.01_warmup5")
    assert opt.natgrad_lr == 0.01 and opt.schedule.steps == 5 and isinstance(ch._optim("adam"), pyro.optim.PyroOptim)
    X, y = ch.grid_data(N=200)
    for model in ("svgp", "solvegp"):
        assert math.isfinite(ch.grid_run(X, y, model, Trace_ELBO, 64, 0, "ng0.1", 2))
    Xd, yd = ch.dgp_data()
    assert math.isfinite(ch.dgp_run(Xd.to(torch.get_default_dtype()), yd.to(torch.get_default_dtype()), 0, "ng0.1", 2))


# -- the real-data benchmarks against the peers (counts_nmes, heteroscedastic, multioutput_weather) ------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # linear_operator's torch.jit.script at import
@pytest.mark.parametrize("script", ["counts_nmes", "heteroscedastic", "multioutput_weather"])
def test_real_data_quick_tables(script, tmp_path, capsys):
    """``--quick`` of each real-data benchmark: one row per method that runs on this branch, in the METHODS table's
    order, with the common keys; every row is timed to its peer's final test NLPD (from the evaluation after which it
    stays within ``REACH_TOL`` of it; the peer settles no later than its end), the JSON file holds the same rows and
    then the done-when conditions (paired differences recomputed here), the hooks that cannot run yet are named."""
    import json

    bench = _bench(script)
    bench.rd.run_methods.reported.clear()
    path, threads = tmp_path / "rows.json", torch.get_num_threads()
    try:  # one thread: two on a busy 2-core machine made the quick run 30 times slower
        rows = bench.main(["--quick", "--json", str(path), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    runnable = [m for m, spec in bench.METHODS.items() if spec.missing() is None]
    saved = json.loads(path.read_text())
    assert [r["method"] for r in rows] == runnable and saved[: len(rows)] == rows
    checks = saved[len(rows) :]  # the done-when conditions of issue 47 whose two methods both ran
    def ran(spec):  # both methods of a condition have rows (of its data set, where it names one)
        on = {r["method"] for r in rows if r["dataset"] == (spec[3] if len(spec) > 3 else {}).get("dataset",
                                                                                                r["dataset"])}
        return spec[1] in on and spec[2] in on

    assert checks and [c["condition"] for c in checks] == [spec[0] for spec in bench.DONE_WHEN if ran(spec)]
    for c in checks:
        diffs = [a["test_nlpd"] - b["test_nlpd"] for a in rows for b in rows
                 if (a["method"], b["method"]) == (c["a"], c["b"]) and a["split"] == b["split"]]
        assert c["nlpd_diff"] == pytest.approx(sum(diffs) / len(diffs)) and c["a_lower"] == sum(d < 0 for d in diffs)
    by_name = {r["method"]: r for r in rows}
    for r in rows:
        assert set(bench.rd.ROW_KEYS) <= set(r) and r["library"] == bench.METHODS[r["method"]].library
        assert math.isfinite(r["test_nlpd"]) and r["time_s"] > 0 and r["steps"] > 0 and r["curve"][-1][0] == r["steps"]
        assert r["curve"][-1][2] == r["test_nlpd"]
        peer = by_name[r["peer"]]
        assert r["peer_nlpd"] == peer["test_nlpd"]
        near = [nlpd <= peer["test_nlpd"] + bench.REACH_TOL for _, _, nlpd in r["curve"]]  # stays near from here on
        first = next((i for i in range(len(near)) if all(near[i:])), None)
        assert r["time_to_peer_s"] == (None if first is None else r["curve"][first][1])
        assert peer["time_to_peer_s"] is not None  # a peer settles at its own final value at the latest
    out = capsys.readouterr().out
    assert "Mean over" in out and all(f"#   {r['dataset']} split {r['split']} {r['method']}" in out for r in rows)
    assert "Done when (issue 47):" in out and all(c["text"] in out for c in checks)
    for m, spec in bench.METHODS.items():
        assert (f"# {m}: not run" in out) == (spec.missing() is not None)


def _fine_integral(logp, mean, var, lo=-12.0, hi=12.0, n=4001):
    """``log ∫ exp(logp(f)) N(f; mean, var) df`` by the trapezoid rule on a fine grid (numpy, float64)."""
    import numpy as np

    z = np.linspace(lo, hi, n)
    f = mean + np.sqrt(var) * z
    dens = np.exp(logp(f) - 0.5 * z**2) / np.sqrt(2 * np.pi)
    return np.log(np.trapezoid(dens, z))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_real_data_predictive_densities_match_fine_quadrature():
    """The scoring of the real-data benchmarks: ``_realdata.predictive`` (64-point Gauss-Hermite) for Poisson counts
    and the heteroscedastic predictive (quadrature over g), and the closed-form expected log-likelihood of the GPyTorch
    heteroscedastic likelihood, against trapezoid integrals on fine grids written with scipy."""
    from types import SimpleNamespace

    import numpy as np
    from scipy import stats

    rd, het = _bench("_realdata"), _bench("heteroscedastic")
    y = torch.tensor([0.0, 3.0, 12.0])
    mean, var = torch.tensor([0.5, 1.2, 2.0]), torch.tensor([0.3, 0.05, 0.6])
    lp, pmean = rd.predictive(lambda f: torch.distributions.Poisson(f.exp()), y, mean, var)
    for i in range(3):
        want = _fine_integral(lambda f, i=i: stats.poisson.logpmf(y[i].item(), np.exp(f)), mean[i].item(),
                              var[i].item())
        assert lp[i].item() == pytest.approx(want, abs=1e-4)
    torch.testing.assert_close(pmean, (mean + var / 2).exp(), rtol=1e-4, atol=0)  # E[exp f], lognormal mean
    # heteroscedastic: y ~ N(f, exp(2g)), q(f) = N(mf, vf), q(g) = N(mg, vg)
    mf, vf, mg, vg, yv = 0.3, 0.2, -0.7, 0.15, 1.1
    task = SimpleNamespace(yt=torch.tensor([yv]), y_std=2.0)
    got = het.het_metrics(task, *(torch.tensor([v]) for v in (mf, vf, mg, vg)))["test_nlpd"]
    want = -_fine_integral(lambda g: stats.norm.logpdf(yv, mf, np.sqrt(vf + np.exp(2 * g))), mg, vg) + np.log(2.0)
    assert got == pytest.approx(want, abs=1e-4)
    # E_q(f) q(g)[log N(y; f, exp(2g))] in closed form against a 2-D grid
    qf = SimpleNamespace(mean=torch.tensor([[mf, mg]]), variance=torch.tensor([[vf, vg]]))
    ell = het.het_likelihood().expected_log_prob(torch.tensor([yv]), qf).item()
    z = np.linspace(-9, 9, 601)
    F, G = np.meshgrid(mf + np.sqrt(vf) * z, mg + np.sqrt(vg) * z, indexing="ij")
    w = np.exp(-0.5 * z**2) / np.sqrt(2 * np.pi)
    inner = stats.norm.logpdf(yv, F, np.exp(G)) * w[:, None] * w[None, :]
    assert ell == pytest.approx(np.trapezoid(np.trapezoid(inner, z, axis=1), z), abs=1e-6)


@pytest.mark.float64  # maximum likelihood to ~1e-6 nats
def test_counts_glms_reach_scipy_maximum_likelihood():
    """benchmarks/counts_nmes.py's GLMs (torch L-BFGS) end at the maximum-likelihood fit that scipy finds for the same
    log-linear Poisson, NB2 and NB1 models written with scipy.stats (test NLPD at scipy's optimum)."""
    from types import SimpleNamespace

    import numpy as np
    from scipy import optimize, stats

    counts = _bench("counts_nmes")
    task = counts.load_task(split=3, M=4)
    cfg = SimpleNamespace(glm_iters=200)
    X1, Xt1 = (np.c_[np.ones(len(A)), A.numpy()] for A in (task.X, task.Xt))
    y, yt = task.y.numpy(), task.yt.numpy()

    def poisson(theta, X, y):
        return -stats.poisson.logpmf(y, np.exp(X @ theta)).mean()

    def negbin(theta, X, y):  # NB2: mean mu, variance mu + alpha mu^2, n = 1 / alpha, p = n / (n + mu)
        mu, n = np.exp(X @ theta[:-1]), np.exp(-theta[-1])
        return -stats.nbinom.logpmf(y, n, n / (n + mu)).mean()

    def negbin1(theta, X, y):  # NB1: mean mu, variance mu (1 + alpha), n = mu / alpha, p = 1 / (1 + alpha)
        mu, alpha = np.exp(X @ theta[:-1]), np.exp(theta[-1])
        return -stats.nbinom.logpmf(y, mu / alpha, 1 / (1 + alpha)).mean()

    for negbin_model, nb1, nll in ((False, False, poisson), (True, False, negbin), (True, True, negbin1)):
        theta0 = np.zeros(X1.shape[1] + negbin_model)
        theta0[0] = np.log(y.mean())
        best = optimize.minimize(nll, theta0, args=(X1, y), method="BFGS", options={"gtol": 1e-9, "maxiter": 2000})
        got = counts.run_glm(task, cfg, negbin=negbin_model, nb1=nb1).final["test_nlpd"]
        assert got == pytest.approx(nll(best.x, Xt1, yt), abs=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("lmc", [True, False])
def test_weather_gpytorch_masking_drops_exactly_the_missing_entries(lmc):
    """benchmarks/multioutput_weather.py trains GPyTorch's multitask models on targets with NaN under
    ``observation_nan_policy("mask")``: the expected log-likelihood it then computes is the Gaussian one summed over
    the observed entries only (written out here from q(f)'s marginals and the task noises)."""
    import gpytorch

    gpt = _bench("_gpytorch")
    X, Y = torch.rand(20, 1), torch.randn(20, 3)
    Y[3, 1] = Y[5, 0] = Y[5, 1] = Y[7, 2] = float("nan")
    model = gpt.approximate_gp(X[:5], mean="constant", latents=2 if lmc else 3, tasks=3, lmc=lmc, lengthscale=1.0,
                               outputscale=1.0)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3)
    lik.task_noises = torch.tensor([0.1, 0.2, 0.3])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    q = model(X)
    with gpytorch.settings.observation_nan_policy("mask"):
        ell = lik.expected_log_prob(Y, q).sum()
    noise = lik.task_noises + lik.noise
    m, v, obs = q.mean, q.variance, Y.isfinite()
    want = (-0.5 * math.log(2 * math.pi) - 0.5 * noise.log() - 0.5 * ((Y - m) ** 2 + v) / noise)[obs].sum()
    torch.testing.assert_close(ell, want)
    assert obs.sum() == 56 and m.shape == (20, 3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # linear_operator's torch.jit.script at import
def test_counts_softplus_nb1_is_gpytorchs_negative_binomial():
    """benchmarks/counts_nmes.py's ``SoftplusNB1`` (GPyTorch's model written for ``from_distribution``) gives the
    log-probabilities of GPyTorch's ``NegativeBinomialLikelihood`` with success probability alpha / (1 + alpha)."""
    import gpytorch

    counts = _bench("counts_nmes")
    ours = counts.SoftplusNB1()
    with torch.no_grad():
        ours.dispersion = torch.tensor(0.7)
        theirs = gpytorch.likelihoods.NegativeBinomialLikelihood()
        theirs.probs = torch.tensor([0.7 / 1.7])
        f, y = torch.tensor([-1.0, 0.3, 2.5, 4.0]), torch.tensor([0.0, 2.0, 7.0, 40.0])
        torch.testing.assert_close(ours(f).log_prob(y), theirs.forward(f).log_prob(y).to(f.dtype))
