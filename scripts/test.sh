#!/usr/bin/env bash
# The CPU test suite: ruff, then pytest (Triton kernels run in the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m ruff check lowbit tests scripts
TRITON_INTERPRET=1 python3 -m pytest -q -x --durations=15 "$@"
