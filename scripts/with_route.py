"""Run a lowbit command with one OPT_IN route switched on in-process.

  python scripts/with_route.py OP ROUTE -- lowbit-args...
  e.g. python scripts/with_route.py linear torch_scaled_mm -- eval demo --quantization fp8 ...

Unlike LOWBIT_ROUTE_<OP>=ROUTE, which forces the route on every call and fails on the calls
it refuses (the dense lm_head for a quantized-weight route), this gives the route DEFAULT
status in its registration slot: calls it admits take it, the others keep their routes.
For quality records of a route before it is promoted (docs/BENCHMARKS.md#quality).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit.cli import main  # noqa: E402  (imports every op and its routes)
from lowbit.kernels import routes  # noqa: E402


def run(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        raise SystemExit(__doc__)
    op, name = argv[0], argv[1]
    routes.ops()[op].get(name).status = routes.DEFAULT
    return main(argv[3:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
