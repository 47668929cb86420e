"""One compare report from a GPU session's rows: each recipe's eval.json (quality, from
`qship run`) with its served speed (bench/perf_bench.py's ServedPerf, measured after the
quality runs, alone on the GPU) put in `served_perf`, as `qship compare --serve vllm` would
have written it, then `qship compare --collect` on them.

    python bench/perf_collect.py ROWS TAG PERF_DIR OUT [--compare-out DIR]

ROWS holds TAG-NAME-eval.json (formats_session.sh's rows), PERF_DIR NAME.json; OUT gets
NAME/eval.json for every NAME with both, then the report in --compare-out (default
OUT/compare). The figures are not recomputed: the records are read, validated and joined.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.records.evaluation import EvalFile  # noqa: E402
from pipeline.records.perf import ServedPerf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("rows", type=Path)
    ap.add_argument("tag")
    ap.add_argument("perf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--compare-out", type=Path)
    a = ap.parse_args()
    names = []
    for ev_path in sorted(a.rows.glob(f"{a.tag}-*-eval.json")):
        name = ev_path.name.removeprefix(f"{a.tag}-").removesuffix("-eval.json")
        ev = EvalFile.from_json(json.loads(ev_path.read_text()), where=str(ev_path))
        perf_path = a.perf / f"{name}.json"
        if perf_path.is_file():
            perf = ServedPerf.from_json(json.loads(perf_path.read_text()), where=str(perf_path))
            ev = ev.model_copy(update={"served_perf": perf})
        (a.out / name).mkdir(parents=True, exist_ok=True)
        (a.out / name / "eval.json").write_text(json.dumps(ev.to_json(), indent=1) + "\n")
        names.append(f"{name}{' (+ served speed)' if perf_path.is_file() else ''}")
    print("\n".join(names))
    report = a.compare_out or a.out / "compare"
    qship = [sys.executable, "-m", "pipeline.cli", "compare", "--collect", str(a.out)]
    return subprocess.run([*qship, "--out", str(report)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
