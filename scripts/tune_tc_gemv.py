"""Tune the tensor-core nvfp4 GEMV (lowbit.kernels.tc_gemv) on a GPU.

  python scripts/tune_tc_gemv.py --out DIR [--m 1,4,8,16] [--moe-t 1,4,16,32]
  python scripts/tune_tc_gemv.py --out DIR --prefetch-ab [--ring]
      Times each shipped config (the device file's "tc_gemv" / "tc_moe" entries at each M /
      token count) against the same config with PREFETCH 2 (two K steps in registers), at
      WAVES 1 and twice its WAVES (split-K width), and with --ring with the shared-memory
      ring (RING 3 / 4 / 6 K steps by cp.async, at WAVES 1 / 2 / 4; measured negative in the
      engine on the H100), and writes DIR/tc_tuned.json with the fastest (a challenger only
      where it wins by more than 2 %; the file is rewritten after every entry).
  python scripts/tune_tc_gemv.py --static
      No GPU needed (run without TRITON_INTERPRET): compiles the linear, per-slot MoE and
      expert-grouped kernels for sm_90 and prints, as one JSON line, each main loop's SASS
      instruction count and mix and the widths of the kernel's global loads.

Times every candidate config (CUDA-graph replay over weight copies past L2, as
lowbit.bench.kernels) for the linear benchmark and engine shapes at each M, and for the
Qwen3-30B-A3B MoE layer (tc_moe_gemv, one config for FC1 and FC2) at each token count; writes
DIR/tc_tuned.json in the format of lowbit/kernels/configs/<device>.json ("tc_gemv",
"tc_moe": copy them there to ship them) and prints the best against the default.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tune_kernels (the SASS loop counter)

import torch  # noqa: E402

from lowbit.kernels import launch  # noqa: E402
from lowbit.kernels.samples import BENCH_LUT_FORMATS, BENCH_SHAPES, random_lut_view  # noqa: E402
from lowbit.kernels.weights import resolve  # noqa: E402

SHAPES = (*BENCH_SHAPES, (5120, 2048), (2048, 4096))  # + Qwen3-30B-A3B qkv, o_proj
CANDIDATES = [dict(BN=bn, BK=bk, num_warps=w, WAVES=wv, PREFETCH=pf)
              for (bn, w), bk, wv, pf in itertools.product(((64, 4), (128, 4), (128, 8)),
                                                          (128, 256, 512), (2, 4, 8), (True, False))
              if not (bk == 512 and bn == 128 and w == 4)]


def _time_best(fns_for, cands) -> tuple[float, dict, float | None]:
    """(best us, best config, the default config's us) over cands."""
    from lowbit.bench.kernels import timed
    from lowbit.kernels.tc_gemv import DEFAULT

    best, base = None, None
    for cfg in cands:
        try:
            t = timed(fns_for(cfg))["us"]
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if cfg == dict(DEFAULT, PREFETCH=True):
            base = t
        if best is None or t < best[0]:
            best = (t, cfg)
    return best[0], best[1], base


TYPES = {"x_ptr": "*bf16", "y_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*u8",
         "ab_ptr": "*fp32", "tidx_ptr": "*i32", "tw_ptr": "*fp32", "gpost": "fp32",
         "bias_ptr": "*bf16", "ws_ptr": "*fp32", "sem_ptr": "*i32", "ids_ptr": "*i32",
         "order_ptr": "*i32", "tile_end_ptr": "*i32", "seg_start_ptr": "*i32", "counts_ptr": "*i32",
         "need_ptr": "*i32", "out_ptr": "*bf16"}


def _static_one(kernel, consts: dict, types: dict, unaligned: tuple[str, ...] = ()) -> dict:
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from tune_kernels import _loop_stats, disassemble

    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in kernel.arg_names}
    aligned = [i for i, n in enumerate(kernel.arg_names)
               if (n.endswith("_ptr") or n.startswith("stride_") or n in ("K", "k_split"))
               and n not in unaligned]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts,
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": consts["W"], "launch_pdl": consts["PDL"]})
    res, sass = disassemble(compiled.asm["cubin"])
    n, ops = _loop_stats(sass)
    stack = re.search(r"STACK:(\d+)", res)
    ptx = compiled.asm["ptx"]
    head = ptx.split("griddepcontrol.wait")[0] if "griddepcontrol.wait" in ptx else ""
    return {"loop": n, "ops": dict(ops), "regs": int(re.search(r"REG:(\d+)", res).group(1)),
            "pdl_waits": ptx.count("griddepcontrol.wait"),
            "loads_before_wait": len(re.findall(r"ld\.global", head)),
            "async_before_wait": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", head)),
            "ldgsts": len(re.findall(r"LDGSTS", sass)),
            "stack": int(stack.group(1)) if stack else -1,
            "ldg128": len(re.findall(r"LDG\.E\.128", sass)),
            "ldg_u8": len(re.findall(r"LDG\.E\.U8", sass))}


