#!/usr/bin/env bash
# The one GPU call: correctness, kernel roofline, engine latency, in stages.
#   STAGES="tests tune kernels attention engine" bash scripts/gpu_check.sh   (repo root, CUDA machine)
# Stages (each under its own time cap, a failing stage does not stop the next):
#   tests      pytest tests/gpu (kernels vs torch twins at real sizes, graph replay)
#   tune       gemv / gemm / MoE-gemv launch-config sweep and the gemv-or-gemm choice per
#              shape and M (scripts/tune_kernels.py -> $OUT/tuned.json), merged into
#              lowbit/kernels/configs/<device>.json for the stages after it
#   tunetc     tensor-core nvfp4 gemv / MoE per-slot sweep (scripts/tune_tc_gemv.py), merged
#              the same way ("tc_gemv", "tc_moe")
#   prefetchab each shipped tensor-core gemv / per-slot MoE config against the same with
#              PREFETCH 2, narrow programs (BN 16 / 32 on one / two warps), and with TC_RING_AB=1
#              the shared-memory ring (RING 3 / 4 / 6 at WAVES 1 / 2 / 4; measured negative in the
#              engine); scripts/tune_tc_gemv.py --prefetch-ab; TC_M, TC_MOE_T, TC_GROUPED_T (empty:
#              none), TC_SHAPES narrow it), the fastest merged the same way; TC_ENGINE_AB=1 instead
#              times the kept configs in the engine ($QUANT, -b TC_ENGINE_B (1,8), 3 repeats, through
#              `--variant tuned=LOWBIT_LAUNCH_CONFIGS:$OUT/tc_tuned.json`) and merges nothing: a win
#              alone is not a win in the graph (docs/KERNEL_NOTES.md)
#   ncu        Nsight Compute over NCU_STEPS engine decode steps at each batch of NCU_BATCHES
#              (default 1 8), $QUANT at the Qwen3-30B-A3B shape: every kernel's own time
#              (ncu runs them one at a time: no PDL overlap), DRAM bytes, GB/s against the
#              copy, occupancy, grouped by kernel and grid (scripts/ncu_step.py); NCU_STALLS=1
#              adds the warp-state section for the tensor-core kernels
#   tunemoe    grouped MoE tile sweep at T = 32, 64, 512, 2048 (scripts/tune_kernels.py
#              --grouped; TUNEMOE_FORMATS, default dense,nvfp4), merged the same way ("moe_grouped")
#   kernels    python -m lowbit.bench.kernels: GEMV / MoE layer vs ceilings and peers
#   attention  python -m lowbit.bench.attention $ATT_ARGS: paged decode attention vs SDPA
#              (ATT_ARGS="--kv-dtypes bf16,fp8 --sweep" adds fp8 pools and the launch-config sweep;
#              --split-factors 0.5,2,4 times other split counts)
#   engine     lowbit bench latency at the Qwen3-30B-A3B shape, random weights, bf16 and
#              $QUANT (ENGINE_FORMATS overrides the list), default routes and flags (what a user gets): pp/tg cells, batched
#              decode, kernels per decode step from a profile, graph status, route calls;
#              ENGINE_FORMATS="nvfp4 nvfp4+nopdl" adds a run with LOWBIT_PDL=0 (+noring:
#              LOWBIT_TC_RING=0; +noslots:
#              LOWBIT_SLOT_FUSION=0; +normgate / +normroute: the triton_norm_gate / triton_norm_route route on,
#              +ropeattn the triton_rope_decode route, by scripts/with_route.py; +fold:
#              LOWBIT_DECODE_FOLD=1); ENGINE_KV="auto fp8"
#              runs each format with a bf16 and an fp8 KV pool; ENGINE_VARIANTS="LABEL=OP:ROUTE,...
#              ..." times each format's cells under those variants too, in the same process and
#              interleaved with the base (`bench latency --variant`; one model load an A/B)
#   offload    expert offload at the Qwen3-30B-A3B shape, $QUANT, C1: resident, then
#              OFFLOAD_SLOTS slots per layer (default 32 = 25 %, graphs copy their own
#              misses), the same with --expert-prefetch-graphs (OFFLOAD_30B=0 skips the
#              three), then Qwen3-235B-A22B in nf3 from a
#              24 GiB slot budget (OFFLOAD_BIG=0 skips it); tokens sampled at temperature 1 (OFFLOAD_ROUTING)
#   vq         vector codebook kernels: tests/gpu/test_vq_gemv_gpu.py, then the gemv and the MoE
#              layer timed beside nf4 / nvfp4 / bf16 (scripts/bench_vq_gemv.py [--moe])
#   mla        DeepSeek-V2-Lite bf16, pp / tg cells for each of MLA_VARIANTS (default "default
#              torch"): default routes (MLA prefill and decode on the latent kernels, both
#              captured, triton_mla_rope and triton_silu_mul), torch
#              (LOWBIT_ROUTE_LATENT_ATTENTION=torch), unfused (the mla_rope and act ops on
#              their torch twins)
#   launch     scripts/graph_launch_cost.py at the Qwen3-30B-A3B shape, $QUANT: each captured decode and
#              verify graph's launch call alone (idle, busy, after a copy, an event wait, another graph),
#              with LOWBIT_PDL=1 then 0 (LAUNCH_PDL="1": on only), the
#              graphs' DOT dumps and node kinds in the archive
#   spec       speculative decoding: the demo with ngram and its draft (k = 3, SPEC_DEMO_K="1 2 3 4"
#              one run a k; SPEC_DEMO=0 skips them), and the synthetic 0.7 acceptance cell at the Qwen3-30B-A3B shape,
#              $QUANT at k = 3 (SPEC_SYN_K="1 3 7": one run a k, the verify step at T = 2, 4, 8,
#              the cost model's input; SPEC_SYN_ADAPTIVE=1: each k an upper bound, the engine's
#              cost model picks; SPEC_SYN=0 skips it), and DeepSeek-V3 cut to 4 layers with its MTP
#              layer drafting (SPEC_MTP=0 skips it): verify steps in graphs
# Writes under $OUT (default ./gpu_out); the last lines printed are the summary tables. The
# records (*-latency-*.json, kernel JSON) are in $OUT/results.tar.gz: $OUT returns at most 8 files.
# Exit status 1 when a stage's command failed or hit its cap: the last lines name each (FAILED ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
RES=$(mktemp -d /tmp/gpu_check.XXXXXX)  # everything; $OUT gets the summaries and one archive
trap 'tar czf "$OUT/results.tar.gz" -C "$RES" . 2>/dev/null' EXIT
unset TRITON_INTERPRET
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export LOWBIT_COMMIT=${LOWBIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STAGES=${STAGES:-tests tune kernels attention engine}
T_TESTS=${T_TESTS:-200} T_TUNE=${T_TUNE:-330} T_TUNEMOE=${T_TUNEMOE:-240} T_BENCH=${T_BENCH:-330} T_ATT=${T_ATT:-60}
T_ENGINE_BF16=${T_ENGINE_BF16:-240} T_ENGINE_Q=${T_ENGINE_Q:-240}  # engine stage: a cap per format
TESTS=${TESTS:-tests/gpu}
TUNE_FORMATS=${TUNE_FORMATS:-nvfp4,int4_g128}
TUNE_SHAPES=${TUNE_SHAPES:-4096x14336,14336x4096,2048x6144,5120x2048,2048x4096}
TUNE_M=${TUNE_M:-1,2,4,8,16,32,64,512} TUNE_JOBS=${TUNE_JOBS:-12}
KERNEL_SECTIONS=${KERNEL_SECTIONS:-linear,moe,moe_mixed,router}
QUANT=${QUANT:-nvfp4}
CONFIG=${CONFIG:-lowbit/model_configs/Qwen__Qwen3-30B-A3B.json}
CELLS=${CELLS:--p 512 -n 64 -b 1,8,32,64 -r 2}
has() { [[ " $STAGES " == *" $1 "* ]]; }
FAILED=()  # commands of the stages that exited non-zero: listed last, and the script exits 1
failed() { [ "$1" = 0 ] || FAILED+=("$2: exit $1$([ "$1" = 124 ] && echo ', its time cap')"); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

if has tests; then
  echo "== tests/gpu"
  timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -60 | tee "$OUT/tests_gpu.log"
  failed "${PIPESTATUS[0]}" "tests ($TESTS)"
fi

merge_tuned() {  # the stages after a sweep use what it found
  [ -s "$1" ] || return 0
  python3 - "$1" "$RES" <<'PY'
import json, shutil, sys
from lowbit.kernels import launch
tuned = json.load(open(sys.argv[1]))
path = launch.CONFIG_DIR / f"{launch.slug(tuned['device'])}.json"
# a device that borrows another's file (configs/aliases.json) starts from that file's tables
cur = json.loads(path.read_text()) if path.exists() else dict(launch._device(tuned["device"]), device=tuned["device"])
for table in ("gemv", "gemm", "choice", "moe_gemv", "moe_grouped", "tc_gemv", "tc_moe"):
    cur.setdefault(table, {}).update(tuned.get(table, {}))
path.write_text(json.dumps(cur, indent=1))
shutil.copy(path, sys.argv[2])  # the merged file comes back in results.tar.gz, ready to ship
print("configs ->", path)
PY
}

if has tune; then
  echo "== gemv / gemm / MoE gemv config sweep"
  timeout "$T_TUNE" python3 scripts/tune_kernels.py --out "$OUT/tuned.json" --formats "$TUNE_FORMATS" \
    --shapes "$TUNE_SHAPES" --m "$TUNE_M" --jobs "$TUNE_JOBS" 2>&1 | tee "$OUT/tune.log" | grep -v "^  " | tail -60
  merge_tuned "$OUT/tuned.json"
fi

if has tunemoe; then
  echo "== grouped MoE tile sweep"
  timeout "$T_TUNEMOE" python3 scripts/tune_kernels.py --grouped --out "$OUT/tuned_grouped.json" \
    --grouped-formats "${TUNEMOE_FORMATS:-dense,nvfp4}" --jobs "$TUNE_JOBS" 2>&1 | tee "$OUT/tune_grouped.log" | grep -v "^  " | tail -20
  merge_tuned "$OUT/tuned_grouped.json"
fi

if has tunetc; then
  echo "== tensor-core nvfp4 gemv config sweep"
  timeout "${T_TUNETC:-300}" python3 scripts/tune_tc_gemv.py --out "$OUT" 2>&1 | tee "$OUT/tune_tc.log" | grep -v "^  " | tail -30
  merge_tuned "$OUT/tc_tuned.json"
fi

if has prefetchab; then
  echo "== tensor-core gemv: PREFETCH 2 (TC_RING_AB=1: and the cp.async ring) against the shipped configs"
  ring_ab=(); [ "${TC_RING_AB:-0}" = 1 ] && ring_ab=(--ring)
  timeout "${T_PREFETCHAB:-240}" python3 scripts/tune_tc_gemv.py --out "$OUT" --prefetch-ab "${ring_ab[@]}" \
    --m "${TC_M:-1,4,8,16}" --moe-t "${TC_MOE_T:-1,4,16,32}" --grouped-t "${TC_GROUPED_T-16,32,64}" --shapes "${TC_SHAPES:-}" 2>&1 | tee "$OUT/prefetch_ab.log" | tail -40
  if [ "${TC_ENGINE_AB:-0}" = 1 ]; then  # the kept configs through the engine first, not merged
    echo "== engine A/B: the tuner's kept configs (LOWBIT_LAUNCH_CONFIGS) against the shipped ones" | tee -a "$OUT/engine.log"
    timeout "${T_TC_ENGINE_AB:-150}" python3 -m lowbit bench latency x --random-weights --config "$CONFIG" \
      --quantization "$QUANT" -p 512 -n 128 -b "${TC_ENGINE_B:-1,8}" -d 0 -r 3 \
      --variant "tuned=LOWBIT_LAUNCH_CONFIGS:$OUT/tc_tuned.json" --records "$RES" --append-md "$OUT/engine.md" 2>&1 \
      | grep --line-buffered -v "^loading" | tee -a "$OUT/engine.log" | tail -25
    failed "${PIPESTATUS[0]}" "engine A/B of the tuned configs"
  else
    merge_tuned "$OUT/tc_tuned.json"
  fi
fi

if has kernels; then
  echo "== kernel benchmark"
  timeout "$T_BENCH" python3 -m lowbit.bench.kernels --out "$RES" --sections "$KERNEL_SECTIONS" 2>&1 | tee "$OUT/bench.log" | tail -80
fi

if has attention; then
  echo "== attention benchmark"
  timeout "$T_ATT" python3 -m lowbit.bench.attention --out "$RES" ${ATT_ARGS:-} 2>&1 | tee "$OUT/attention_bench.log" | tail -40
fi

if has engine; then
  # one log for both formats ($OUT holds at most 8 files): the [latency] progress lines
  # stream in as they come (a capped run still shows its last step), the table comes last
  # a format suffixed +nopdl runs with LOWBIT_PDL=0 (the programmatic-dependent-launch A/B),
  # +noslots with LOWBIT_SLOT_FUSION=0 (the MoE's two-launch sort and combine launch); both: +noslots+nopdl;
  # a suffix +noring runs with LOWBIT_TC_RING=0 (tuned RING configs on their register loop); last
  # suffixes switch OPT_IN fused routes on (scripts/with_route.py): +normgate the one-launch
  # post-attention norm + gate, +normroute the one that also ranks, +ropeattn the decode kernel
  # that does the rope op's work; +fold merges decode splits in their last program
  # (LOWBIT_DECODE_FOLD=1: no reduce launch); any order, e.g. nvfp4+normroute+ropeattn+fold
  for spec in ${ENGINE_FORMATS:-bf16 $QUANT}; do
   for kv in ${ENGINE_KV:-auto}; do  # ENGINE_KV="auto fp8": each format with both KV pools
    # each fused route at DEFAULT status for the run (prefill's calls keep the unfused path)
    ng=$spec; on=(); fold=0
    while :; do
      case "$ng" in
        *+fold) fold=1; ng=${ng%+fold} ;;
        *+normgate) on+=(norm_gate triton_norm_gate); ng=${ng%+normgate} ;;
        *+normroute) on+=(norm_gate triton_norm_route); ng=${ng%+normroute} ;;
        *+ropeattn) on+=(rope_attention triton_rope_decode); ng=${ng%+ropeattn} ;;
        *) break ;;
      esac
    done
    lowbit=(python3 -m lowbit); [ ${#on[@]} -gt 0 ] && lowbit=(python3 scripts/with_route.py "${on[@]}" --)
    plain=${ng%+noring}; ring=1; [ "$plain" != "$ng" ] && ring=0
    fmt=${plain%+nopdl}; pdl=1; [ "$fmt" != "$plain" ] && pdl=0
    base=${fmt%+noslots}; slots=1; [ "$base" != "$fmt" ] && slots=0; fmt=$base
    cap=$T_ENGINE_BF16; [ "$fmt" != bf16 ] && cap=$T_ENGINE_Q
    echo "== engine latency: $spec, KV $kv (default routes, cap ${cap} s)" | tee -a "$OUT/engine.log"
    q=(); [ "$fmt" != bf16 ] && q=(--quantization "$fmt")
    variants=(); for v in ${ENGINE_VARIANTS:-}; do variants+=(--variant "$v"); done
    LOWBIT_PDL=$pdl LOWBIT_SLOT_FUSION=$slots LOWBIT_TC_RING=$ring LOWBIT_DECODE_FOLD=$fold timeout "$cap" "${lowbit[@]}" bench latency x --random-weights \
      --config "$CONFIG" "${q[@]}" --kv-cache-dtype "$kv" $CELLS "${variants[@]}" --records "$RES" \
      --append-md "$OUT/engine.md" 2>&1 | grep --line-buffered -v "^loading" | tee -a "$OUT/engine.log"
    rc=${PIPESTATUS[0]}
    failed "$rc" "engine $spec, KV $kv"
    [ "$rc" = 124 ] && echo "engine latency $fmt: stopped by its ${cap} s cap" | tee -a "$OUT/engine.log"
   done
  done
fi

if has ncu; then
  NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -1)}
  echo "ncu: ${NCU:-not found}" | tee -a "$OUT/ncu.log"
  # one log and one table file for every batch ($OUT holds at most 8 files); the CSVs and
  # summaries go to the archive
  for b in ${NCU_BATCHES:-1 8}; do
    echo "== ncu: $QUANT, decode steps at B = $b" | tee -a "$OUT/ncu.log"
    timeout "${T_NCU:-240}" "$NCU" --profile-from-start off --clock-control none --csv --page raw \
      --metrics "$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import ncu_step; print(ncu_step.NCU_METRICS)')" \
      --log-file "$RES/ncu_b$b.csv" python3 scripts/ncu_step.py --random-weights --config "$CONFIG" \
      --quantization "$QUANT" --batch "$b" --steps "${NCU_STEPS:-2}" --meta "$RES/ncu_b${b}_meta.json" 2>&1 \
      | grep -v "^==PROF==" | tail -5 | tee -a "$OUT/ncu.log"
    python3 scripts/ncu_step.py --summarize "$RES/ncu_b$b.csv" --meta "$RES/ncu_b${b}_meta.json" \
      --json "$RES/ncu_b${b}_summary.json" 2>&1 | tee -a "$OUT/ncu.md" | head -30
  done
  if [ "${NCU_STALLS:-0}" = 1 ]; then
    echo "== ncu: warp states of the tensor-core kernels, B = 1" | tee -a "$OUT/ncu.log"
    timeout "${T_NCU:-240}" "$NCU" --profile-from-start off --clock-control none --csv --page raw \
      --section WarpStateStats --section SpeedOfLight --kernel-name regex:_tc_ --launch-count 8 \
      --log-file "$RES/ncu_stalls.csv" python3 scripts/ncu_step.py --random-weights --config "$CONFIG" \
      --quantization "$QUANT" --batch 1 --steps 1 --meta "$RES/ncu_stalls_meta.json" 2>&1 | tail -3 | tee -a "$OUT/ncu.log"
    python3 - "$RES/ncu_stalls.csv" <<'PY' 2>&1 | tee -a "$OUT/ncu.md"
