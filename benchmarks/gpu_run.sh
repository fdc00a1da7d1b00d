#!/usr/bin/env bash
# One device session: GPU tests, then the engine benchmarks; logs under $OUT.
# STEPS picks what runs (default: all), e.g. STEPS="tests latency".
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mempath-out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests latency tput-qwen3 tput-llama blocks"}
HF_TIMEOUT=${HF_TIMEOUT:-40}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { local name=$1 limit=$2; shift 2; want "$name" || return 0; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "^\s*$|Logger|Traceback|^  " | tail -n 14; }
step tests 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_ops.py tests/test_gpu_engine.py tests/test_triton_kernels.py ${TEST_FILTER:+-k "$TEST_FILTER"}
step latency 150 python3 benchmarks/bench_engine.py latency --shape llama-3.1-8b --hf-tokens 32
step tput-qwen3 150 python3 benchmarks/bench_engine.py throughput --shape qwen3-0.6b --hf-timeout "$HF_TIMEOUT"
step tput-llama 200 python3 benchmarks/bench_engine.py throughput --shape llama-3.1-8b --hf-timeout "$HF_TIMEOUT"
step blocks 200 python3 benchmarks/bench_engine.py block-size --shape qwen3-0.6b --num-requests 128 --block-sizes 8,16,32,64,128,256 --hf-timeout 0
grep -h RESULT "$OUT"/*.log > "$OUT/results.jsonl" || true
