"""The long-context retrieval check (pipeline/evaluate/long_context.py) on a quantized
folder beside its reference, outside a recipe run: for rows at chosen lengths and engines.

    python bench/long_context_bench.py --artifact DIR --reference DIR --out ROW.json \
        [--lengths 4096 16384 max] [--trials 8] [--engine transformers|vllm] [--device cpu] \
        [--attention vllm|kv-only] [--source builtin:english]

Writes the LongContextCheck record as JSON (with the command) when it completes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.evaluate.long_context import check_artifact  # noqa: E402
from pipeline.recipe import LongContext, ServeGate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", nargs="+", default=["4096", "16384", "max"])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--attention", default="vllm")
    ap.add_argument("--source", default="builtin:english")
    a = ap.parse_args()
    lengths = [x if x == "max" else int(x) for x in a.lengths]
    sg = ServeGate(engine=a.engine, kv_cache_dtype=a.kv,
                   long_context=LongContext(lengths=lengths, trials=a.trials))  # fmt: skip
    res = check_artifact(a.artifact, a.reference, sg, a.source, device=a.device,
                         attention=a.attention)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), **res.to_json()}, indent=1) + "\n")
    print(res.summary())
    return 0 if res.passed else 4


if __name__ == "__main__":
    sys.exit(main())
