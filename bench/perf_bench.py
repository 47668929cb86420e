"""Served speed and memory of several checkpoints of one model beside its 16-bit reference,
through qship's perf stage (pipeline/evaluate/perf.py: `vllm serve` + `vllm bench serve`),
the reference measured once, in the same process on the same GPU.

    python bench/perf_bench.py --reference DIR --out DIR NAME=CHECKPOINT_DIR ... \
        [--repeats 3] [--prompts-per-stream 8]

Writes OUT/<NAME>.json (the ServedPerf record) as each candidate completes, every pass's raw
vLLM result JSON and the server logs under OUT/raw/, and OUT/summary.md at the end.
Speed does not need trained weights: a random model of a real model's dimensions
(bench/make_random_llama.py) runs the same kernels at the same shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.evaluate import perf  # noqa: E402
from pipeline.model.files import hash_model_dir  # noqa: E402
from pipeline.recipe import DEFAULT_WORKLOADS, ServeGate  # noqa: E402
from pipeline.records.perf import perf_lines  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts-per-stream", type=int, default=8)
    ap.add_argument("--min-prompts", type=int, default=16, help="per workload and repeat")
    ap.add_argument("candidates", nargs="+", help="NAME=DIR")
    a = ap.parse_args()
    wls = [w.model_copy(update={"num_prompts": max(a.min_prompts, a.prompts_per_stream * w.concurrency)})
           for w in DEFAULT_WORKLOADS]  # fmt: skip
    cfg = ServeGate(engine="vllm", workloads=wls, repeats=a.repeats)
    a.out.mkdir(parents=True, exist_ok=True)
    runner = perf.VllmBench()
    ref_runs = perf.ReferenceCache()  # the reference's figures, measured beside the first
    ref_hash = hash_model_dir(a.reference)[1]  # once, not per candidate
    lines = []
    for spec in a.candidates:
        name, _, path = spec.partition("=")
        try:
            res = perf.measure(Path(path), a.reference, cfg, runner, raw_dir=a.out / "raw",
                               ref_cache=ref_runs, reference_hash=ref_hash)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failed candidate must not lose the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:800]}", file=sys.stderr)
            (a.out / f"{name}.error.txt").write_text(f"{type(e).__name__}: {e}\n")
            if not ref_runs.mem:  # the reference itself did not serve: no candidate will compare
                break
            continue
        (a.out / f"{name}.json").write_text(json.dumps(res.to_json(), indent=1) + "\n")
        lines += [f"## {name}", *perf_lines(res), ""]
        print("\n".join(lines[-len(perf_lines(res)) - 2 :]), file=sys.stderr, flush=True)
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
