"""A/B of the two tensor-core nvfp4 MoE schedules at the Qwen3-30B-A3B shape, then set
"GROUPED_FROM" in the device's tc_moe configs (scripts/pick_grouped.py's rule).

  python scripts/ab_tc_moe.py OUT_JSON [--c 8,16,32,64] [--mb 8,16,32]
  python scripts/ab_tc_moe.py OUT_JSON --tiles --c 128,512,2048 --mb 16,32   (prefill sizes:
      against the CUDA-core grouped tiles; sets nothing)

Times tc_moe_gemv (per slot) and tc_moe_grouped (each expert once) as lowbit.bench.kernels
does (CUDA-graph replay over 8 routings), checks both against the torch twin at each C, and
writes the rows to OUT_JSON in the kernel benchmark's row format.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lowbit.bench.kernels import timed  # noqa: E402
from lowbit.kernels.moe import fused_moe, reference_moe  # noqa: E402
from lowbit.kernels.samples import BENCH_LUT_FORMATS, random_lut_view  # noqa: E402
from lowbit.kernels.tc_moe import tc_moe_gemv, tc_moe_grouped  # noqa: E402
from lowbit.kernels.weights import resolve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--c", default="8,16,32,64")
    ap.add_argument("--mb", default="8", help="grouped: slots a tile (comma list: one row each)")
    ap.add_argument("--tiles", action="store_true",
                    help="also time the CUDA-core grouped tiles (moe.fused_moe, mode grouped: the "
                         "route above 64 tokens); off: per slot (too slow at prefill sizes)")
    a = ap.parse_args()
    dev, (e, top, h, inter) = "cuda", (128, 8, 2048, 768)
    kw = BENCH_LUT_FORMATS["nvfp4"]
    w13 = resolve(random_lut_view(2 * inter, h, lead=(e,), device=dev, tables=2, **kw))
    w2 = resolve(random_lut_view(h, inter, lead=(e,), device=dev, seed=1, **kw))
    rows = []
    for c in (int(v) for v in a.c.split(",")):
        g = torch.Generator(device=dev).manual_seed(c)
        batches = [(torch.randn(c, h, device=dev, dtype=torch.bfloat16),
                    torch.rand(c, e, device=dev, generator=g).topk(top, -1).indices.to(torch.int32),
                    torch.rand(c, top, device=dev, generator=g)) for _ in range(8)]
        ref = reference_moe(*batches[0], w13, w2, dot_dtype=torch.bfloat16)
        impls = [("tiles", lambda *a: fused_moe(*a, mode="grouped"))] if a.tiles else [
            ("mma gemv", tc_moe_gemv)]
        impls += [
            (f"mma grouped{'' if mb == '8' else ' mb' + mb}",
             lambda *a, mb=int(mb): tc_moe_grouped(*a, config=dict(MB=mb, BK=128 if mb > 16 else 256)))
            for mb in a.mb.split(",")]
        for name, fn in impls:
            y = fn(*batches[0], w13, w2)
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            t = timed([lambda b=b, fn=fn: fn(*b, w13, w2) for b in batches])
            rows.append({"kind": "moe", "shape": "qwen3-30b-a3b", "M": c,
                         "impl": f"ours nvfp4 {name}", "rel_err": err, **t})
            print(f"C{c} {name}: {t['us']:.1f} us [{t['min_us']:.1f}-{t['max_us']:.1f}] err {err:.1e}",
                  flush=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
    if not a.tiles:
        subprocess.run([sys.executable, str(Path(__file__).with_name("pick_grouped.py")), a.out],
                       check=True)


if __name__ == "__main__":
    main()
