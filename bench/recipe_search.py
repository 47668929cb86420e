"""Recipe search on one model: sensitivity-derived recipes + a grid, each compared alone.

    python bench/recipe_search.py --model SRC --recipes R1 R2 ... \
        [--sens-base B1 B2 ... --max-bits 4.20] --out DIR [--cache-dir C]

1. For every --sens-base recipe: `qship sensitivity` (RTN one module at a time) and the
   recipe it writes with the most sensitive modules at int8 within --max-bits
   (DIR/recipes/<base>-sens.yaml, DIR/sensitivity-<base>.json).
2. Every recipe (given + written) through `qship compare` on its own (DIR/runs/<name>/),
   sharing the fetch, the token sets and the reference log-probs through the stage cache;
   a recipe that fails is logged and the search goes on.
3. `qship compare --collect DIR/runs` -> DIR/report (md/json/csv/html + plots).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import runner  # noqa: E402
from pipeline.compare import compare, recipe_writer, sensitivity  # noqa: E402
from pipeline.compare.rows import row_from_file  # noqa: E402
from pipeline.recipe import load_recipe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipes", nargs="*", type=Path, default=[])
    ap.add_argument("--sens-base", nargs="*", type=Path, default=[])
    ap.add_argument("--max-bits", type=float, default=4.20)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qship")
    ap.add_argument("--device", default=None)
    ap.add_argument("--exact", action="store_true", help="full-vocabulary KL (slower)")
    a = ap.parse_args()
    (a.out / "recipes").mkdir(parents=True, exist_ok=True)
    # one measurement (RTN at the bases' schemes); each base gets its upgraded recipe
    sens: list[Path] = []
    rows = None
    for base in a.sens_base:
        dest = a.out / "recipes" / f"{base.stem}-sens.yaml"
        sens.append(dest)
        if dest.is_file():  # a resumed search: measured and written before
            continue
        if rows is None:
            t0 = time.perf_counter()
            res = sensitivity.run(
                a.model, base, cache_dir=a.cache_dir, device=a.device,
                out=a.out / f"sensitivity-{base.stem}.json", write_recipe=dest, max_bits=a.max_bits,
            )  # fmt: skip
            rows = res.rows
            print(res.summary(), f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            continue
        snap = runner.fetch_stage(a.model, runner.Context(a.cache_dir, device=a.device))
        w = recipe_writer.write_upgraded_recipe(
            rows, Path(snap.path), base, dest, a.max_bits, a.model
        )
        print(
            f"wrote {dest}: {len(w['upgraded'])} int8, {w['bits_per_weight']:.4f} bits/weight",
            file=sys.stderr,
        )
    recipes = sens + list(a.recipes)
    failed = {}
    for r in recipes:
        name = load_recipe(r).name
        if (a.out / "runs" / name / "recipes" / name / "eval.json").is_file():
            continue  # a resumed search: done before
        t0 = time.perf_counter()
        try:
            compare.compare(
                a.model,
                [r],
                a.out / "runs" / name,
                cache_dir=a.cache_dir,
                device=a.device,
                exact=a.exact,
            )
        except Exception as e:  # noqa: BLE001 - one failed recipe must not end the search
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
        print(f"== {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        rep = compare.collect([a.out / "runs"], a.out / "report")
        summary = {**rep.to_json(), "failed": failed}
        rows = json.loads((a.out / "report" / "compare.json").read_text())["rows"]
    except ImportError as e:  # no matplotlib (the lent GPU): collect the report elsewhere
        print(
            f"report not built here ({e}); run `qship compare --collect {a.out}/runs`",
            file=sys.stderr,
        )
        rows = [row_from_file(f) for f in compare.find_eval_files([a.out / "runs"])]
        summary = {"failed": failed, "recipes": [r["name"] for r in rows]}
    (a.out / "search.json").write_text(json.dumps(summary, indent=2) + "\n")
    for row in rows:
        print(
            f"{row['name']:<28} bits {row.get('bits_per_weight') or 0:.4f}  KL {row.get('kl_mean') or 0:.4f}"
            f"  KL(w-only) {row.get('kl_mean_kv_off') or 0:.4f}  q {row.get('quantize_s') or 0:.1f}s"
        )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
