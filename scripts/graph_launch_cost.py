"""Host cost of one cudaGraphLaunch for each CUDA graph an engine captures: the plain decode
graphs and the speculative verify step's HIDDEN prefill graphs, at a real config's shape with
random weights. A verify step's replay span in the engine is 158-315 us on the GPU hosts
where a plain decode graph of as many kernels launches in 21-30 us; launched alone here, on an
idle device, the same verify graph takes 18 us (H100, docs/BENCHMARKS.md "H100 calls at
f0083c9"), so the engine's cost comes from the state it launches in. This times each graph's
launch call alone from four device states (`launch_us`: idle, busy, after a pinned copy, after
an event wait), and with --dump DIR writes each graph's DOT (torch's debug dump) and counts its
node kinds. Run it once with LOWBIT_PDL=0 too: programmatic launch edges are one difference a
graph's launch may pay for.

    python scripts/graph_launch_cost.py [--config lowbit/model_configs/Qwen__Qwen3-30B-A3B.json]
        [--quantization nvfp4] [--k 7] [--repeats 50] [--dump /tmp/graphs]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from lowbit.engine.llm import LLM
from lowbit.engine.sampling import SamplingParams

STATES = ("idle", "busy", "copy", "event", "switch")


def launch_us(graph: torch.cuda.CUDAGraph, repeats: int, state: str,
              other: torch.cuda.CUDAGraph | None = None) -> list[float]:
    """Each launch of `graph` alone, from a device state:
    idle   synchronized before;
    busy   right after another replay of the same graph (the timed launch queues behind it);
    copy   synchronized, then a 4 KiB pinned host-to-device copy issued just before (the
           engine's upload: a verify step launches its graph right after it);
    event  an event recorded and waited on before (the engine's wait for a step's tokens);
    switch synchronized after a replay of another graph (`other`: a verify step's bucket
           changes when its drafts run short)."""
    host = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    done = torch.cuda.Event()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if state == "busy":
            graph.replay()
        elif state == "copy":
            dev.copy_(host, non_blocking=True)
        elif state == "event":
            graph.replay()
            done.record()
            done.synchronize()
        elif state == "switch" and other is not None:
            other.replay()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        out.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return out


NODE_KINDS = ("KERNEL", "MEMCPY", "MEMSET", "HOST", "EVENT_RECORD", "WAIT_EVENT", "MEM_ALLOC", "MEM_FREE",
              "EMPTY", "GRAPH", "CONDITIONAL")


def node_kinds(dot: Path) -> dict[str, int]:
    """Node kinds named in a cudaGraphDebugDotPrint file (the upper-case type words of its
    node labels), its edges, and the lines that mention a programmatic (PDL) dependency."""
    text = dot.read_text(errors="replace")
    kinds = Counter(re.findall(r"\b(" + "|".join(NODE_KINDS) + r")\b", text))
    return {"edges": text.count("->"), "programmatic": len(re.findall(r"(?i)programmatic", text)), **kinds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="lowbit/model_configs/Qwen__Qwen3-30B-A3B.json")
    ap.add_argument("--quantization", default="nvfp4")
    ap.add_argument("--k", type=int, default=7, help="drafts a verify step (its graph holds k + 1 tokens)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--dump", type=Path, help="write each graph's DOT here and count its node kinds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_cost.py needs CUDA")
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        base = torch.cuda.CUDAGraph

        class DebugGraph(base):  # keeps the cudaGraph_t after instantiation, for debug_dump
            def __init__(self, *a, **k) -> None:
                try:  # torch >= 2.7 drops the cudaGraph_t at instantiation unless told to keep it
                    super().__init__(*a, keep_graph=True, **k)
                except TypeError:
                    super().__init__(*a, **k)
                self.enable_debug_mode()

        torch.cuda.CUDAGraph = DebugGraph
    common = dict(random_weights=True, config=args.config, quantization=args.quantization, kv_cache_tokens=4096)
    spec = LLM("x", speculative_method="ngram", num_speculative_tokens=args.k, speculative_synthetic_accept=0.7,
               **common)
    plain = LLM("x", loaded=spec.loaded, **common)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for llm in (plain, spec):
        llm.generate([list(range(3, 67))], sp)
    graphs = [(f"decode {key[0]}", g) for key, g in plain.engine.runner.graphs.graphs.items()]
    graphs += [(f"verify {key[0]}x{key[1]} {key[2]}", g)
               for key, g in spec.engine.runner.prefill_graphs.graphs.items()]
    rows = []
    for i, (name, g) in enumerate(graphs):
        row = {"graph": name}
        for state in STATES:
            us = launch_us(g, args.repeats, state, graphs[i - 1][1])
            row[f"{state}_us_median"], row[f"{state}_us_min"] = round(statistics.median(us), 1), round(min(us), 1)
        if args.dump:
            path = args.dump / (re.sub(r"\W+", "_", name) + ".dot")
            g.debug_dump(str(path))
            row["nodes"] = node_kinds(path) if path.exists() else "no dump written"
        rows.append(row)
        print(json.dumps(row))
    print(f"device {torch.cuda.get_device_name()}; LOWBIT_PDL as set in the environment; "
          f"{args.repeats} launches a graph and state")


if __name__ == "__main__":
    main()
