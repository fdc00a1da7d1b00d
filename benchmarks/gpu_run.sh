#!/usr/bin/env bash
# One device session: GPU tests, then the benchmarks; logs under $OUT.
# STEPS picks what runs, e.g. STEPS="tests latency". Steps and their rough H200 cost:
#   tests (~3 min)  latency (~1 min, +0.5 per --variants entry)  tput-qwen3, tput-llama (~1.5 min each with HF_TIMEOUT=40)
#   blocks (~3 min)  multiturn (~5 min)  diagnose (~2 min, three shapes)  serve (needs .whl, below)
#   pending, fp8-gemv, fp8-latency, mix-qwen3, mix-llama, mix-moe, mix-tokens, structured, moe-offload, moe-resident,
#   spec-a, spec-bc, multi, sleep-tests, sleep, fp8-kv-tests, fp8-kv, fp8-transfer, mix-fp8, fp8-sweep, fp8-gemv-tests,
#   fp8-gemm-tests, fp8-gemm, fp8-gemm-latency (the open issues, below; STEPS="wheels pending ..." for those needing xgrammar)
#   dense-gemv (~2 min: the dense GEMV's table), dense-latency (~5 min: decode with and without it),
#   dense-mlp-ab (~1.5 min: the table's one-row TMA entries against cuBLAS)
#   decode-sweep (~8 min; DECODE_RUNS picks the shapes)  router-tests, moe-router (~7 min: #21's router kernel)
#   profile (~1 min: kernel table at batch 1), profile-moe, profile-mistral  profile-workload (~1 min: host/device split of the throughput run)
#   decode-balance (~2 min: one layer's decode over equal and unequal contexts, split counts)
#   probe-room (~1 min: the activations' room under the cap, a bf16 engine then an fp8 one at batch 2)
#   startup-room (~1 min: the room the cap leaves a step once every decode graph is captured, three engines)
# The open issues' H200 targets (#17, #20, #21) in three calls of at most 10 minutes, when an H200 is lent:
#   STEPS="decode-sweep"                     batch 1 at prompts 128-2,048 (three dense shapes), batch 8-128 at 1k
#   STEPS="mix-llama mix-qwen3 fp8-latency"  the realistic mix, fp8 weights at batch 1
#   STEPS="fp8-kv moe-resident" FP8_KV_PARTS=decode  fp8 KV at 64 x 8k, both all-resident MoE shapes (141 GB)
# For `serve`, carry fastapi/uvicorn/starlette/pydantic(+core)/anyio/h11/sniffio/annotated-types/
# typing-inspection/prometheus-client as wheels in .whl (see ../.library/device/README.md).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mempath-out}; mkdir -p "$OUT"
# The device tool returns at most 8 files: logs go to LOGS and come back as one archive.
LOGS=$(mktemp -d)
STEPS=${STEPS:-"tests latency tput-qwen3 tput-llama"}
HF_TIMEOUT=${HF_TIMEOUT:-40}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
want() { [[ " $STEPS " == *" $1 "* ]]; }
# After each step the archive is rewritten, so a call cut off by its time limit still returns the logs so far.
step() {
  local name=$1 limit=$2; shift 2; want "$name" || return 0; echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -vE "^\s*$|Logger|Traceback|^  " | tail -n 14
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
}
step tests 260 python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_gpu_engine.py tests/test_triton_kernels.py tests/test_tiers.py tests/test_pdl.py
step kernel-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
step gpu-tests 400 python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_gpu_engine.py tests/test_tiers.py tests/test_pdl.py
step latency 330 python3 benchmarks/bench_engine.py latency --shape llama-3.1-8b --hf-tokens 32 \
  --variants "${VARIANTS:-no-pdl}"
step tput-qwen3 150 python3 benchmarks/bench_engine.py throughput --shape qwen3-0.6b --hf-timeout "$HF_TIMEOUT"
step tput-llama 200 python3 benchmarks/bench_engine.py throughput --shape llama-3.1-8b --hf-timeout "$HF_TIMEOUT"
step blocks 170 python3 benchmarks/bench_engine.py block-size --shape qwen3-0.6b --num-requests 64 --max-num-seqs 64 \
  --block-sizes 8,16,32,64,128,256 --hf-timeout 0
