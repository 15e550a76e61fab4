#!/usr/bin/env bash
# The GPU run, from the repository root on a CUDA machine: install, `pytest -m gpu`, then benchmarks.
# Results (JSON, logs) go to $OUT. Extra arguments go to `python -m lightning_sloth.bench`.
#   bash benchmarks/gpu_suite.sh [--systems hf_padded,sloth]
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks, carried as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -m gpu -q -rs --junitxml="$OUT/gpu_tests.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    python3 -m lightning_sloth.bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
echo "gpu tests exit code: $tests_rc"
