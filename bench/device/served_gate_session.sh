#!/usr/bin/env bash
# GPU session for issue 57's served figures (items 1, 2, 4) and issue 58's candidates at the GPU
# default's budget: Gemma 3 270M, `qship run` of $RECIPES and $CANDS on the GPU at once, then
# as served by vLLM 0.26: each artifact's served check (the rounding floor: the limit and its
# run-time share), the first artifact re-rounded otherwise (same
# scales, other nearest levels: bench/reround.py) which the served check must fail, and served
# speed of every artifact beside the reference (the reference served once: the second
# artifact's reference figures come from the cache). Carries as formats_session.sh (built by
# carry_prepare.sh): .whl + .qship-gpu + .benchcache, .devstash-g0..6, .devstash7a/7b/8/9/10/11;
# `stage` after each. Every row's JSON goes to $S/rows as it completes.
#   stage    formats_session.sh's staging (install, stash, join vLLM's part 1)
#   start    once the Gemma parts are in: the job (setsid, frozen tree), waiting for vLLM
#   final    once the last vLLM part is in: vLLM's environment, then the job's vLLM steps go
#   collect  rows.tgz + the log's tail into $OUT; WAIT=1 waits for the end
set -uo pipefail
S=/root/stash
case "${1:-}" in start) . bench/device/session_tree.sh; freeze_tree ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$S/rows" "$OUT"
export PYTHONPATH=$S/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 QSHIP_CACHE=$S/cache QSHIP_VLLM_PYTHON=$S/vllm-python
G=$S/gemma-3-270m-q4_k_m.gguf
L=.qship-gpu/recipes
Q="python3 -m pipeline.cli"
RECIPES=${RECIPES:-"gemma-mixed-w4-h200 gemma-mixed-w4a-h200"}  # served, re-rounded (first), speed
CANDS=${CANDS-"gemma-mixed-w4a-attn64-h200 gemma-mixed-w4a-grid-h200"}  # issue 58: run + served
R=$S/rows

job() {
  $Q fetch "$G" --json > "$R/fetch.json" 2> "$S/fetch.log"
  ref=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['path'])" "$R/fetch.json")
  for r in $RECIPES $CANDS; do  # at once: a 270M model leaves the GPU and 16 cores room
    ( $Q run --model "$G" --recipe "$L/$r.yaml" --out "$S/art-$r" --device cuda --json \
        > "$R/run-$r.json" 2> "$S/run-$r.log"
      echo "== run $r rc $?"; cp "$S/art-$r.report/eval.json" "$R/eval-$r.json" 2> /dev/null ) &
  done
  wait
  while [ ! -f "$S/vllm.ready" ]; do sleep 3; done
  set -- $RECIPES
  python3 -m bench.reround "$S/art-$1" "$ref" "$S/art-$1-rerounded" > "$S/reround.log" 2>&1
  for a in $1-rerounded $RECIPES $CANDS; do  # each vLLM sized for its rows: side by side
    ( $Q verify "$S/art-$a" --serve vllm --serve-kv auto --json > "$R/served-$a.json" \
        2> "$S/served-$a.log"; echo "== served $a rc $?" ) &
    sleep 20
  done
  wait
  for a in $RECIPES; do  # alone on the GPU: the second finds the reference's figures cached
    $Q verify "$S/art-$a" --serve vllm --serve-kv auto --perf --reference "$ref" \
      --perf-raw "$R/perf-raw-$a" --json > "$R/perf-$a.json" 2> "$S/perf-$a.log"
    echo "== perf $a rc $?"
  done
}

case "$1" in
stage) bash bench/device/formats_session.sh stage ;;
start)
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  [ -f "$G" ] || python3 tools/offline.py join "$S" "$G" || exit 1
  rm -f "$S"/*.part0*
  setsid nohup bash -c "$(declare -f job); S=$S G=$G L=$L Q='$Q' R=$R RECIPES='$RECIPES' CANDS='$CANDS' job \
    > $S/job.log 2>&1; touch $S/job.done" > /dev/null 2>&1 < /dev/null &
  sleep 5; tail -n 3 "$S/job.log"
  ;;
final)
  OUT=$S bash bench/device/serve_session.sh vllm-env > "$S/vllm-env.log" 2>&1; tail -2 "$S/vllm-env.log"
  [ -x "$S/vllm-python" ] && touch "$S/vllm.ready"
  tail -n 5 "$S/job.log"
  ;;
collect)
  if [ "${WAIT:-0}" = 1 ]; then while [ ! -f "$S/job.done" ]; do sleep 5; done; fi
  cat "$S/job.log"
  for f in "$S"/served-*.log "$S"/perf-*.log "$S"/run-*.log "$S"/reround.log; do
    grep -v "Warning\|warn(\|it/s\]\|s/it\]" "$f" 2>/dev/null | tail -25 | sed "s|^|$(basename "$f"): |"
  done > "$OUT/tails.log"
  (cd "$R" && tar czf "$OUT/rows.tgz" .)
  ls -la "$OUT"; nvidia-smi --query-gpu=memory.used --format=csv,noheader
  ;;
esac