# 24 conversations whose history grows past 8k tokens; the GPU pool (2,048 blocks, 4 GiB)
# holds about 16% of what they need at the last turn.
step multiturn 220 python3 benchmarks/bench_multiturn.py --shape llama-3.1-8b --conversations 24 \
  --user-tokens 1200 --cpu-kv-gb 48 --cpu-kv-gb-with-disk 8
# The customer-service shape of the same test: a 6,500-token document in each
# conversation's first message, then 64-token questions: histories pass 8k tokens while
# each turn adds little to prefill, so TTFT shows what restoring the history saves.
step multiturn-doc 220 python3 benchmarks/bench_multiturn.py --shape llama-3.1-8b --conversations 24 \
  --first-user-tokens 6500 --user-tokens 64 --cpu-kv-gb 48 --cpu-kv-gb-with-disk 8
# #17's decode targets (2026-12-03): batch 1 at prompts 128-2,048 on the three dense shapes, batch 8-128 at
# 1k context (dense shapes only: bench_engine's limit counts every weight, a MoE token reads its active
# ones, see bench_moe.py --parts resident). VARIANTS adds --variants to each run.
if want decode-sweep; then
  # DECODE_RUNS: shape:batch:prompt entries.
  for run in ${DECODE_RUNS:-llama-3.1-8b:1:128 llama-3.1-8b:1:2048 qwen2.5-7b-instruct:1:128 qwen2.5-7b-instruct:1:2048 \
             mistral-7b-v0.1:1:128 mistral-7b-v0.1:1:512 mistral-7b-v0.1:1:2048 \
             llama-3.1-8b:8:960 llama-3.1-8b:32:960 llama-3.1-8b:128:960}; do
    IFS=: read -r shape batch prompt <<< "$run"
    step decode-sweep 150 python3 benchmarks/bench_engine.py latency --shape "$shape" --batch "$batch" \
      --prompt-len "$prompt" --new-tokens 128 --hf-tokens 0 ${VARIANTS:+--variants "$VARIANTS"}
    mv "$LOGS/decode-sweep.log" "$LOGS/decode-$shape-b$batch-p$prompt.log"
  done
fi
step profile 100 python3 benchmarks/profile_steps.py decode --shape llama-3.1-8b --batch 1 --context 128
mv "$LOGS/profile.log" "$LOGS/profile-decode.log" 2>/dev/null
# Batch-1 decode kernel tables of the shapes furthest from their read limit (#21: MoE at 21%, #17: Mistral at 75%).
step profile-moe 150 python3 benchmarks/profile_steps.py decode --shape qwen3-30b-a3b --batch 1 --context 128
step profile-mistral 100 python3 benchmarks/profile_steps.py decode --shape mistral-7b-v0.1 --batch 1 --context 512
step profile-workload 100 python3 benchmarks/profile_steps.py workload --shape qwen3-0.6b
# The open issues' H200 checks (#16, #17, #19, #20, #21, #15), built on the CPU and not yet run on a GPU.
# `pending` runs their GPU tests (about 4 min); each benchmark step is about 2-4 min. Steps that
# import xgrammar or the server need the .whl wheels installed first (STEPS="wheels ...").
if want wheels; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=.:/tmp/site
fi
step pending 300 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or GPU or CUDA or triton" \
  tests/test_fp8_gemv.py tests/test_fp8_weights.py tests/test_moe.py tests/test_moe_triton.py tests/test_moe_prefetch.py tests/test_moe_host.py \
  tests/test_fused_ops.py tests/test_structured_async.py tests/test_structured.py tests/test_structured_compile.py tests/test_spec_interactions.py \
  tests/test_spec_graphs.py tests/test_spec_decode.py tests/test_spec_idle_draft.py tests/test_gpu_engine.py \
  tests/test_gpu_budget.py tests/test_multi_model_gpu.py tests/test_diagnose_multi.py
