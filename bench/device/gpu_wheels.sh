#!/usr/bin/env bash
# The Python 3.12 wheels the lent H200 lacks (its image has torch, transformers, accelerate,
# pandas, pyarrow...; device KINDS.md), locked in bench/device/gpu_wheels.txt: the closure of
# qship's runtime dependencies minus the image's packages, at the versions in
# constraints.txt. Three are sdists on PyPI and are built here (pure Python).
#   bash bench/device/gpu_wheels.sh [DIR=.whl]      # then carry DIR (about 17 MB)
#   bash bench/device/gpu_wheels.sh DIR REQ ...     # those requirements instead of the lock's
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.whl}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DIR"
[ $# -gt 1 ] && LIST=$(printf '%s\n' "${@:2}") || LIST=$(cat bench/device/gpu_wheels.txt)
while read -r req; do
  [ -z "$req" ] && continue
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "$req" 2>/dev/null || "$PIP" wheel -q --no-deps -w "$DIR" "$req"
done <<< "$LIST"
ls "$DIR" | wc -l
