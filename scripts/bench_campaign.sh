#!/usr/bin/env bash
# The GPU benchmark campaign in one call (about 9 minutes on one H200):
#   1. lowbit bench latency at the Qwen3-30B-A3B shape, random bf16 weights:
#      pp512, tg128 at depth 0 and 32768 (3 repeats)
#   2. lowbit serve at the same shape in the background, then lowbit bench serve at
#      concurrency 1..32, retained context 0 and then 32768 (128 in / 32 out tokens)
#   3. lowbit bench latency with 4-bit weights (--quantization $QUANT), when the CLI has it
#   4. lowbit bench report: the plots
# Every stage has a time cap; a failed or capped stage does not stop the later ones.
# What comes back under $OUT (default ./bench_out) is at most 7 files: BENCHMARKS.md (the
# tables), campaign.log, records.tar.gz (JSON records + logs) and the PNG plots.
#
# Usage: OUT=/path bash scripts/bench_campaign.sh
# Knobs (env): CONFIG, QUANT (nvfp4), PORT (8011), BUDGET_S (540), REPEATS (3), CELLS
# ("-p 512 -n 128 -d 0,32768"), T_LATENCY (170: each Qwen3 latency stage's cap),
# CONCURRENCY (1,2,4,8,16,32), LONG_CONTEXT (32768),
# INPUT_LEN (128), OUTPUT_LEN (32), DEVICE (empty: cuda when present), DTYPE (auto: bf16 on a GPU),
# SERVE_FLAGS (more flags for lowbit serve, e.g. "--cuda-graph-capture lazy" for the A/B of the
# start-up capture), SERVE_RESTART (0; 1: a second server start and a C1 level, its start-up
# with the Triton cache the first start filled).
# LONG_CONTEXT=0 skips the long-context serving level; the server's --max-num-seqs is the
# largest CONCURRENCY level, its KV pool KV_TOKENS tokens (empty, the default: sized from
# --gpu-memory-utilization, as a user's; records before e03c42b used 262144, which bf16
# weights leave no room for on an 80 GB card). LATENCY=0 skips both Qwen3 latency stages; MODELS="stem:format
# ..." adds latency cells (MODEL_CELLS, default "-p 512 -n 64 -b 1,8") for other configs.
# `lowbit serve` needs fastapi and uvicorn; where they are missing (the GPU image has
# httpx but no fastapi/uvicorn/pydantic/starlette) carry their wheels in .whl/
# (`bash scripts/fetch_wheels.sh` downloads them) and this script installs them to
# /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=$(mkdir -p "${OUT:-./bench_out}" && cd "${OUT:-./bench_out}" && pwd)
WORK=$(mktemp -d /tmp/bench_campaign.XXXXXX)
CONFIG=${CONFIG:-lowbit/model_configs/Qwen__Qwen3-30B-A3B.json}
QUANT=${QUANT:-nvfp4}
PORT=${PORT:-8011}
REPEATS=${REPEATS:-3}
read -r -a CELLS <<< "${CELLS:--p 512 -n 128 -d 0,32768}"
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16,32}
LONG_CONTEXT=${LONG_CONTEXT:-32768}
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} ))
MD="$OUT/BENCHMARKS.md"
LOG="$OUT/campaign.log"
mkdir -p "$WORK/records" "$WORK/logs"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LB=(python3 -m lowbit)
SERVER_PID=""

MAX_SEQS=$(tr ',' '\n' <<< "$CONCURRENCY" | sort -n | tail -1)
healthy() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; }
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }

stage() {  # stage NAME SECONDS CMD...: run under a time cap, log to $LOG and logs/NAME.log
    local name=$1 secs; secs=$(cap "$2"); shift 2
    if (( $(left) < 20 )); then say "skip $name: the time budget is spent"; return 1; fi
    say "start $name (cap ${secs}s): $*"
    timeout -k 10 "$secs" "$@" > >(tee "$WORK/logs/$name.log" >> "$LOG") 2>&1
    local rc=$?
    say "end $name: exit $rc"
    return $rc
}

