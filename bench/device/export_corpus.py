"""Export builtin:english as JSONL (text, doc_id, part) and point recipes at it.

For machines without gensim (the lent GPU): a local JSONL with doc_id/part gives the same
document split and the same token sets as builtin:english (pipeline/data/tokens.py), so GPU and
CPU runs are scored on the very same held-out tokens.

    python bench/device/export_corpus.py DIR recipes/*.yaml [bench/recipes/*.yaml]
      -> DIR/english.jsonl and DIR/recipes/<name>.yaml (calibration.source = DIR/english.jsonl;
         lm-eval and the benchmark data travel too: bench/device/gpu_wheels.txt, gpu_session.sh)
    --kl-only NAME ...  also DIR/recipes/NAME-h200.yaml for those recipes: no benchmarks, no
         gates, vLLM's served check (what the GPU sessions' quality rows need, in less time)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.data.corpus import corpus_hash, load_corpus  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("recipes", nargs="*", type=Path)
    ap.add_argument("--kl-only", nargs="*", default=[], metavar="NAME")
    a = ap.parse_args()
    (a.dir / "recipes").mkdir(parents=True, exist_ok=True)
    ds, _ = load_corpus("builtin:english")
    jl = a.dir / "english.jsonl"
    with jl.open("w", encoding="utf-8") as f:
        for row in ds:
            f.write(json.dumps({k: row[k] for k in ("text", "doc_id", "part")}) + "\n")
    again, _ = load_corpus(str(jl))
    assert corpus_hash(again) == corpus_hash(ds), "the exported corpus differs from its source"
    for r in a.recipes:
        d = yaml.safe_load(r.read_text())
        d.setdefault("calibration", {})["source"] = jl.as_posix()
        (a.dir / "recipes" / r.name).write_text(yaml.safe_dump(d, sort_keys=False))
        if r.stem in a.kl_only:
            d["name"] = f"{r.stem}-h200"
            d.setdefault("evaluation", {}).update(tasks=[], hub_tasks=[])
            d.update(gates={}, serve={**d.get("serve", {}), "engine": "vllm"})
            out = a.dir / "recipes" / f"{r.stem}-h200.yaml"
            out.write_text(yaml.safe_dump(d, sort_keys=False))
    print(f"{jl} ({len(ds)} documents, corpus {corpus_hash(ds)[:12]}); {len(a.recipes)} recipes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
