"""Progress output (issue 27): a bar on a terminal; in a redirected stream, one plain line every 5 % of the run (or
every 30 s) with the step, the ELBO and the steps per second, never a carriage return; a warning raised while a bar
is shown lands on its own line above the bar, and Python's warning display is given back afterwards."""

import io
import sys
import warnings

import pytest
import torch
from pyro.contrib.gp.kernels import RBF

import pyro_sparsegp as ps
from pyro_sparsegp.infer.training import progress
from pyro_sparsegp.infer.training.progress import Progress


def _fit_into(stream, monkeypatch, steps):
    X = torch.randn(200, 2)
    y = torch.sin(X[:, 0])
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
    monkeypatch.setattr(sys, "stderr", stream)
    ps.infer.fit(gp, X, y, num_steps=steps, batch_size=50)
    monkeypatch.undo()
    return stream.getvalue()


def _step_lines(out: str) -> list:
    """The progress lines of ``out`` (without fit's lines at its start and end)."""
    return [line for line in out.strip().splitlines() if line.startswith("fit: step")]


def test_redirected_fit_writes_a_line_every_five_percent(monkeypatch):
    out = _fit_into(io.StringIO(), monkeypatch, 400)
    assert "\r" not in out
    text = out.strip().splitlines()
    assert text[0].startswith("fit: 400 steps of 50 rows of N = 200 (100 epochs); q(u): natural steps of 0.1"), text[0]
    assert "finish: exact" in text[0]  # the start line says what "auto" chose
    assert text[-2].startswith("fit: exact finish of q(u) and the noise on all 200 points")
    assert text[-1].startswith("fit: done: 400 steps in ") and "per point" in text[-1], text[-1]
    lines = _step_lines(out)
    assert 20 <= len(lines) <= 21, lines  # 5 %, 10 %, ..., 100 % (a 30 s line at most once more)
    assert lines[-1].startswith("fit: step 400/400 (100%)") and "elbo" in lines[-1] and "steps/s" in lines[-1]
    assert lines[0].startswith("fit: step 20/400 (5%)")


def test_the_logged_elbo_is_the_mean_of_the_last_twenty_steps(monkeypatch):
    """The ELBO on the last line is minus the mean loss of the last 20 steps (an exponential average started at the
    first, far larger loss still showed a fraction of it after 60 steps)."""
    losses = []
    X = torch.randn(300, 2)
    y = torch.sin(X[:, 0])
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    ps.infer.fit(gp, X, y, num_steps=60, batch_size=50, callback=lambda step, loss: losses.append(loss))
    monkeypatch.undo()
    shown = float(_step_lines(buf.getvalue())[-1].split("elbo ")[1].split()[0])
    expected = -sum(losses[-20:]) / 20
    assert shown == pytest.approx(expected, rel=1e-3), (shown, expected, losses[0])
    assert abs(losses[0] - losses[-1]) > 0.1 * abs(losses[-1])  # the first loss differs: the test can fail


def test_a_resumed_run_logs_the_same_elbo_as_an_uninterrupted_one(monkeypatch, tmp_path):
    X = torch.randn(300, 2)
    y = torch.sin(X[:, 0])

    def run(steps, **kw):
        torch.manual_seed(0)
        gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Gaussian(0.1))
        buf = io.StringIO()
        monkeypatch.setattr(sys, "stderr", buf)
        ps.infer.fit(gp, X, y, num_steps=steps, batch_size=50, **kw)
        monkeypatch.undo()
        return _step_lines(buf.getvalue())[-1]

    whole = run(60)
    run(50, checkpoint=ps.infer.Checkpoint(tmp_path / "c.pt", every=50))
    resumed = run(60, checkpoint=ps.infer.Checkpoint(None, resume=tmp_path / "c.pt"))
    assert whole.split("elbo ")[1].split()[0] == resumed.split("elbo ")[1].split()[0], (whole, resumed)


