"""Argument parsing and entry points of `lowbit bench <latency|serve|fingerprint|ab|report>`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from lowbit.bench import ab, expert_cache, kernels, latency, spec
from lowbit.bench import fingerprint as fp
from lowbit.bench.record import append_md, csv_text, environment, md_table, write_record
from lowbit.bench.report import make_report
from lowbit.config import EngineConfig
from lowbit.errors import LowbitError


def int_list(text: str) -> list[int]:
    """'0,32768' or '0,32k' -> [0, 32768]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part.removesuffix("k")) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return out


def _record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", default="bench/records", help="folder for the JSON record")
    p.add_argument("--append-md", default=None, metavar="FILE",
                   help="append a Markdown section to FILE (e.g. docs/BENCHMARKS.md)")


def _save(rec: dict, args: argparse.Namespace, title: str, body: str, label: str = "") -> None:
    rec.setdefault("env", environment(rec.get("device")))
    path = write_record(rec, args.records, label)
    print(f"record: {path}", file=sys.stderr)
    if args.append_md:
        append_md(args.append_md, title, body, rec["env"])


def _emit(fmt: str, headers: list[str], rows: list[list], md: str, rec: dict) -> None:
    if fmt == "json":
        print(json.dumps(rec, indent=1, default=str))
    elif fmt == "csv":
        print(csv_text(headers, rows), end="")
    else:
        print(md)


def cmd_latency(args: argparse.Namespace) -> int:
    cfg = EngineConfig.from_cli(args)
    if args.spec or cfg.speculative_method:
        if args.variant:
            raise LowbitError("--variant times the plain cells; run --spec without it")
        if args.temperature:
            raise LowbitError("--temperature samples the plain tg cells; --spec compares greedy tokens "
                              "with and without drafts, so drop one of them")
        return cmd_latency_spec(args, cfg)
    if args.spec_synthetic_accept is not None:
        raise LowbitError("--spec-synthetic-accept forces the acceptance of speculative decoding; add --spec METHOD")
    depths = args.depth if args.depth is not None else [0, 32768]
    if not args.temperature >= 0:
        raise LowbitError(f"--temperature must be >= 0, got {args.temperature}")
    if cfg.expert_offload and cfg.random_weights and args.temperature == 0:
        print("warning: greedy decoding of random weights repeats a few tokens, so each step routes to "
              "nearly the experts of the step before and the expert cache hits far more often than with "
              "a real model; add --temperature 1 (and --router-zipf S for skewed expert popularity)",
              file=sys.stderr)
    variants = [latency.Variant.parse(v) for v in args.variant or []]
    rec = latency.measure(cfg, args.prompt, args.gen, depths, args.repeats, fit_depths=args.depth is None,
                          batches=tuple(args.batch), temperature=args.temperature, variants=variants)
    rec["env"] = environment(rec["device"])
    md = latency.summary_md(rec)
    _emit(args.output, latency.HEADERS, latency.table_rows(rec), md, rec)
    _save(rec, args, f"bench latency: {latency.table_rows(rec)[0][0]} {rec['weight_format']}", md,
          f"{rec['device']}")
    return 0


