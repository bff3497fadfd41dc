#!/usr/bin/env bash
# The GPU checks, in one run on a lent CUDA machine (no network there): install the carried wheels, run the GPU suite
# in float32 and bfloat16, then the benchmark. Prepare the wheels here first (`make gpu-wheels`), then run this script
# there from the checkout's root with `.whl` carried (see docs/gpu.md). Writes its logs and figures under $OUT (or
# ./gpu-results).
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout ${SUITE_SECONDS:-240} python3 -m pytest -q -p no:cacheprovider tests_gpu --device cuda \
    --dtypes float32,bfloat16 2>&1 | tail -30 | tee "$out/suite.txt"
timeout ${BENCH_SECONDS:-300} python3 benchmarks/gpu.py --device cuda --dtype bfloat16 --repeats ${REPEATS:-20} \
    --out "$out/gpu.json" 2>&1 | tee "$out/bench.txt"
