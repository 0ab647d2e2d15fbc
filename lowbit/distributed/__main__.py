"""`python -m lowbit.distributed <lowbit command> ... --tensor-parallel-size N`: run a
command that drives one engine (`generate`, `bench latency`) on rank 0 of a TP x EP world,
one process per GPU (lowbit.distributed.launcher)."""

from __future__ import annotations

import sys

from lowbit.cli import build_parser
from lowbit.distributed.launcher import run_parallel, world_size
from lowbit.errors import LowbitError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_parallel(args.func, args) if world_size(args) > 1 else args.func(args)
    except LowbitError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