# The GPU tests of what changed since the last `pending` run (2026-12-02: the fused MoE routing and alignment).
step retest 200 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or GPU or CUDA or triton" \
  tests/test_moe_triton.py tests/test_moe.py
# --sleep-offload-weights (#15): its tests on CUDA (weight arenas, graphs over restored weights), then the wake benchmark.
step sleep-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_multi_model_weights_sleep.py tests/test_multi_model_sleep.py
step sleep 240 python3 benchmarks/bench_sleep.py
step fp8-gemv 300 python3 benchmarks/bench_fp8_gemv.py --out "$LOGS/fp8_gemv_configs.json"
# A sweep of the products named (FP8_GEMV_PRODUCTS) at the rows named, against the shipped table (kept where it
# is faster), for fp8-latency next.
step fp8-sweep 420 python3 benchmarks/bench_fp8_gemv.py --rows "${FP8_GEMV_ROWS:-1,2,4,8,16}" \
  --products "${FP8_GEMV_PRODUCTS:-fma,dot,sum-k,dot-fp8,scaled_mm}" --out "$LOGS/fp8_gemv_configs.json"
step fp8-latency 200 python3 benchmarks/bench_fp8_weights.py latency --shape llama-3.1-8b --new-tokens 128 \
  --table "$( [ -s "$LOGS/fp8_gemv_configs.json" ] && echo "$LOGS/fp8_gemv_configs.json" || echo mempath/assets/fp8_gemv_configs.json )"
step fp8-gemv-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py tests/test_fp8_weights.py \
  -k "gpu or cuda"
# The fp8 GEMM above 16 rows and at 2-8 (#20): its GPU tests, its sweep (the table where it beats _scaled_mm, into
# LOGS), then decode at 4, 8, 32 and 64 sequences with that table against the engine without it (~1 min each).
step fp8-gemm-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py
step fp8-gemm 300 python3 benchmarks/bench_fp8_gemm.py --out "$LOGS/fp8_gemm_configs.json"
if want fp8-gemm-latency; then
  for batch in 4 8 32 64; do
    step fp8-gemm-latency 200 env MEMPATH_FP8_GEMM_CONFIGS="$( [ -s "$LOGS/fp8_gemm_configs.json" ] && \
      echo "$LOGS/fp8_gemm_configs.json" || echo mempath/assets/fp8_gemm_configs.json )" \
      python3 benchmarks/bench_fp8_weights.py latency --shape llama-3.1-8b --batch "$batch" --prompt-len 128 \
      --new-tokens 64 --also-scaled-mm
    mv "$LOGS/fp8-gemm-latency.log" "$LOGS/fp8-gemm-latency-b$batch.log"
  done
fi
# The step that ran out of memory under the budget (thirty-fifth session): bench_fp8_weights' flow, a bf16 engine
# then an fp8 one at batch 2; its records (ledger, room, each step, any out of memory) into LOGS (~1 min).
step probe-room 150 env CASES=bf16+fp8 OUT="$LOGS/probe-room" python3 benchmarks/probe_activation_room.py
# What the cap leaves a step once the decode graphs are captured, against what the budget keeps (thirty-sixth session).
step startup-room 200 python3 benchmarks/probe_startup_room.py --cases qwen3-0.6b:256:bf16,llama-3.1-8b:64:bf16,llama-3.1-8b:64:fp8
step mix-qwen3 200 python3 benchmarks/bench_mix.py --shape qwen3-0.6b --max-num-seqs 256,1024
step mix-llama 240 python3 benchmarks/bench_mix.py --shape llama-3.1-8b --max-num-seqs 256,1024
# #21's all-resident MoE shapes on the realistic mix, transformers CB beside them (time-capped).
step mix-moe 540 python3 benchmarks/bench_mix.py --shape qwen3-30b-a3b --hf-seconds 60 --hf-requests 100
step mix-tokens 200 python3 benchmarks/bench_mix.py --shape llama-3.1-8b --max-num-seqs 1024 --max-num-batched-tokens 8192,16384
step structured 300 python3 benchmarks/bench_structured.py --schemas 20
step grammar-stall 200 python3 benchmarks/bench_grammar_stall.py
step spec-a 300 python3 benchmarks/bench_spec.py --parts a
step spec-bc 420 python3 benchmarks/bench_spec.py --parts bc
step multi 300 python3 benchmarks/bench_multi_model.py
step moe-offload 300 python3 benchmarks/bench_moe.py --parts pinned,offload
# The grouped expert GEMM's launch table (#21): swept here and written where the engine reads it, so the
# steps after it in the same call run with it; a copy comes back in $OUT to be committed.
step moe-gemm 300 python3 benchmarks/bench_moe_gemm.py --out mempath/assets/moe_gemm_configs.json
want moe-gemm && cp mempath/assets/moe_gemm_configs.json "$OUT/" 2>/dev/null
# One layer's decode over equal and lognormal contexts at 8-300 sequences, the engine's split count against
# others (#17).
step decode-balance 300 python3 benchmarks/bench_decode_balance.py --batches 8,16,32,64,128,300 --splits 1,4,8
# Decode graphs cut at the MoE layers of an expert cache (#21, 2026-12-02): their GPU tests.
step slots-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_moe_slots.py tests/test_moe_triton.py \
  tests/test_moe.py tests/test_moe_prefetch.py tests/test_moe_host.py tests/test_moe_gemm_configs.py -k "cuda or gpu or cut"
