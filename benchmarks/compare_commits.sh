#!/usr/bin/env bash
# Two trees of mempath side by side on one device, in one session: the same benchmarks,
# run alternately (old, new, old, new) so drift of the machine shows as spread, not as a
# difference. Usage: OLD=dir NEW=dir STEPS="latency tput multiturn budget" bash benchmarks/compare_commits.sh
# Each tree runs its own copy of the benchmarks; RESULT lines go to $OUT/compare.jsonl, each
# tagged with the tree's name.
set -u
OUT=${OUT:-/tmp/mempath-out}; mkdir -p "$OUT"
STEPS=${STEPS:-"latency tput multiturn budget"}
ROUNDS=${ROUNDS:-2}
want() { [[ " $STEPS " == *" $1 "* ]]; }
run_in() {  # tree label limit command...
  local tree=$1 label=$2 limit=$3; shift 3
  echo "=== $label @ $(basename "$tree")"
  (cd "$tree" && PYTHONPATH=. PYTHONUNBUFFERED=1 timeout "$limit" "$@" 2>&1) | tee -a "$OUT/$label.log" \
    | grep RESULT | sed "s/^RESULT /{\"tree\": \"$(basename "$tree")\", \"step\": \"$label\", \"result\": /; s/\$/}/" \
    | tee -a "$OUT/compare.jsonl"
}
for round in $(seq "$ROUNDS"); do
  for tree in "$OLD" "$NEW"; do
    want latency && run_in "$tree" latency 200 python3 benchmarks/bench_engine.py latency --shape llama-3.1-8b --hf-tokens 0
    want tput && run_in "$tree" tput 150 python3 benchmarks/bench_engine.py throughput --shape qwen3-0.6b --hf-timeout 0
  done
done
for tree in "$OLD" "$NEW"; do
  want multiturn && run_in "$tree" multiturn 240 python3 benchmarks/bench_multiturn.py --shape llama-3.1-8b \
    --conversations ${MT_CONVERSATIONS:-12} --user-tokens 1200 --cpu-kv-gb 48 --modes recompute,cpu
  want budget && run_in "$tree" budget 200 python3 benchmarks/bench_budget.py --shape llama-3.1-8b \
    --gpu-memory-utilization 0.5 --steps 1000
done
