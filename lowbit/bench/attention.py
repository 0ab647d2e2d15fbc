"""Decode attention benchmark: the split-KV paged kernel against torch SDPA on gathered K/V.

    python -m lowbit.bench.attention --out DIR [--copy-gbps N] [--sweep]
        [--batches 1,8,32] [--contexts 1024,8192,32768] [--kv-dtypes bf16,fp8]

Shapes: Qwen3-30B-A3B attention (H/Hkv = 32/4, D = 128), block size 16; every sequence holds
the full context; blocks are handed out shuffled; random data (never zeros). KV pools: bf16,
or fp8 (e4m3 codes and a float32 scale per token and head, as lowbit.engine.paged_cache
stores them; SDPA gets the dequantized values).
Per point (B sequences x context tokens x pool dtype):
  bytes     K/V the step must read: B * context * Hkv * 2 tensors * (D * 2 bytes, or fp8:
            D codes + a 4-byte scale) (q, the output and the block tables are < 0.1% of it
            and not counted)
  triton    median of triton.testing.do_bench over eager launches (split + reduce kernels)
  graph     median per step of a CUDA graph replaying the step once per input set (no
            launch gaps: what a captured decode step pays)
  sdpa      torch.nn.functional.scaled_dot_product_attention (enable_gqa) on K/V already
            gathered into contiguous [B, Hkv, context, D] (the gather is not timed): an
            in-process peer that reads the same bytes without a block table
  elementwise  (fp8 pools) the graph time with the fp8 word tiles off (config WORDS False:
            codes loaded and converted one by one), the path before them
  sweep     (--sweep) graph-replayed time of each launch config in SWEEP (fp8 pools: also
            num_stages 1); the best per point
  splits    (--split-factors 0.5,2,4) graph-replayed time of the default config with the
            split count (decode_splits: SPLIT_WAVES programs per SM) times each factor
  GB/s and % of the copy bandwidth (--copy-gbps, else measured here: read + write bytes of
  a 1 GiB device-to-device copy); rel_err: triton vs sdpa outputs.
Inputs rotate over enough sets (>= 256 MiB of K/V in all) that no step finds its K/V in L2.
Writes DIR/attention_bench.json (rows + environment) and DIR/attention_bench.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.bench.record import environment, md_table
from lowbit.kernels.attention import (
    FP8,
    MAX_SPLITS,
    KVPool,
    decode_splits,
    paged_decode,
    reference_kv_write,
)
from lowbit.kernels.runtime import HAS_TRITON

if HAS_TRITON:  # imported here: triton's timer; the module still imports where triton (a test extra) is absent
    from triton.testing import do_bench

H, HKV, D, BS = 32, 4, 128, 16
ROTATE_BYTES = 256 << 20
MAX_SETS = 128
SWEEP = [dict(BN=bn, num_warps=w, num_stages=st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
SWEEP_FP8 = [dict(BN=bn, num_warps=w, num_stages=st) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2)]


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, read + write bytes over the median time."""
    a = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _inputs(batch: int, context: int, sets: int, seed: int = 0, device: str = "cuda", kv: str = "bf16"):
    """One pool holding sets * batch sequences; per set: q, block tables, seq_lens, dense K/V
    (the values the pool stands for: fp8 pools dequantized)."""
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // BS)
    blocks = sets * batch * per_seq
    k = torch.randn((blocks + 1) * BS, HKV, D, generator=g, device=device).bfloat16()
    v = torch.randn((blocks + 1) * BS, HKV, D, generator=g, device=device).bfloat16()
    pool = KVPool(k, v, BS)
    if kv == "fp8":
        rows = k.shape[0]
        pool = KVPool(torch.empty(rows, HKV, D, dtype=FP8, device=device),
                      torch.empty(rows, HKV, D, dtype=FP8, device=device), BS,
                      torch.empty(rows, HKV, device=device), torch.empty(rows, HKV, device=device))
        reference_kv_write(k, v, pool, torch.arange(rows, device=device))
        k = (pool.k.float() * pool.k_scale[..., None]).bfloat16()
        v = (pool.v.float() * pool.v_scale[..., None]).bfloat16()
    order = torch.randperm(blocks, generator=g, device=device).to(torch.int32).view(sets, batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    pos = torch.arange(context, device=device)
    out = []
    for s in range(sets):
        rows = order[s][:, pos // BS].long() * BS + pos % BS  # [B, context]
        dense_k = k[rows].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, context, D]
        dense_v = v[rows].permute(0, 2, 1, 3).contiguous()
        q = torch.randn(batch, H, D, generator=g, device=device).bfloat16()
        out.append((q, order[s].contiguous(), lens, dense_k, dense_v))
    return pool, out


def _rotating(fns: list):
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return step


def _graph_ms(fns: list) -> float:
    """Median time per call of a CUDA graph that runs every fn once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / len(fns)


def bench_point(batch: int, context: int, copy_gbps: float, sweep: bool = False,
                device: str = "cuda", kv: str = "bf16",
                split_factors: tuple[float, ...] = ()) -> dict:

    kv_bytes = batch * context * HKV * 2 * (D + 4 if kv == "fp8" else D * 2)
    sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / kv_bytes)))
    pool, inputs = _inputs(batch, context, sets, device=device, kv=kv)
    scale = D ** -0.5
    outs = [torch.empty(batch, H, D, device=device, dtype=torch.bfloat16) for _ in inputs]

    def triton_fn(i, cfg=None, splits=None):
        q, tables, lens, _, _ = inputs[i]
        return lambda: paged_decode(q, pool, tables, lens, scale, out=outs[i], config=cfg,
                                    num_splits=splits)

    def sdpa_fn(i):
        q, _, _, k, v = inputs[i]
        return lambda: F.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, enable_gqa=True)

    tri = [triton_fn(i) for i in range(sets)]
    sdpa = [sdpa_fn(i) for i in range(sets)]
    tri_ms = do_bench(_rotating(tri), warmup=25, rep=200, return_mode="median")
    graph_ms = _graph_ms(tri)
    row = {"B": batch, "context": context, "H": H, "Hkv": HKV, "D": D, "kv_dtype": kv,
           "splits": decode_splits(batch, HKV, context, torch.device(device)), "input_sets": sets,
           "kv_bytes": kv_bytes, "triton_us": tri_ms * 1e3, "graph_us": graph_ms * 1e3}
    try:
        sdpa_ms = do_bench(_rotating(sdpa), warmup=25, rep=200, return_mode="median")
        ref = sdpa[0]()[:, :, 0, :]
        tri[0]()
        row["sdpa_us"] = sdpa_ms * 1e3
        row["rel_err_vs_sdpa"] = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend without GQA or memory
        row["sdpa_us"], row["sdpa_error"] = None, str(e).splitlines()[0]
    if kv == "fp8":  # the same step with the codes loaded and converted one by one
        row["elementwise_us"] = _graph_ms([triton_fn(i, dict(WORDS=False)) for i in range(sets)]) * 1e3
    for key in ("triton", "graph", "sdpa", "elementwise"):
        us = row.get(f"{key}_us")
        row[f"{key}_gbps"] = kv_bytes / (us * 1e-6) / 1e9 if us else None
        row[f"{key}_pct_copy"] = 100 * row[f"{key}_gbps"] / copy_gbps if us else None
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["triton_us"] if row.get("sdpa_us") else None
    if split_factors:  # the default config at other split counts
        counts = sorted({max(1, min(MAX_SPLITS, round(row["splits"] * f))) for f in split_factors})
        row["splits_sweep"] = [{"splits": n, "graph_us": _graph_ms(
            [triton_fn(i, splits=n) for i in range(sets)]) * 1e3} for n in counts]
    if sweep:  # graph-replayed time of each launch config (DECODE_CFG is the default)
        row["sweep"] = [{**cfg, "graph_us": _graph_ms([triton_fn(i, cfg) for i in range(sets)]) * 1e3}
                        for cfg in (SWEEP_FP8 if kv == "fp8" else SWEEP)]
        best = min(row["sweep"], key=lambda r: r["graph_us"])
        row["best_config"] = best
    return row


def bench_attention(out_dir: str | Path, copy_gbps: float | None = None,
                    batches: tuple[int, ...] = (1, 8, 32),
                    contexts: tuple[int, ...] = (1024, 8192, 32768), sweep: bool = False,
                    kv_dtypes: tuple[str, ...] = ("bf16",),
                    split_factors: tuple[float, ...] = ()) -> list[dict]:
    """Run every (B, context) point; write attention_bench.json and .md under out_dir."""
    assert torch.cuda.is_available(), "the attention benchmark needs a CUDA device"
    measured = copy_gbps is None
    copy_gbps = copy_bandwidth_gbps() if measured else float(copy_gbps)
    rows = []
    for kv in kv_dtypes:
        for b in batches:
            for c in contexts:
                rows.append(bench_point(b, c, copy_gbps, sweep, kv=kv, split_factors=split_factors))
                torch.cuda.empty_cache()  # the point's pool is garbage now
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"kind": "attention_decode", "env": environment("cuda"), "copy_gbps": copy_gbps,
              "copy_source": "measured" if measured else "given", "rows": rows}
    (out / "attention_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "attention_bench.md").write_text(markdown(record))
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(record: dict) -> str:
    head = ["KV", "B", "context", "splits", "K/V MiB", "triton us", "GB/s", "% copy", "graph us",
            "% copy", "sdpa us", "% copy", "sdpa / triton time", "rel err", "fp8 elementwise graph us"]
    body = [[r.get("kv_dtype", "bf16"), r["B"], r["context"], r["splits"], _fmt(r["kv_bytes"] / 2**20, ".1f"),
             _fmt(r["triton_us"], ".1f"), _fmt(r["triton_gbps"], ".0f"), _fmt(r["triton_pct_copy"], ".0f"),
             _fmt(r["graph_us"], ".1f"), _fmt(r["graph_pct_copy"], ".0f"), _fmt(r["sdpa_us"], ".1f"),
             _fmt(r["sdpa_pct_copy"], ".0f"), _fmt(r["speedup_vs_sdpa"], ".2f"),
             _fmt(r.get("rel_err_vs_sdpa"), ".1e"), _fmt(r.get("elementwise_us"), ".1f")]
            for r in record["rows"]]
    if any("best_config" in r for r in record["rows"]):
        head.append("best config (graph us)")
        for line, r in zip(body, record["rows"]):
            c = r.get("best_config")
            line.append(f"BN {c['BN']} w{c['num_warps']} s{c['num_stages']} ({c['graph_us']:.1f})" if c else "-")
    if any("splits_sweep" in r for r in record["rows"]):
        head.append("splits: graph us")
        for line, r in zip(body, record["rows"]):
            line.append(", ".join(f"{x['splits']}: {x['graph_us']:.1f}" for x in r.get("splits_sweep", [])) or "-")
    env = record["env"]
    return (f"## Decode attention, H/Hkv = {H}/{HKV}, D = {D}, block size {BS}\n\n"
            f"{md_table(head, body)}\n\nCopy bandwidth {record['copy_gbps']:.0f} GB/s "
            f"({record['copy_source']}). Device: {env['device']}; commit `{env.get('commit')}`; "
            f"torch {env['versions'].get('torch')}, triton {env['versions'].get('triton')}.  \n"
            f"Command: `{env['command']}`\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lowbit.bench.attention", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for attention_bench.json and .md")
    p.add_argument("--copy-gbps", type=float, default=None, help="copy bandwidth to compare with (default: measure)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--sweep", action="store_true", help="also time every launch config in SWEEP (graph replay)")
    p.add_argument("--kv-dtypes", default="bf16", help="comma-separated pool dtypes: bf16, fp8")
    p.add_argument("--split-factors", default="", help="also time the default config at the "
                   "default split count times each of these (e.g. 0.5,2,4; graph replay)")
    args = p.parse_args(argv)
    ints = lambda s: tuple(int(x) for x in s.split(","))
    kvs = tuple(args.kv_dtypes.split(","))
    bad = [k for k in kvs if k not in ("bf16", "fp8")]
    if bad:
        p.error(f"--kv-dtypes: unknown pool dtype {bad[0]!r} (bf16 or fp8)")
    try:
        factors = tuple(float(x) for x in args.split_factors.split(",") if x)
    except ValueError:
        p.error(f"--split-factors: not a list of numbers: {args.split_factors!r}")
    if any(f <= 0 for f in factors):
        p.error("--split-factors: factors must be > 0")
    bench_attention(args.out, args.copy_gbps, ints(args.batches), ints(args.contexts), args.sweep, kvs,
                    factors)
    print((Path(args.out) / "attention_bench.md").read_text())


if __name__ == "__main__":
    main()