step moe-offload-host 420 python3 benchmarks/bench_moe.py --parts pinned,offload --cpu-experts auto
step moe-skewed-auto 300 python3 benchmarks/bench_moe.py --parts pinned,offload --routers skewed --cpu-experts auto
# On an 80 GB card, MOE_RESIDENT_MODELS=qwen3-30b-a3b (Mixtral-8x7B's 93 GB does not fit).
step moe-resident 300 python3 benchmarks/bench_moe.py --parts pinned,resident \
  ${MOE_RESIDENT_MODELS:+--resident-models "$MOE_RESIDENT_MODELS"}
# The router kernel (#21, 2026-12-04): its GPU tests, then the resident decode with and without it.
step router-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_triton.py tests/test_moe.py -k "cuda or gpu"
step moe-router 480 python3 benchmarks/bench_moe.py --parts pinned,resident --variants no-router-kernel
# The dense GEMV (#17, 2026-12-04): bf16 layers at decode batches through the GEMV kernel where it beats cuBLAS in chains
# of RMSNorm + projection; swept and written where the engine reads it (a copy comes back in $OUT to be committed),
# then decode with and without it (DENSE_RUNS: shape:batch:prompt:hf_tokens). Rows 1 and 2 by default: the chains'
# gains at 4, 8 and 16 rows turned into losses in the decode step (BENCHMARKS.md, "the dense GEMV").
# The table's one-row TMA entries (gate/up and down of Llama and Mistral, 2026-12-06) were chosen end to end, not by
# this sweep, which times no TMA tiles: the sweep's table gets them back where it lists nothing for their bucket
# (dense-mlp-ab below measures them against cuBLAS).
want dense-gemv && cp mempath/assets/dense_gemv_configs.json /tmp/dense-before-sweep.json
step dense-gemv 400 python3 benchmarks/bench_dense_gemv.py --rows "${DENSE_GEMV_ROWS:-1,2}" \
  --shape "${DENSE_GEMV_SHAPES:-llama-3.1-8b,mistral-7b-v0.1,qwen2.5-7b-instruct,qwen3-0.6b,qwen3-30b-a3b}" \
  --out mempath/assets/dense_gemv_configs.json
want dense-gemv && python3 - <<'PY'
import json
from mempath.kernels.fp8_gemv_triton import DENSE_TABLE, load_dense_table, table_json
before, after = load_dense_table("/tmp/dense-before-sweep.json"), load_dense_table()
about = json.loads(DENSE_TABLE.read_text())
for shape, buckets in before.items():
    for bucket, config in buckets.items():
        if config.tma and bucket not in after.get(shape, {}):
            after[shape] = dict(sorted({**after.get(shape, {}), bucket: config}.items(), key=lambda kv: int(kv[0])))
