#!/usr/bin/env bash
# Wheels `lowbit serve` needs that the GPU image lacks, downloaded here for the GPU
# machine's Python (3.12, x86-64) into .whl/, which git ignores and the device call carries;
# scripts/bench_campaign.sh installs them to /tmp/site there.
# The set is what pip resolves for lowbit's `serve` extra (fastapi, uvicorn, httpx and
# everything they import: starlette, pydantic, opentelemetry, ...), not a hand list, so a
# new release that adds a dependency cannot leave the server failing at import. Packages
# the GPU image already has at a compatible version (torch and its stack) are not needed
# by these and are never pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
REQS=$(python3 - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"]))
PY
)
mapfile -t PKGS <<< "$REQS"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PKGS[@]}"
ls .whl | sed 's/-py.*//; s/-cp.*//' | sort | tr '\n' ' '; echo
du -sh .whl