finish() {
    if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
    timeout 60 "${LB[@]}" bench report --records "$WORK/records" --out "$OUT" >> "$LOG" 2>&1
    tar czf "$OUT/records.tar.gz" -C "$WORK" records logs
    say "done: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT

if [[ -d .whl ]] && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  git -C "$REPO" rev-parse HEAD 2>/dev/null; } > "$WORK/logs/host.txt" 2>&1
cat "$WORK/logs/host.txt" >> "$LOG"
COMMON=(--random-weights --config "$CONFIG" ${DEVICE:+--device "$DEVICE"} ${DTYPE:+--dtype "$DTYPE"})
REC=(--records "$WORK/records" --append-md "$MD")

# 1. latency, bf16 (bench latency sizes the KV pool for its cells).
if [[ "${LATENCY:-1}" != 0 ]]; then
    stage latency-bf16 "${T_LATENCY:-170}" "${LB[@]}" bench latency x "${COMMON[@]}" "${CELLS[@]}" -r "$REPEATS" "${REC[@]}"
fi

# 2. serving: one server, two context levels, each with its own time limit. SERVE_RESTART=1:
#    then a second server start of the same flags (its Triton cache warm from the first) and
#    one C1 level, so that the record holds both start-up times.
serve_run() {  # serve_run TAG CONCURRENCY LONG
    local tag=$1 conc=$2 long=$3
    say "start lowbit serve on port $PORT ($tag)"
    "${LB[@]}" serve x "${COMMON[@]}" --port "$PORT" --served-model-name campaign-random \
        --max-num-seqs "$MAX_SEQS" ${KV_TOKENS:+--kv-cache-tokens "$KV_TOKENS"} ${SERVE_FLAGS:-} \
        > "$WORK/logs/serve$tag.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 180); do
        healthy && break
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    if healthy; then
        say "server ready ($tag)"
        LOAD=(--base-url "http://127.0.0.1:$PORT" --concurrency "$conc" --input-len "${INPUT_LEN:-128}"
              --output-len "${OUTPUT_LEN:-32}" --prompts-per-slot 2 --ignore-eos --timeout 150)
        stage "serve-ctx0$tag" 150 "${LB[@]}" bench serve "${LOAD[@]}" --context 0 --time-limit 110 "${REC[@]}"
        if (( long > 0 )); then
            stage "serve-ctx-long$tag" 190 "${LB[@]}" bench serve "${LOAD[@]}" --context "$long" --time-limit 120 "${REC[@]}"
        fi
    else
        say "lowbit serve did not come up; see logs/serve$tag.log in records.tar.gz"
        tail -20 "$WORK/logs/serve$tag.log" >> "$LOG"
    fi
    kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=""
}
if python3 -c "import fastapi, uvicorn" 2>/dev/null; then
    serve_run "" "$CONCURRENCY" "$LONG_CONTEXT"
    if [[ "${SERVE_RESTART:-0}" == 1 ]] && (( $(left) > 60 )); then
        serve_run "-restart" 1 0
    fi
else
    say "skip serving: fastapi/uvicorn are not importable (carry their wheels in .whl/)"
fi

# 3. latency with 4-bit weights, when load-time quantization exists.
if [[ "${LATENCY:-1}" == 0 ]]; then
    say "skip 4-bit latency: LATENCY=0"
elif "${LB[@]}" bench latency --help 2>/dev/null | grep -q -- "--quantization"; then
    stage "latency-$QUANT" "${T_LATENCY:-170}" "${LB[@]}" bench latency x "${COMMON[@]}" --quantization "$QUANT" \
        "${CELLS[@]}" -r "$REPEATS" "${REC[@]}"
else
    say "skip 4-bit latency: this CLI has no --quantization"
fi

# 4. other architectures (MODELS="stem:format ...", stem a file of lowbit/model_configs,
#    format bf16 or a --quantization name), latency only, MODEL_CELLS each.
read -r -a MODEL_CELLS <<< "${MODEL_CELLS:--p 512 -n 64 -b 1,8}"
for spec in ${MODELS:-}; do
    stem=${spec%%:*} fmt=${spec#*:}
    q=(); [[ "$fmt" != bf16 ]] && q=(--quantization "$fmt")
    stage "latency-$stem-$fmt" 150 "${LB[@]}" bench latency x --random-weights \
        --config "lowbit/model_configs/$stem.json" ${DEVICE:+--device "$DEVICE"} "${q[@]}" \
        "${MODEL_CELLS[@]}" -r 2 "${REC[@]}"
done