def static() -> None:
    from lowbit.kernels import tc_gemv, tc_moe

    lin = dict(HAS_TIDX=True, HAS_BIAS=False, BN=64, BK=256, MB=8, W=4, SPLIT=True, PREFETCH=1, RING=0,
               PDL=True)
    grp = dict(EP=128, HAS_TIDX=True, BN=128, BK=256, MB=8, W=4, PREFETCH=1, PDL=True,
               FOLD=False, RING=0)
    out = {"linear": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=0), TYPES),
           "moe_fc1": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=1), TYPES),
           "moe_fc2": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=2),
                                  dict(TYPES, x_ptr="*fp32")),
           "linear_prefetch2": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=0, PREFETCH=2),
                                           TYPES),
           "moe_fc2_prefetch2": _static_one(tc_gemv._tc_gemv_kernel,
                                            dict(lin, MOE=2, PREFETCH=2), dict(TYPES, x_ptr="*fp32")),
           "linear_ring4": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=0, RING=4), TYPES),
           "moe_fc1_ring4": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=1, RING=4), TYPES),
           "moe_fc2_ring4": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=2, RING=4),
                                        dict(TYPES, x_ptr="*fp32")),
           "grouped_fc1": _static_one(tc_moe._tc_moe_grouped_kernel, dict(grp, FC=1), TYPES),
           "grouped_fc2": _static_one(tc_moe._tc_moe_grouped_kernel,
                                      dict(grp, FC=2, BN=64, FOLD=True), dict(TYPES, y_ptr="*fp32")),
           # K = 384: 24-byte scale rows, which the compiler knows only as multiples of 4
           "linear_ring3_k384": _static_one(tc_gemv._tc_gemv_kernel,
                                            dict(lin, MOE=0, RING=3, BK=128, HAS_BIAS=True),
                                            dict(TYPES, y_ptr="*fp32", bias_ptr="*fp32"),
                                            unaligned=("stride_sn", "stride_se", "stride_ym")),
           "grouped_fc1_ring4": _static_one(tc_moe._tc_moe_grouped_kernel, dict(grp, FC=1, RING=4),
                                            TYPES),
           "grouped_fc1_mb32": _static_one(tc_moe._tc_moe_grouped_kernel,
                                           dict(grp, FC=1, MB=32, BK=128), TYPES),
           # narrow programs (the A/B's bn16 challengers): one warp of 16 rows, no split
           "linear_bn16": _static_one(tc_gemv._tc_gemv_kernel,
                                      dict(lin, MOE=0, BN=16, W=1, SPLIT=False), TYPES),
           "moe_fc2_bn16": _static_one(tc_gemv._tc_gemv_kernel, dict(lin, MOE=2, BN=16, W=1),
                                       dict(TYPES, x_ptr="*fp32"))}
    print(json.dumps(out))


RINGS, RING_WAVES = (3, 4, 6), (1, 2, 4)
NARROW = ((16, 1), (32, 2))  # (BN, warps) of the narrow challengers


