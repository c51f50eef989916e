#!/usr/bin/env bash
# The device checks for a session that is lent a GPU, in one call of at most about 8 minutes (docs/gpu.md, "What was
# measured on a GPU"):
#   1. the test suite with every tensor on the GPU (-v, so that every failure is named even if the call is cut off);
#   2. tests/integration/test_gpu_move.py (CUDA-only: build on the CPU, module.to("cuda"), fit, predict);
#   3. the subsampled ODVGP's step time per doubling of M2 at M = 128 and 1024 (issue 28, item 2), beside SVGP M.
# Needs pyro-ppl, pyro-api and polyagamma (the device image lacks them: carry their wheels in .whl/, installed here
# into /tmp/site on PYTHONPATH, which the suite's subprocesses inherit; the package itself is read from the tree) and
# kin40k under $PSGP_SHARED_DATA (default: ./shared/data, a copy of ../shared/data/kin40k carried with the tree: carry
# [".whl", "shared"]). Writes logs and JSON under $OUT (default gpu_out/) and prints the failures and the timing
# table. On an H100 the whole call took about 4.5 minutes (docs/gpu.md).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PSGP_SHARED_DATA=${PSGP_SHARED_DATA:-$PWD/shared/data}
python3 -c "import pyro, polyagamma" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; }
# the package from the tree (an editable install would need a build backend from an index)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# -n / --timeout where the image has pytest-xdist / pytest-timeout (the H200 image had both)
par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 15")
per=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 100")
PYRO_SPARSEGP_DEVICE=cuda timeout 240 python3 -m pytest -v -p no:benchmark $par $per tests \
  --ignore tests/integration/test_tutorials.py --ignore tests/integration/test_docs.py > "$OUT/suite.log" 2>&1
timeout 60 python3 -m pytest -v -p no:benchmark tests/integration/test_gpu_move.py > "$OUT/gpu_move.log" 2>&1
for M in 128 1024; do
  timeout 75 python3 benchmarks/solvegp_uci.py --timing --M $M --device cuda --datasets kin40k \
    --json "$OUT/odvgp_timing_M$M.json" > "$OUT/odvgp_timing_M$M.log" 2>&1
done
echo "== suite (failures, then the summary)"; grep -E "^(FAILED|ERROR)| FAILED | ERROR " "$OUT/suite.log" | head -40
tail -n 2 "$OUT/suite.log"
echo "== test_gpu_move"; tail -n 3 "$OUT/gpu_move.log"
for M in 128 1024; do echo "== ODVGP timing M = $M"; tail -n 7 "$OUT/odvgp_timing_M$M.log"; done