import sys
sys.path.insert(0, "scripts")
import ncu_step
for k in ncu_step.read_ncu_csv(open(sys.argv[1]).read()):
    st = sorted(((v, m.split("issue_stalled_")[1]) for m, v in k.items() if "issue_stalled_" in m), reverse=True)
    print(ncu_step.short_name(k["name"]), round(k.get("gpu__time_duration.sum", 0), 2), "us;",
          ", ".join(f"{m} {v:.2f}" for v, m in st[:8]))
PY
  fi
fi

if has offload; then
  # sampled tokens: greedy random weights repeat a token and route
  # to the same experts every step (docs/SERVING.md "Routing of random weights")
  ROUTING=${OFFLOAD_ROUTING:---temperature 1}
  C1="-p 64 -n 64 -d 0 -r ${OFFLOAD_REPEATS:-3} $ROUTING"
  OFFLOAD_RUNS=("" "--expert-offload --expert-cache-slots ${OFFLOAD_SLOTS:-32}"
                "--expert-offload --expert-cache-slots ${OFFLOAD_SLOTS:-32} --expert-prefetch-graphs")
  [ "${OFFLOAD_30B:-1}" = 1 ] || OFFLOAD_RUNS=()
  for args in "${OFFLOAD_RUNS[@]}"; do
    echo "== offload: $QUANT ${args:-resident} ($ROUTING)" | tee -a "$OUT/offload.log"
    timeout "${T_OFFLOAD:-200}" python3 -m lowbit bench latency x --random-weights --config "$CONFIG" \
      --quantization "$QUANT" $C1 $args --records "$RES" 2>&1 \
      | grep --line-buffered -v "^loading" | tee -a "$OUT/offload.log"
    failed "${PIPESTATUS[0]}" "offload ${args:-resident}"
  done
  if [ "${OFFLOAD_BIG:-1}" = 1 ]; then
    echo "== offload: Qwen3-235B-A22B nf3, 24 GiB of slots ($ROUTING)" | tee -a "$OUT/offload.log"
    timeout "${T_OFFLOAD_BIG:-400}" python3 -m lowbit bench latency x --random-weights \
      --config lowbit/model_configs/Qwen__Qwen3-235B-A22B.json --quantization nf3 --expert-offload \
      --expert-cache-gib 24 --kv-cache-tokens 4096 -p 64 -n 32 -d 0 -r 2 $ROUTING --records "$RES" \
      2>&1 | grep --line-buffered -v "^loading" | tee -a "$OUT/offload.log"
    failed "${PIPESTATUS[0]}" "offload Qwen3-235B-A22B"
  fi
