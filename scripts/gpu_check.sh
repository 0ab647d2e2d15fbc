#!/usr/bin/env bash
# One GPU call: correctness (tests/gpu), a gemv config sweep, then the kernel benchmark.
#   bash scripts/gpu_check.sh            (from the repository root, on a CUDA machine)
# Writes under $OUT (default ./gpu_out): pytest log, tuned configs, kernels.json/.md.
# Each stage has its own time limit so that a slow stage still leaves the others' output.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export LOWBIT_COMMIT=${LOWBIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T_TESTS=${T_TESTS:-200} T_TUNE=${T_TUNE:-150} T_BENCH=${T_BENCH:-330}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

echo "== tests/gpu"
timeout "$T_TESTS" python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -40 | tee "$OUT/tests_gpu.log"

echo "== gemv config sweep (T_TUNE=0 skips it)"
[ "$T_TUNE" -gt 0 ] && timeout "$T_TUNE" python3 scripts/tune_kernels.py --out "$OUT/tuned_gemv.json" --formats int4,nvfp4 \
  --m 1 2>&1 | tee "$OUT/tune.log"
if [ -s "$OUT/tuned_gemv.json" ]; then  # the benchmark below uses what the sweep found
  python3 - "$OUT/tuned_gemv.json" <<'PY'
import json, sys
from lowbit.kernels import launch
tuned = json.load(open(sys.argv[1]))
path = launch.CONFIG_DIR / f"{launch.slug(tuned['device'])}.json"
cur = json.loads(path.read_text()) if path.exists() else {"device": tuned["device"]}
cur.setdefault("gemv", {}).update(tuned["gemv"])
path.write_text(json.dumps(cur, indent=1))
print("configs ->", path)
PY
fi

echo "== kernel benchmark"
timeout "$T_BENCH" python3 -m lowbit.bench.kernels --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -80
