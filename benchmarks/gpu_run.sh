#!/usr/bin/env bash
# One device session: GPU tests, then the engine benchmarks; logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mempath-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "^\s*$" | tail -n 25; }
[ "${SKIP_TESTS:-0}" = 1 ] || step tests 240 python3 -m pytest -q -x tests/test_gpu_engine.py tests/test_triton_kernels.py -p no:cacheprovider
step latency 150 python3 benchmarks/bench_engine.py latency --shape llama-3.1-8b --hf-tokens 32
step tput-qwen3 150 python3 benchmarks/bench_engine.py throughput --shape qwen3-0.6b --hf-timeout 40
step tput-llama 200 python3 benchmarks/bench_engine.py throughput --shape llama-3.1-8b --hf-timeout 40
grep -h RESULT "$OUT"/*.log > "$OUT/results.jsonl" || true
