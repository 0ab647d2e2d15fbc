"""Set "GROUPED_FROM" in the device's tc_moe launch configs from a kernel benchmark record.

  python scripts/pick_grouped.py KERNELS_JSON

The smallest token count C (at most the route's 64) of the record's Qwen3-30B-A3B nvfp4 MoE
rows from which the expert-grouped tensor-core MoE ("mma grouped") is faster than the per-slot
one ("mma gemv") at C and at every larger C measured; written into every tc_moe entry of
lowbit/kernels/configs/<device>.json (removed when no such C exists).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit.kernels import launch, moe_op  # noqa: E402


def main() -> None:
    rec = json.loads(Path(sys.argv[1]).read_text())
    us = {}
    for r in rec["rows"]:
        if r.get("kind") == "moe" and r.get("shape") == "qwen3-30b-a3b":
            us[(r["impl"], r["M"])] = r["us"]
    # per slot runs up to TC_MOE_PER_SLOT_MAX_TOKENS: larger C (prefill sweeps) do not count
    cs = sorted(c for (impl, c) in us
                if impl == "ours nvfp4 mma grouped" and c <= moe_op.TC_MOE_PER_SLOT_MAX_TOKENS)
    pick = None
    for c in reversed(cs):
        if us[("ours nvfp4 mma grouped", c)] < us.get(("ours nvfp4 mma gemv", c), float("inf")):
            pick = c
        else:
            break
    path = launch.CONFIG_DIR / f"{launch.slug(rec.get('device', ''))}.json"
    cfg = json.loads(path.read_text())
    for buckets in cfg.get("tc_moe", {}).values():
        for entry in buckets.values():
            entry.pop("GROUPED_FROM", None)
            if pick is not None:
                entry["GROUPED_FROM"] = pick
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    print("grouped vs per-slot (us):", {c: (us.get(("ours nvfp4 mma grouped", c)),
                                         us.get(("ours nvfp4 mma gemv", c))) for c in cs})
    print("GROUPED_FROM ->", pick, "in", path)


if __name__ == "__main__":
    main()
