#!/usr/bin/env bash
# Wheels `lowbit serve` needs that the GPU image lacks (fastapi, uvicorn, pydantic and
# their own needs), downloaded here for the GPU machine's Python (3.12, x86-64) into .whl/,
# which git ignores and the device call carries; scripts/bench_campaign.sh installs them
# to /tmp/site there. Versions: the ones the CPU test install resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PKGS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 uvicorn==0.55.0
      annotated-types==0.7.0 typing-inspection==0.4.2 typing_extensions==4.16.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PKGS[@]}"
ls -la .whl
