"""Host syncs inside one prefill of the engine: torch's sync debug mode ("warn") over a
P-token prompt, each synchronizing call counted by the lowbit frame that made it.

  python scripts/sync_audit.py [--config lowbit/model_configs/Qwen__Qwen3-30B-A3B.json] [-p 512]
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from lowbit.bench.latency import Session
from lowbit.config import EngineConfig
from lowbit.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="lowbit/model_configs/Qwen__Qwen3-30B-A3B.json")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("--quantization", default=None)
    a = ap.parse_args()
    cfg = EngineConfig(model="x", config=a.config, random_weights=True, kv_cache_tokens=4 * a.p + 4096,
                       quantization=a.quantization)
    eng = Session(cfg).llm.engine
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def run(r: int) -> None:
        eng.add_request([(13 * j + 7 * r + 5) % 1000 for j in range(a.p)], sp)
        while eng.has_unfinished():
            eng.step()

    run(0)  # compiles outside the audit
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/lowbit/" in f.filename]
        where = f"{frames[-1].filename.split('/lowbit/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else filename
        sites[(where, str(message)[:60])] += 1

    old = warnings.showwarning
    warnings.showwarning = hook
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"synchronizing calls in one {a.p}-token prefill: {sum(sites.values())}")
    for (where, msg), n in sites.most_common(25):
        print(f"{n:6d}  {where}  ({msg})")


if __name__ == "__main__":
    main()