def _variants(cfg: dict, grouped: bool = False, ring: bool = False) -> dict[str, dict]:
    """The A/B's challengers of a shipped config: two K steps in registers (PREFETCH 2), the
    split-K width at WAVES 1 and at twice the shipped WAVES (not for the expert-grouped
    kernel, which does not split K), narrow programs (BN 16 on one warp, BN 32 on two, at
    WAVES 1 and the shipped WAVES, PREFETCH 1 and 2: a program's split-K chain of partial
    store, counter and reload goes where the narrow grid needs no split), and with `ring`
    the shared-memory ring (RING r) at a few split widths (fewer splits give each program
    more steps to keep in flight).
    The ring is off by default: on the H100 it lost at M = 1 and in every MoE schedule, and
    the two M = 8 wins it had alone made the engine's x8 decode 4 % slower
    (docs/BENCHMARKS.md "H100 call at 803f65c")."""
    out = {"prefetch2": dict(cfg, PREFETCH=2)}
    if not grouped:  # split-K width: one program per tile (no partials), and twice the splits
        out.update({f"waves{w}": dict(cfg, WAVES=w) for w in (1, 2 * cfg.get("WAVES", 4))
                    if w != cfg.get("WAVES", 4)})
        # narrow programs: one warp of 16 rows (two of 32), so that the grid fills the SMs
        # with fewer K splits or none; WAVES 1 gives no split at the engine's C1 shapes
        for bn, w in NARROW:
            for wv, pf in itertools.product((1, cfg.get("WAVES", 4)), (1, 2)):
                out[f"bn{bn}_w{wv}_pf{pf}"] = dict(cfg, BN=bn, num_warps=w, WAVES=wv, PREFETCH=pf)
    for r in RINGS if ring else ():
        if grouped:
            out[f"ring{r}"] = dict(cfg, RING=r)
        else:
            out.update({f"ring{r}_w{w}": dict(cfg, RING=r, WAVES=w) for w in RING_WAVES})
    return out