DENSE_TABLE.write_text(table_json(after, **{k: v for k, v in about.items() if k != "configs"}))
PY
want dense-gemv && cp mempath/assets/dense_gemv_configs.json "$OUT/" 2>/dev/null
# The one-row TMA entries against cuBLAS, end to end: the shipped table against itself without them.
if want dense-mlp-ab; then
  python3 - <<'PY'
import json
table = json.load(open("mempath/assets/dense_gemv_configs.json"))
for buckets in table["configs"].values():
    for bucket in [b for b, config in buckets.items() if config.get("tma")]:
        del buckets[bucket]
json.dump(table, open("/tmp/dense-without-tma.json", "w"))
PY
  for shape in llama-3.1-8b mistral-7b-v0.1; do
    step dense-mlp-ab 150 python3 benchmarks/bench_fp8_weights.py latency --shape "$shape" --new-tokens 128 \
      --also-dense-table /tmp/dense-without-tma.json
    mv "$LOGS/dense-mlp-ab.log" "$LOGS/dense-mlp-ab-$shape.log"
  done
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
fi
if want dense-latency; then
  for run in ${DENSE_RUNS:-llama-3.1-8b:1:128:32 mistral-7b-v0.1:1:512:0 qwen2.5-7b-instruct:1:128:0 llama-3.1-8b:8:960:0 \
             llama-3.1-8b:16:960:0}; do
    IFS=: read -r shape batch prompt hf <<< "$run"
    step dense-latency 150 python3 benchmarks/bench_engine.py latency --shape "$shape" --batch "$batch" \
      --prompt-len "$prompt" --new-tokens 128 --hf-tokens "$hf" --variants no-dense-gemv
    mv "$LOGS/dense-latency.log" "$LOGS/dense-latency-$shape-b$batch-p$prompt.log"
  done
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
fi
# The fp8 KV cache (#20, 2026-12-02): its GPU tests (needle retrieval at 8k/32k, kernels, tier transfers), decode at
# batch 64 x 8k and retrieval at 4k-32k against bf16, tier transfers in both dtypes; fp8 weights and KV on the mix.
step fp8-kv-tests 560 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_fp8_kv_retrieval.py tests/test_fp8_kv.py \
  tests/test_bench_transfer.py tests/test_fp8_gemv.py -k "gpu or cuda"
step fp8-kv 420 python3 benchmarks/bench_fp8_kv.py --parts "${FP8_KV_PARTS:-kernel,decode,retrieval}"
step fp8-transfer 120 python3 benchmarks/bench_transfer.py --compare-kv-dtypes --quick
# MIX_REPEAT rounds, interleaved: a same-machine A/B varies by a few percent from run to run.
step mix-fp8 "$((300 * ${MIX_REPEAT:-1}))" python3 benchmarks/bench_mix.py --shape llama-3.1-8b --max-num-seqs 1024 \
  --quantization none,fp8 --repeat "${MIX_REPEAT:-1}"
step mix-fp8-kv 300 python3 benchmarks/bench_mix.py --shape llama-3.1-8b --max-num-seqs 1024 --kv-cache-dtype fp8 \
  --quantization none,fp8
if want diagnose; then
  for shape in qwen3-0.6b llama-3.1-8b phi-3-mini-4k-instruct; do
    d=$(mktemp -d); cp "tests/data/configs/$shape.json" "$d/config.json"
    step diagnose 75 python3 -m mempath diagnose "$d" --load-format dummy --dtype bfloat16 \
      --max-model-len 2047 --out "$LOGS/diagnose-$shape"
    mv "$LOGS/diagnose.log" "$LOGS/diagnose-$shape.log"
  done
fi
if want serve; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && \
    PYTHONPATH=.:/tmp/site step serve 300 python3 benchmarks/bench_serve.py --model "$(python3 -c 'from mempath.assets import default_model_path as p; print(p())')" \
      --rates 8,32,128,inf --num-requests 256 --input-len 64:512 --output-len 32:256
fi
grep -h RESULT "$LOGS"/*.log > "$OUT/results.jsonl" 2>/dev/null || true
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