def cmd_latency_spec(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """tg cells with and without speculative decoding (lowbit.bench.spec)."""
    cfg.speculative_method = args.spec or cfg.speculative_method
    cfg.speculative_synthetic_accept = args.spec_synthetic_accept
    cfg.validate()
    if cfg.speculative_synthetic_accept is not None:
        print(f"warning: synthetic acceptance {cfg.speculative_synthetic_accept:g}: drafts are accepted at "
              "random whatever the model says, so the speculative arm's tokens are not the model's output "
              "and are not compared; only its speed means something", file=sys.stderr)
    rec = spec.measure(cfg, args.gen, args.repeats)
    rec["env"] = environment(rec["device"])
    md = spec.summary_md(rec)
    _emit(args.output, spec.HEADERS, spec.table_rows(rec), md, rec)
    _save(rec, args, f"bench latency --spec {rec['method']}: {spec.table_rows(rec)[0][0]} {rec['weight_format']}",
          md, f"{rec['device']}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # imported here: httpx (which bench.serve's client uses) is the optional `serve` extra
    import httpx

    from lowbit.bench import serve

    cfg = serve.LoadConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        concurrency=tuple(args.concurrency), context=tuple(args.context), num_prompts=args.num_prompts,
        prompts_per_slot=args.prompts_per_slot, input_len=args.input_len, output_len=args.output_len,
        payload=args.payload, ignore_eos=args.ignore_eos, api_key=args.api_key, seed=args.seed,
        warmup=args.warmup, timeout=args.timeout, time_limit=args.time_limit)
    try:
        rec = asyncio.run(serve.run_load(cfg, log=print))
    except (httpx.TransportError, httpx.HTTPStatusError) as e:
        raise LowbitError(f"cannot reach {args.base_url}: {e}; is the server running?") from e
    if args.label:
        rec["label"] = args.label
    md = md_table(serve.SUMMARY_HEADERS, serve.summary_rows(rec)) + "\n\n" + serve.startup_line(rec)
    print("\n" + md)
    rec["env"] = environment("cpu")
    rec["env"]["device"] = f"server at {rec['base_url']}; client {rec['env']['device']}"
    _save(rec, args, f"bench serve: {rec['model']} at {rec['base_url']}",
          md + f"\n\n{cfg.input_len} input / {cfg.output_len} output tokens, {rec['prompt_mode']} prompts, "
          f"payload {cfg.payload}", rec["model"])
    failed = sum(lv["summary"]["failed"] for lv in rec["levels"])
    return 1 if failed and not any(lv["summary"]["completed"] for lv in rec["levels"]) else 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    cfg = EngineConfig.from_cli(args)
    if args.format in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
        cfg.dtype = args.format
    elif args.format:
        if not hasattr(cfg, "quantization"):
            raise LowbitError(f"--format {args.format}: this build has no load-time quantization; "
                              "fingerprint a quantized artifact directory instead")
        cfg.quantization = args.format
    rec = fp.fingerprint(cfg, args.max_tokens, args.long_len, args.format)
    for name, p in rec["prompts"].items():
        print(f"{name:<10} {p['sha256']}  ({p['prompt_tokens']} prompt tokens, {len(p['tokens'])} generated)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(fp.stored_text(rec))
        print(f"wrote {args.out}")
    rc = 0
    if args.check:
        problems = fp.compare(rec, args.check)
        rec["check"] = {"file": args.check, "problems": problems}
        print("\n".join(problems) if problems else f"all fingerprints match {args.check}")
        rc = 1 if problems else 0
    _save(rec, args, f"bench fingerprint: {rec['model']} {rec['format']}",
          "\n".join(f"- {n}: `{p['sha256'][:16]}`" for n, p in rec["prompts"].items()))
    return rc


def cmd_ab(args: argparse.Namespace) -> int:
    rec = ab.run_ab(args.cmd_a, args.cmd_b, args.rounds, args.metric or ab.DEFAULT_METRIC, args.timeout)
    text = ab.format_report(rec)
    print(text)
    _save(rec, args, "bench ab", text)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    make_report(args.records, args.out)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    sys.argv = ["lowbit bench kernels", *args.args]
    kernels.main()
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register kernels (the roofline benchmark, which parses its own flags), latency,
    serve, fingerprint, ab and report under `lowbit bench`."""
    k = sub.add_parser("kernels", help="kernel roofline: ceilings, peers, our routes (GPU)", add_help=False,
                       prefix_chars="\x00")  # every flag passes through to its own parser
    k.add_argument("args", nargs=argparse.REMAINDER, help="flags of python -m lowbit.bench.kernels")
    k.set_defaults(func=cmd_kernels)
    p = sub.add_parser("latency", help="llama-bench style pp/tg cells at depths, with MBU")
    p.add_argument("model", nargs="?", default="demo", help="model directory or built-in name")
    EngineConfig.add_cli_args(p)
    p.add_argument("-p", "--prompt", type=int_list, default=[512], help="prompt lengths (pp cells)")
    p.add_argument("-n", "--gen", type=int_list, default=[128], help="generated lengths (tg cells)")
    p.add_argument("-d", "--depth", type=int_list, default=None,
                   help="retained depths; default 0,32768 (those that fit the context)")
    p.add_argument("-b", "--batch", type=int_list, default=[1],
                   help="tg cells at depth 0: sequences decoding together (aggregate tok/s)")
    p.add_argument("-r", "--repeats", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the generated tokens at this temperature (default 0: greedy); with random "
                        "weights, 1 keeps the routing from settling on a few repeated tokens")
    p.add_argument("--spec", choices=("ngram", "draft", "mtp"), default=None,
                   help="tg cells with this speculative method against the same run without it "
                        "(with --num-speculative-tokens, --speculative-model)")
    p.add_argument("--spec-synthetic-accept", type=float, default=None, metavar="P",
                   help="with --spec: SYNTHETIC, accept each draft with probability P (given the ones "
                        "before it were), whatever the model says, every step carrying k drafts; for "
                        "random weights, whose real acceptance means nothing; tokens are not compared")
    p.add_argument("--variant", action="append", default=None, metavar="LABEL=OP:ROUTE[,...]",
                   help="also time every cell with these routes as their op's first choice (OP:ROUTE: DEFAULT, "
                        "the DEFAULT routes ahead of it set aside) or "
                        f"these switches ({', '.join(f'{k}:VALUE' for k in latency.VARIANT_ENV)}), "
                        "in the same process, each repeat interleaved with the base run's; "
                        "repeatable, one model load for an A/B of routes")
    p.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md")
    _record_args(p)
    p.set_defaults(func=cmd_latency)

    s = sub.add_parser("serve", help="streaming load on an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    s.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    s.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16, 32])
    s.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: "
                   "--prompts-per-slot x concurrency)")
    s.add_argument("--prompts-per-slot", type=int, default=4)
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--context", type=int_list, default=[0], help="retained-context prefix lengths")
    s.add_argument("--payload", choices=("deterministic", "stochastic"), default="deterministic")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--api-key", default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up rounds before each context (each: one round per concurrency level)")
    s.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds")
    s.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run; no request starts after it, later levels are skipped")
    s.add_argument("--label", default=None,
                   help="what the plots and tables call this server (default: the model name)")
    _record_args(s)
    s.set_defaults(func=cmd_serve)

    f = sub.add_parser("fingerprint", help="sha256 of greedy outputs for a fixed prompt set")
    f.add_argument("model", nargs="?", default="demo")
    EngineConfig.add_cli_args(f)
    f.add_argument("--format", default=None, help="bf16 / fp16 / fp32, or a weight format to load into")
    f.add_argument("--max-tokens", type=int, default=32)
    f.add_argument("--long-len", type=int, default=1536, help="tokens of the long-context prompt (cut to fit)")
    f.add_argument("--out", default=None, help="write the fingerprint file here")
    f.add_argument("--check", default=None, metavar="FILE", help="compare with a stored fingerprint file")
    _record_args(f)
    f.set_defaults(func=cmd_fingerprint)

    a = sub.add_parser("ab", help="interleaved A/B of two shell commands")
    a.add_argument("cmd_a")
    a.add_argument("cmd_b")
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--metric", default=None, help="regex; its first group (or match) is the number "
                   "(default: the last 'X tok/s')")
    a.add_argument("--timeout", type=float, default=None, help="seconds per command run")
    _record_args(a)
    a.set_defaults(func=cmd_ab)

    x = sub.add_parser("expert-cache", help="replay a routing trace through expert cache policies (no GPU)")
    expert_cache.add_args(x)
    x.set_defaults(func=expert_cache.main)

    r = sub.add_parser("report", help="PNG plots from bench records")
    r.add_argument("--records", default="bench/records")
    r.add_argument("--out", default="docs/img")
    r.set_defaults(func=cmd_report)