fi

if has vq; then
  echo "== vq kernels" | tee -a "$OUT/vq.log"
  timeout "${T_VQ_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_vq_gemv_gpu.py 2>&1 | tail -15 | tee -a "$OUT/vq.log"
  timeout "${T_VQ:-200}" python3 scripts/bench_vq_gemv.py 2>&1 | tee -a "$OUT/vq.log" | tail -100
  timeout "${T_VQ_MOE:-120}" python3 scripts/bench_vq_gemv.py --moe 2>&1 | tee -a "$OUT/vq.log" | tail -30
fi

if has mla; then
  for variant in ${MLA_VARIANTS:-default torch}; do  # unfused: the mla_rope and act ops on their twins
    latent="" rope="" act=""
    case $variant in torch) latent=torch ;; unfused) rope=torch act=torch ;; esac
    echo "== mla: DeepSeek-V2-Lite bf16 $variant routes" | tee -a "$OUT/mla.log"
    LOWBIT_ROUTE_LATENT_ATTENTION=$latent LOWBIT_ROUTE_MLA_ROPE=$rope LOWBIT_ROUTE_ACT=$act \
      timeout "${T_MLA:-150}" python3 -m lowbit bench latency x --random-weights \
      --config lowbit/model_configs/deepseek-ai__DeepSeek-V2-Lite.json ${MLA_CELLS:--p 512,2048 -n 32 -d 0 -b 1,8 -r 2} \
      --records "$RES" 2>&1 | grep --line-buffered -v "^loading" | tee -a "$OUT/mla.log"
    failed "${PIPESTATUS[0]}" "mla $variant"
  done