def test_steps_past_an_estimated_total_never_show_more_than_100_percent():
    buf = io.StringIO()
    p = Progress(4, file=buf, mode="lines", metric="log Z")
    p.update(5, elbo=-1.0)
    p.close()
    assert buf.getvalue().strip().splitlines()[-1].startswith("fit: step 5/5 (100%)")


def test_line_mode_writes_after_the_time_limit_too():
    buf = io.StringIO()
    p = Progress(1000, file=buf, mode="lines", seconds=0.0)
    for _ in range(3):
        p.update(1, elbo=-1.0)
    p.close()
    assert len(buf.getvalue().splitlines()) == 3  # each update was "30 s" late; close adds nothing new


def test_disabled_progress_writes_nothing(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    X = torch.randn(50, 2)
    ps.infer.fit(ps.SVGP(RBF(2), X[:5].clone(), ps.Gaussian(0.1)), X, X[:, 0], num_steps=5, progress=False)
    monkeypatch.undo()
    assert buf.getvalue() == ""


def test_the_summary_line_gives_the_mean_bound_of_the_last_steps(monkeypatch):
    """The end line's bound per point is minus the mean loss of the last 20 steps over N (an independent recount
    from the callback's losses), and a non-conjugate run says what its natural finish did."""
    losses = []
    X = torch.randn(120, 2)
    y = (X[:, 0] > 0).to(X.dtype)
    gp = ps.SVGP(RBF(2), X[:8].clone(), ps.Bernoulli())
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    ps.infer.fit(gp, X, y, num_steps=40, batch_size=60, callback=lambda step, loss: losses.append(loss))
    monkeypatch.undo()
    text = buf.getvalue().strip().splitlines()
    assert "positive-definite" in text[0] and "finish: natural" in text[0], text[0]
    end = text[-1]
    shown = float(end.split("bound ")[1].split()[0])
    assert shown == pytest.approx(-sum(losses[-20:]) / 20 / 120, rel=1e-3), (end, losses[-20:])
    assert "finish: natural, " in end and "steps accepted" in end, end


@pytest.mark.filterwarnings("default::UserWarning")
def test_a_warning_lands_above_the_bar_not_inside_it(monkeypatch):
    monkeypatch.setattr(progress, "_warnings_recorded", lambda: False)  # as outside pytest's own recorder
    buf = io.StringIO()
    shown = warnings.showwarning
    p = Progress(10, file=buf, mode="bar")
    p.update(3, elbo=-2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("jitter raised", UserWarning, stacklevel=1)
    p.update(7, elbo=-1.0)
    p.close()
    assert warnings.showwarning is shown
    text = buf.getvalue()
    line = next(seg for seg in text.replace("\r", "\n").splitlines() if "jitter raised" in seg)
    assert "UserWarning: jitter raised" in line and "fit:" not in line and "%|" not in line  # a line of its own


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be"):
        Progress(10, mode="fancy")


def test_a_bar_leaves_recorded_warnings_to_their_recorder():
    """Under ``warnings.catch_warnings(record=True)`` (a user's, or pytest's) a bar does not reroute warnings: they
    reach the record list, not the stream."""
    buf = io.StringIO()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = Progress(10, file=buf, mode="bar")
        warnings.warn("jitter raised", UserWarning, stacklevel=1)
        p.update(10, elbo=-1.0)
        p.close()
    assert [str(w.message) for w in seen] == ["jitter raised"] and "jitter raised" not in buf.getvalue()


def test_an_imported_ipykernel_is_not_a_notebook(monkeypatch):
    """A process that imported ipykernel (a test run that executes notebooks) but is not a kernel writes lines."""
    import types

    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert not progress._in_notebook_with_widgets()
    buf = io.StringIO()
    p = Progress(4, file=buf)
    p.update(4, elbo=-1.0)
    p.close()
    assert buf.getvalue().startswith("fit: step 4/4 (100%)")
