"""README's main job (``python -m pyro_sparsegp``) as a user runs it with its output redirected to a log: it exits 0
with warnings turned into errors, prints its metrics, writes its plot, and logs progress as a few plain lines (no
carriage-return redraws, no warning text)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags", [[], ["--float32"]], ids=["float64", "float32"])
def test_main_job_is_warning_free_and_logs_plain_lines(flags, tmp_path):
    plot = tmp_path / "fit.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-W", "error", "-m", "pyro_sparsegp", "--steps", "60", "--M", "32", "--plot", str(plot)]
        + flags,
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stdout + run.stderr, run.stderr[-3000:]
    rmse = float(re.search(r"test RMSE\s+([0-9.]+) MW", run.stdout)[1])
    assert 3.0 < rmse < 10.0, run.stdout  # the data's sd is 17 MW; 60 steps already learn most of it
    assert plot.is_file() and plot.stat().st_size > 10_000
    lines = run.stderr.splitlines()
    assert "\r" not in run.stderr
    progress = [line for line in lines if line.startswith("fit: step ")]
    assert 10 <= len(progress) <= 21 and progress[-1].startswith("fit: step 60/60 (100%)"), lines
