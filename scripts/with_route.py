"""Run a lowbit command with chosen routes switched on in-process.

  python scripts/with_route.py OP ROUTE [OP ROUTE ...] -- lowbit-args...
  e.g. python scripts/with_route.py linear torch_scaled_mm -- eval demo --quantization fp8 ...

Unlike LOWBIT_ROUTE_<OP>=ROUTE, which forces the route on every call and fails on the calls
it refuses (the dense lm_head for a quantized-weight route), this makes the route the op's
first choice (`Op.prefer`: DEFAULT status, the DEFAULT routes ahead of it set aside): calls
it admits take it, the others keep their routes.
For quality records of a route before it is promoted (docs/BENCHMARKS.md#quality).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit.cli import main  # noqa: E402  (imports every op and its routes)
from lowbit.kernels import routes  # noqa: E402


def run(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    pairs = argv[:cut]
    if not pairs or len(pairs) % 2:
        raise SystemExit(__doc__)
    for op, name in zip(pairs[::2], pairs[1::2]):
        routes.ops()[op].prefer(name)
    return main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