def _ab(fns_for, cfg: dict, grouped: bool = False, ring: bool = False) -> tuple[dict, float, dict]:
    """(the kept config, us with it as shipped, us of each challenger): a challenger replaces
    the shipped config only where its output matches the shipped config's and it wins by
    more than 2 %."""
    from lowbit.bench.kernels import timed

    base = timed(fns_for(cfg))["us"]
    ref = fns_for(cfg)[0]().float()
    times, kept, best = {}, cfg, 0.98 * base
    for name, c in _variants(cfg, grouped, ring).items():
        try:
            got = fns_for(c)[0]().float()
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err < 1e-2:  # bf16 outputs of the same products, summed in another order
                print(f"  skip {name}: rel err {err:.2e} against the shipped config", flush=True)
                continue
            times[name] = t = timed(fns_for(c))["us"]
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (shared memory)
            print(f"  skip {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if t < best:
            kept, best = c, t
    return kept, base, times


def _ab_line(label: str, base: float, times: dict, kept: dict) -> str:
    best = min(times, key=times.get) if times else "-"
    return (f"{label}: {base:.1f} us shipped; " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
            + f"; best {best}; kept {kept}")


def _shapes(a) -> list[tuple[int, int]]:
    """--shapes N1xK1,N2xK2 (default: SHAPES)."""
    if not a.shapes:
        return list(SHAPES)
    return [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]


def shipped_table(kernel: str, key: str) -> dict:
    """A copy of this device's config entry (its own file, else the one it borrows)."""
    return json.loads(json.dumps(launch._device(None).get(kernel, {}).get(key, {})))


def prefetch_ab(a) -> None:
    from lowbit.bench.kernels import copies_for, payload_bytes
    from lowbit.kernels.tc_gemv import DEFAULT, tc_gemv
    from lowbit.kernels.tc_moe import GROUPED, tc_moe_gemv, tc_moe_grouped

    dev = "cuda"
    kw = BENCH_LUT_FORMATS["nvfp4"]
    out = {"device": torch.cuda.get_device_name(0), "tc_gemv": {}, "tc_moe": {}, "ab": []}
    path = Path(a.out) / "tc_tuned.json"

    def save() -> None:  # after every entry: a call stopped by its time cap keeps what it measured
        path.write_text(json.dumps(out, indent=1))

    for n, k in _shapes(a):
        w0 = resolve(random_lut_view(n, k, device=dev, **kw))
        ws = [w0] + [resolve(random_lut_view(n, k, device=dev, seed=i, **kw))
                     for i in range(1, copies_for(payload_bytes(w0)))]
        # the shipped entry whole (merge_tuned replaces a shape's entry), then the A/B's picks
        table = out["tc_gemv"].setdefault(f"nvfp4:{n}x{k}", shipped_table("tc_gemv", f"nvfp4:{n}x{k}"))
        for m in (int(v) for v in a.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cfg0 = dict(DEFAULT, **launch.lookup("tc_gemv", "nvfp4", n, k, m))
            kept, base, times = _ab(lambda c, x=x, ws=ws: [functools.partial(tc_gemv, x, w, config=c)
                                                           for w in ws], cfg0, ring=a.ring)
            table[str(m)] = kept
            out["ab"].append({"kernel": "tc_gemv", "shape": f"{n}x{k}", "m": m, "config": cfg0,
                              "us": base, "us_variants": times, "kept": kept})
            print(_ab_line(f"tc_gemv {n}x{k} M={m}", base, times, kept), flush=True)
            save()
    e, top, h, inter = 128, 8, 2048, 768
    w13 = resolve(random_lut_view(2 * inter, h, lead=(e,), device=dev, **kw))
    w2 = resolve(random_lut_view(h, inter, lead=(e,), device=dev, seed=1, **kw))
    table = out["tc_moe"].setdefault(f"nvfp4:{e}x{h}", shipped_table("tc_moe", f"nvfp4:{e}x{h}"))
    for t_ in (int(v) for v in a.moe_t.split(",")):
        g = torch.Generator(device=dev).manual_seed(t_)
        batches = [(torch.randn(t_, h, device=dev, dtype=torch.bfloat16),
                    torch.rand(t_, e, device=dev, generator=g).topk(top, -1).indices.to(torch.int32),
                    torch.rand(t_, top, device=dev, generator=g)) for _ in range(8)]
        shipped = launch.lookup("tc_moe", "nvfp4", e, h, t_)
        if "fc1" not in shipped:  # this token count runs the grouped schedule
            continue
        fc1, fc2 = dict(DEFAULT, **shipped["fc1"]), dict(DEFAULT, **shipped["fc2"])
        res = {}
        for which in ("fc1", "fc2"):
            def fns(c, which=which, bs=batches, fc1=fc1, fc2=fc2):
                pair = dict(fc1=c if which == "fc1" else fc1, fc2=c if which == "fc2" else fc2)
                return [functools.partial(tc_moe_gemv, *b, w13, w2, config=pair) for b in bs]
            res[which] = _ab(fns, fc1 if which == "fc1" else fc2, ring=a.ring)
        table[str(t_)] = dict(shipped, fc1=res["fc1"][0], fc2=res["fc2"][0])
        for which, (kept, base, times) in res.items():
            out["ab"].append({"kernel": f"tc_moe {which}", "shape": f"{e}x{h}", "m": t_,
                              "us": base, "us_variants": times, "kept": kept})
            print(_ab_line(f"tc_moe T={t_} {which} changed", base, times, kept), flush=True)
            save()
    for t_ in (int(v) for v in a.grouped_t.split(",") if v):
        shipped = launch.lookup("tc_moe", "nvfp4", e, h, t_)
        if t_ < shipped.get("GROUPED_FROM", 1 << 30):
            continue
        g = torch.Generator(device=dev).manual_seed(t_)
        batches = [(torch.randn(t_, h, device=dev, dtype=torch.bfloat16),
                    torch.rand(t_, e, device=dev, generator=g).topk(top, -1).indices.to(torch.int32),
                    torch.rand(t_, top, device=dev, generator=g)) for _ in range(8)]
        cfg0 = dict(GROUPED, **shipped.get("grouped", {}))
        kept, base, times = _ab(lambda c, bs=batches: [functools.partial(tc_moe_grouped, *b, w13, w2, config=c)
                                                       for b in bs], cfg0, grouped=True, ring=a.ring)
        table[str(t_)] = dict(shipped, grouped=kept)
        out["ab"].append({"kernel": "tc_moe grouped", "shape": f"{e}x{h}", "m": t_, "config": cfg0,
                          "us": base, "us_variants": times, "kept": kept})
        print(_ab_line(f"tc_moe grouped T={t_}", base, times, kept), flush=True)
        save()
    save()
    print("->", path)


def main() -> None:
    from lowbit.bench.kernels import copies_for, payload_bytes
    from lowbit.kernels.tc_gemv import tc_gemv
    from lowbit.kernels.tc_moe import tc_moe_gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--m", default="1,4,8,16")
    ap.add_argument("--moe-t", default="1,4,16,32")
    ap.add_argument("--shapes", default="", help="linear shapes NxK,... (default: the bench and engine shapes)")
    ap.add_argument("--grouped-t", default="16,32,64", help="--prefetch-ab: expert-grouped token counts")
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--prefetch-ab", action="store_true")
    ap.add_argument("--ring", action="store_true",
                    help="--prefetch-ab: the shared-memory ring's configs among the challengers too")
    a = ap.parse_args()
    if a.static:
        static()
        return
    if a.prefetch_ab:
        prefetch_ab(a)
        return
    dev = "cuda"
    kw = BENCH_LUT_FORMATS["nvfp4"]
    out = {"device": torch.cuda.get_device_name(0), "tc_gemv": {}, "tc_moe": {}}
    for n, k in _shapes(a):
        w0 = resolve(random_lut_view(n, k, device=dev, **kw))
        ws = [w0] + [resolve(random_lut_view(n, k, device=dev, seed=i, **kw))
                     for i in range(1, copies_for(payload_bytes(w0)))]
        table = out["tc_gemv"].setdefault(f"nvfp4:{n}x{k}", {})
        for m in (int(v) for v in a.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t, cfg, base = _time_best(
                lambda cfg, x=x, ws=ws: [functools.partial(tc_gemv, x, w, config=cfg) for w in ws],
                CANDIDATES)
            table[str(m)] = cfg
            print(f"tc_gemv {n}x{k} M={m}: best {t:.1f} us {cfg} (default {base} us)", flush=True)
    e, top, h, inter = 128, 8, 2048, 768
    w13 = resolve(random_lut_view(2 * inter, h, lead=(e,), device=dev, **kw))
    w2 = resolve(random_lut_view(h, inter, lead=(e,), device=dev, seed=1, **kw))
    table = out["tc_moe"].setdefault(f"nvfp4:{e}x{h}", {})
    for t_ in (int(v) for v in a.moe_t.split(",")):
        g = torch.Generator(device=dev).manual_seed(t_)
        batches = [(torch.randn(t_, h, device=dev, dtype=torch.bfloat16),
                    torch.rand(t_, e, device=dev, generator=g).topk(top, -1).indices.to(torch.int32),
                    torch.rand(t_, top, device=dev, generator=g)) for _ in range(8)]
        t, cfg, base = _time_best(
            lambda cfg, bs=batches: [functools.partial(tc_moe_gemv, *b, w13, w2,
                                                       config=dict(fc1=cfg, fc2=cfg)) for b in bs],
            CANDIDATES)
        table[str(t_)] = dict(fc1=cfg, fc2=cfg)
        print(f"tc_moe qwen3-30b-a3b T={t_}: best {t:.1f} us {cfg} (default {base} us)", flush=True)
    path = Path(a.out) / "tc_tuned.json"
    path.write_text(json.dumps(out, indent=1))
    print("->", path, "(launch configs:", launch.slug(out["device"]) + ".json)")


if __name__ == "__main__":
    main()