fi

if has spec; then
  SPEC_DEMO_METHODS=("ngram" "draft --speculative-model demo-draft")
  [ "${SPEC_DEMO:-1}" = 1 ] || SPEC_DEMO_METHODS=()
  [ "${SPEC_SYN:-1}" = 1 ] || T_SPEC_SYN=0
  for m in "${SPEC_DEMO_METHODS[@]}"; do
   for k in ${SPEC_DEMO_K:-3}; do  # SPEC_DEMO_K="1 2 3 4": the demo's draft lengths one run each
    echo "== spec: demo $m, k = $k" | tee -a "$OUT/spec.log"
    timeout "${T_SPEC:-150}" python3 -m lowbit bench latency demo --spec $m --num-speculative-tokens "$k" \
      -n 128 -r 3 --records "$RES" 2>&1 | grep --line-buffered -v "^loading" | tee -a "$OUT/spec.log"
    failed "${PIPESTATUS[0]}" "spec demo $m, k = $k"
   done
  done
  if [ "${SPEC_MTP:-1}" = 1 ]; then  # DeepSeek-V3 cut to 4 layers (3 dense, 1 MoE) + its MTP layer
    python3 -c "import json; c = json.load(open('lowbit/model_configs/deepseek-ai__DeepSeek-V3.json')); \
c.update(num_hidden_layers=4, num_nextn_predict_layers=1); json.dump(c, open('/tmp/v3_l4.json', 'w'))"
    echo "== spec: DeepSeek-V3 (4 layers + MTP) $QUANT, mtp k = 1" | tee -a "$OUT/spec.log"
    timeout "${T_SPEC_MTP:-200}" python3 -m lowbit bench latency x --random-weights --config /tmp/v3_l4.json \
      --quantization "$QUANT" --spec mtp --num-speculative-tokens 1 -n 64 -r 2 --records "$RES" 2>&1 \
      | grep --line-buffered -v "^loading" | tee -a "$OUT/spec.log"
    failed "${PIPESTATUS[0]}" "spec mtp"
  fi
  [ "${T_SPEC_SYN:-240}" = 0 ] || for k in ${SPEC_SYN_K:-3}; do  # SPEC_SYN_K="1 3 7": verify at T = 2, 4, 8
  echo "== spec: synthetic acceptance 0.7, $QUANT, k = $k" | tee -a "$OUT/spec.log"
  timeout "${T_SPEC_SYN:-240}" python3 -m lowbit bench latency x --random-weights --config "$CONFIG" \
    --quantization "$QUANT" --spec ngram --num-speculative-tokens "$k" --spec-synthetic-accept 0.7 \
    $([ "${SPEC_SYN_ADAPTIVE:-0}" = 1 ] && echo --speculative-adaptive) \
    -n 128 -r 3 --records "$RES" 2>&1 | grep --line-buffered -v "^loading" | tee -a "$OUT/spec.log"
  failed "${PIPESTATUS[0]}" "spec synthetic k = $k"
  done
fi

if has launch; then  # each captured graph's cudaGraphLaunch alone, idle and busy, PDL on and off
  for pdl in ${LAUNCH_PDL:-1 0}; do  # LAUNCH_PDL="1": the default only
    echo "== launch: graph launch cost, $QUANT, LOWBIT_PDL=$pdl" | tee -a "$OUT/launch.log"
    LOWBIT_PDL=$pdl timeout "${T_LAUNCH:-150}" python3 scripts/graph_launch_cost.py --config "$CONFIG" \
      --quantization "$QUANT" --dump "$RES/graphs_pdl$pdl" 2>&1 | grep --line-buffered -v "^loading" \
      | tee -a "$OUT/launch.log"
    failed "${PIPESTATUS[0]}" "launch LOWBIT_PDL=$pdl"
  done
fi

if [ ${#FAILED[@]} -gt 0 ]; then  # a stage that failed is not hidden behind the last stage's exit
  printf 'FAILED %s\n' "${FAILED[@]}"
  exit 1
fi
echo "every stage's commands exited 0"
