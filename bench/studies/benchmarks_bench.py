"""Benchmark scores and time per task of one model: each task alone in its own lm-eval child
(what `qship evaluate` pools into one child), the pinned local data, qship's per-item metric.
With --reference, the per-item results are stored where `qship evaluate` / `compare` look
for the reference's (same cache key): the timed pass is the reference pass they reuse.

    python bench/studies/benchmarks_bench.py --model DIR --cache-dir DIR --device cuda --batch-size 32 \
        --out bench/benchmarks_gemma270m_h200.json [--tasks hellaswag ... mmlu] [--limit N]

Prints one row per task: items, accuracy (± s.e.), seconds, items per second.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.data import benchmarks as data  # noqa: E402
from pipeline.evaluate.benchmarks import STAGE, _const, _pool, reference_key, run_lm_eval  # noqa: E402
from pipeline.io.cache import StageCache  # noqa: E402
from pipeline.io.pins import SHIPPED  # noqa: E402
from pipeline.model.files import hash_model_dir  # noqa: E402

TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai", "mmlu"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, required=True)
    ap.add_argument("--tasks", nargs="+", default=TASKS)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reference", action="store_true", help="store as the reference's results")
    a = ap.parse_args()
    d = data.benchmark_data(a.cache_dir, SHIPPED)
    model_hash = hash_model_dir(a.model)[1]
    rows: dict = {}

    def save() -> None:  # after every task: a run cut short keeps what it measured
        out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
               "command": " ".join(sys.argv), "model": str(a.model), "device": a.device,
               "batch_size": a.batch_size, "limit": a.limit,
               "data": f"{data.PACKAGE}=={data.VERSION}", "tasks": rows}  # fmt: skip
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")

    for name in a.tasks:
        t0 = time.perf_counter()
        raw, _ = run_lm_eval(a.model, data.expand([name]), data_dir=d, limit=a.limit,
                             device=a.device, dtype=a.dtype, batch_size=a.batch_size)  # fmt: skip
        secs = time.perf_counter() - t0
        r = _pool(name, raw) if name in data.GROUPS else raw[name]
        if r["status"] != "ok":
            rows[name] = {"status": r["status"], "reason": r.get("reason"), "seconds": secs}
            print(f"{name:16s} {r['status']}: {r.get('reason')}", flush=True)
            save()
            continue
        if a.reference:
            key = reference_key(model_hash, name, hub=False, limit=a.limit, dtype=a.dtype,
                                device=a.device, batch_size=a.batch_size)  # fmt: skip
            StageCache(a.cache_dir).get_or_build(STAGE, key, _const(r), force=True)
        v = list(r["items"].values())
        p = sum(v) / len(v)
        se = math.sqrt(p * (1 - p) / (len(v) - 1))
        rows[name] = {"status": "ok", "metric": r["metric"], "split": r["split"], "n": len(v),
                      "n_total": r["n_total"], "accuracy": p, "stderr": se, "seconds": secs}  # fmt: skip
        print(f"{name:16s} {r['metric']:8s} n={len(v):6d} {100 * p:5.1f} ± {100 * se:.1f} %  "
              f"{secs:7.1f} s  {len(v) / secs:7.1f} items/s", flush=True)  # fmt: skip
        save()


if __name__ == "__main__":
    main()
