"""The `lowbit` command: one parser, subcommands calling into the packages."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lowbit import LLM, SamplingParams, kernels
from lowbit.bench.commands import add_subcommands
from lowbit.bench.eval import add_eval_args, main_eval
from lowbit.checkpoint.artifact import bytes_by_format
from lowbit.checkpoint.hf import CheckpointReader, resolve_model_dir
from lowbit.checkpoint.loader import allocate_empty
from lowbit.checkpoint.quant_plan import planned_size
from lowbit.config import EngineConfig
from lowbit.distributed import engine_model
from lowbit.distributed.launcher import run_parallel, world_size
from lowbit.errors import LowbitError
from lowbit.formats import FORMATS
from lowbit.kernels.routes import check_env
from lowbit.models import param_counts
from lowbit.models.config import load_config
from lowbit.quantize.export import DEFAULT_FORMATS, quantize_model, summary_table
from lowbit.quantize.tune import LR_CODES as TUNE_CODES_LR
from lowbit.quantize.tune import SCHEDULES as TUNE_SCHEDULES
from lowbit.quantize.tune import TOPK as TUNE_TOPK


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def cmd_generate(args: argparse.Namespace) -> int:
    if world_size(args) > 1:  # one process per GPU; this one is rank 0 (docs/DISTRIBUTED.md)
        return run_parallel(generate, args)
    return generate(args)


def sampling_defaults(args: argparse.Namespace, gen: dict) -> dict:
    """Flags the user gave win; the rest come from the model's generation_config.json
    (its sampling settings when do_sample is true), else greedy."""
    sample = bool(gen.get("do_sample"))
    base = {"temperature": gen.get("temperature", 1.0) if sample else 0.0,
            "top_p": gen.get("top_p", 1.0) if sample else 1.0,
            "top_k": gen.get("top_k", -1) if sample else -1}
    return {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.items()}


def generate(args: argparse.Namespace) -> int:
    cfg = EngineConfig.from_cli(args)
    llm = LLM(**cfg.llm_kwargs(), loaded=engine_model(cfg))
    sp = SamplingParams(**sampling_defaults(args, llm.loaded.generation_config),
                        min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                        stop=args.stop or [], ignore_eos=args.ignore_eos)
    if llm.tokenizer is None:  # random weights and no --tokenizer: the prompt's bytes are the ids
        ids = [b % llm.config.vocab_size for b in args.prompt.encode()]
        out = llm.generate([ids], sp)[0]
        print(f"token ids: {out.outputs[0].token_ids}")
    elif args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp)
        print(out.outputs[0].text)
    else:
        out = llm.generate(args.prompt, sp)[0]
        print(args.prompt + out.outputs[0].text)
    m = out.metrics
    print(
        f"\n[{m['output_tokens']} tokens, prompt {m['prompt_tokens']} | prefill {m['prefill_s'] * 1e3:.0f} ms | "
        f"decode {m['decode_tok_s']:.1f} tok/s | weights {llm.loaded.weight_format} | "
        f"device {llm.device} | finish {out.outputs[0].finish_reason}]",
        file=sys.stderr,
    )
    cache = llm.engine.expert_cache
    if cache is not None and cache.offload:
        print(f"[{cache.summary(m['output_tokens'])}]", file=sys.stderr)
    spec = llm.engine.spec
    if spec is not None:
        st = spec.stats
        k = spec.k if spec.adapt is None else f"auto<={spec.k} {spec.adapt.current() or '(warming up)'}"
        print(f"[speculative {spec.method} k={k}: accepted length {st.mean_accepted_length:.2f}, accept rate "
              f"per position {' '.join(f'{a:.2f}' for a in st.accept_rate_per_position) or '-'}]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.random_weights or args.config:
        cfg = load_config(args.config or args.model)
        path = None
    else:
        path = resolve_model_dir(args.model)
        cfg = load_config(path)
    total, active = param_counts(cfg)
    print(f"architecture     {cfg.model_type} ({cfg.raw.get('architectures', ['?'])[0]})")
    print(f"layers           {cfg.num_layers}, hidden {cfg.hidden_size}, heads {cfg.num_heads}:{cfg.num_kv_heads}, vocab {cfg.vocab_size}")
    if cfg.is_moe:
        print(f"experts          {cfg.num_experts} (top-{cfg.num_experts_per_tok}), width {cfg.moe_intermediate_size}, "
              f"shared {cfg.num_shared_experts}, MoE layers {sum(cfg.moe_layers)}")
    print(f"parameters       {_fmt_count(total)} total, {_fmt_count(active)} active per token")
    if path is not None and (path / "lowbit.json").exists():
        for fmt, (n, b) in sorted(bytes_by_format(path).items()):
            print(f"bytes {fmt:<10} {b / 2**20:.1f} MiB ({_fmt_count(n)} weights, {8 * b / max(n, 1):.2f} bits/weight)")
    elif path is not None:
        reader = CheckpointReader(path)
        by_dtype: dict[str, list[int]] = {}
        for name in reader.names():
            t = reader.get(name)
            e = by_dtype.setdefault(str(t.dtype).replace("torch.", ""), [0, 0])
            e[0] += t.numel()
            e[1] += t.numel() * t.element_size()
        for dt, (n, b) in sorted(by_dtype.items()):
            print(f"bytes {dt:<10} {b / 2**20:.1f} MiB ({_fmt_count(n)} elements)")
    if path is None or not (path / "lowbit.json").exists():
        _print_planned_sizes(cfg)
    return 0


def _print_planned_sizes(cfg) -> None:
    """Bytes per format if quantized on load (shapes only: the model is built on meta)."""
    model = allocate_empty(cfg, torch.bfloat16, "cpu")
    print("quantized on load (--quantization F; embeddings, router gates, norms, lm_head stay bf16):")
    print(f"  {'format':<10} {'total':>11}  {'bits/weight':>11}  quantized weights")
    every = sum(p.numel() for p in model.parameters())
    print(f"  {'bf16':<10} {_fmt_bytes(2 * every):>11}  {16:>11.2f}  none")
    for name in FORMATS:
        s = planned_size(model, name)
        print(f"  {name:<10} {_fmt_bytes(s['total_bytes']):>11}  {s['bits_per_weight']:>11.2f}  "
              f"{_fmt_count(s['quantized_weights'])} of {_fmt_count(s['quantized_weights'] + s['dense_weights'])}")


def _fmt_bytes(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def cmd_quantize(args: argparse.Namespace) -> int:
    manifest = quantize_model(args.model, args.format, args.out, quantize_lm_head=args.quantize_lm_head,
                              max_shard_size=args.max_shard_size, device=args.device, dtype=args.dtype,
                              calib=args.calib, damp=args.damp, bpw=args.bpw, formats=args.formats,
                              sensitivity=args.sensitivity, sensitivity_from=args.sensitivity_from,
                              tune_steps=args.tune_scales, tune_text=args.tune_text,
                              tune_tokens=args.tune_tokens, tune_norms=args.tune_norms,
                              tune_topk=args.tune_teacher_topk, tune_codes=args.tune_codes,
                              sequential=args.sequential, tune_schedule=args.tune_schedule,
                              expert_pairs=args.expert_pairs)
    print(summary_table(manifest))
    print(f"wrote {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    return main_eval(args)


def cmd_routes(args: argparse.Namespace) -> int:
    check_env()  # the table below would otherwise hide a misspelt LOWBIT_ROUTE_* variable
    if args.run:  # generate a few tokens first, so the counts say which routes served a model
        llm = LLM(args.run, device=args.device)
        llm.generate([list(range(1, 9))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    if args.json:
        print(json.dumps({"routes": kernels.route_table(), **kernels.counters()}, indent=1))
        return 0
    print(kernels.format_table())
    refusals: dict = {}
    for r in kernels.counters()["route_refusals"]:  # summed over layers, layers counted
        key = (r["op"], r["route"], r["reason"])
        n, layers = refusals.get(key, (0, set()))
        refusals[key] = (n + r["count"], layers | {r["layer"]})
    if refusals:
        print("\nrefusals (op, route: reason x count, in how many layers)")
        for (op, route, reason), (n, layers) in refusals.items():
            print(f"  {op}, {route}: {reason} x{n} in {len(layers)} layer(s)")
    print("\nForce a route with LOWBIT_ROUTE_<OP>=<route>; docs/ROUTES.md explains each status.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit", description="Run quantized MoE language models.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="load a model, generate, print text and speed")
    g.add_argument("model", help="HF model directory or built-in name (demo)")
    g.add_argument("prompt")
    EngineConfig.add_cli_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config.json, else 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--quiet-stats", action="store_true", help="no effect: the speed line always goes to stderr")
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("routes", help="kernel routes: status, the record it cites, calls, refusals")
    r.add_argument("--run", metavar="MODEL", default=None, help="generate a few tokens on MODEL first")
    r.add_argument("--device", default=None)
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_routes)

    i = sub.add_parser("info", help="architecture, parameter counts, bytes per format")
    i.add_argument("model")
    i.add_argument("--config", default=None)
    i.add_argument("--random-weights", action="store_true")
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("quantize", help="write a quantized artifact (safetensors + lowbit.json)")
    q.add_argument("model", help="HF model directory or built-in name (demo)")
    q.add_argument("--format", default=None, help="weight format (nvfp4, mxfp4, fp8, int4, nf4, lut4, ...)")
    q.add_argument("--bpw", type=float, default=None, metavar="B",
                   help="instead of --format: a format per weight so that the quantized weights store at "
                        "most B bits per weight (scales included)")
    q.add_argument("--formats", default=None, metavar="F1,F2,...",
                   help=f"with --bpw: the candidate formats (default {DEFAULT_FORMATS})")
    q.add_argument("--sensitivity", default=None, choices=["kl", "proxy"],
                   help="with --bpw: score candidates by the measured KL increase on calibration tokens "
                        "(kl, the default with --calib) or by the Hessian-weighted rounding error (proxy)")
    q.add_argument("--sensitivity-from", default=None, metavar="ARTIFACT",
                   help="with --bpw: reuse the candidate scores of an earlier --bpw artifact of the same model, "
                        "--calib and --damp instead of scoring again")
    q.add_argument("--expert-pairs", default=None, choices=["family", "free"],
                   help="with --bpw: a layer's two expert stacks both vector-codebook formats or neither, so that "
                        "the GPU MoE routes take every layer (family, the default), or each chosen alone (free: "
                        "mixed layers run the torch MoE route on a GPU)")
    q.add_argument("--out", required=True, help="artifact directory to create")
    q.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (kept dense by default)")
    q.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (e.g. 2GB, 500MB)")
    q.add_argument("--device", default=None, help="where weights are encoded (default: cuda when present)")
    q.add_argument("--dtype", default="bfloat16", help="dtype of the weights kept dense")
    q.add_argument("--calib", default=None, metavar="FILE",
                   help="UTF-8 text to calibrate on: GPTQ rounding with each weight's input Hessian "
                        "(scalar formats; the demo model ships lowbit/demo_model/calibration.txt)")
    q.add_argument("--damp", type=float, default=0.01,
                   help="with --calib: Hessian damping, as a fraction of its mean diagonal")
    q.add_argument("--sequential", action="store_true",
                   help="with --calib: round layer by layer, each decoder layer on the Hessians of the model "
                        "whose earlier layers are already rounded (default: all from the dense model)")
    q.add_argument("--tune-scales", type=int, default=0, metavar="STEPS",
                   help="with --calib: after rounding, tune the block scales of nf/lut/vq weights for STEPS "
                        "steps against the unquantized model's next-token distributions (same bytes)")
    q.add_argument("--tune-text", default=None, metavar="FILE",
                   help="with --tune-scales: the UTF-8 text to tune on (default: the --calib text)")
    q.add_argument("--tune-tokens", type=int, default=65536, metavar="N",
                   help="with --tune-scales: tune on at most N tokens of the text, windows spread evenly over it")
    q.add_argument("--tune-teacher-topk", type=int, default=None, metavar="K",
                   help=f"with --tune-scales: keep the teacher's K most likely tokens per position and "
                        f"the rest's mass (default {TUNE_TOPK}; 0: the whole distribution, 4 * vocab bytes a token)")
    q.add_argument("--tune-norms", action="store_true",
                   help="with --tune-scales: tune the RMSNorm weights (kept dense, not in --bpw) with the scales")
    q.add_argument("--tune-codes", type=float, nargs="?", const=TUNE_CODES_LR, default=0.0, metavar="RATE",
                   help="with --tune-scales: move the codes too (latent weights, straight-through; same format "
                        f"and bytes); RATE is Adam's step on them (default {TUNE_CODES_LR})")
    q.add_argument("--tune-schedule", choices=TUNE_SCHEDULES, default="constant",
                   help="with --tune-scales: the Adam rates through the steps, fixed (constant) or a half cosine "
                        "from the rate down to 0 at the last step (cosine)")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="quality against a teacher: perplexity, KL, top-1 agreement")
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)
    _add_bench(sub)
    _add_serve(sub)
    return p


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: latency, serve, fingerprint, ab, report, kernels")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    add_subcommands(bsub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (port 8000)")
    s.add_argument("model", help="HF model directory or built-in name (demo)")
    EngineConfig.add_cli_args(s, server=True)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if world_size(args) > 1:  # rank 0 serves, the other ranks follow its model (docs/DISTRIBUTED.md)
        return run_parallel(serve, args)
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    # imported here: fastapi and uvicorn are the optional `serve` extra (and cost 0.6 s to import)
    from lowbit.server.launch import run_server

    return run_server(EngineConfig.from_cli(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LowbitError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
