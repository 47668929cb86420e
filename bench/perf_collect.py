"""One compare report from a GPU session's rows: each recipe's eval.json (quality, from
`qship run`) with its served check (TAG-NAME-served.json, `qship verify --serve vllm`'s JSON,
put in `served` and its checks in the verdict) and its served speed (bench/perf_bench.py's
ServedPerf, measured after the quality runs, alone on the GPU, put in `served_perf`), as
`qship compare --serve vllm` would have written it, then `qship compare --collect` on them.

    python bench/perf_collect.py ROWS TAG PERF_DIR OUT [--compare-out DIR]

ROWS holds TAG-NAME-eval.json and TAG-NAME-served.json (formats_session.sh's rows),
PERF_DIR NAME.json; OUT gets NAME/eval.json for every eval.json, then the report in
--compare-out (default OUT/compare). No figure is recomputed: the records are read,
validated and joined, and a served check is judged again by today's rule (its stored
figures against the recipe limits it recorded: evaluate/served.py `rejudge`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.evaluate.served import evaluated_run_time_share, rejudge  # noqa: E402
from pipeline.gate import served_checks  # noqa: E402
from pipeline.records.evaluation import EvalFile  # noqa: E402
from pipeline.records.perf import ServedPerf  # noqa: E402
from pipeline.records.served import ServedCheck  # noqa: E402
from pipeline.records.verdict import Verdict  # noqa: E402


def with_served(ev: EvalFile, path: Path) -> tuple[EvalFile, str]:
    """`ev` with the served check of `path` (verify's JSON: the result itself, or under
    `result` when the check failed) in `served` and the verdict; a verify that stopped
    before serving (the engine did not start) is kept as `served_skipped`."""
    data = json.loads(path.read_text())
    res = data.get("result", data)
    if not res.get("served"):
        why = f"{data.get('error', 'no served check')}: {data.get('message', '')}".strip(": ")
        return ev.model_copy(update={"served_skipped": why}), "served check did not run"
    chk = ServedCheck.from_json(res["served"], where=f"{path}: served")
    # vLLM rounds activations at run time (Linear inputs, an FP8 KV cache): the rounding floor
    chk = rejudge(chk, run_time_share=evaluated_run_time_share(ev))
    ev = ev.model_copy(update={"served": chk})
    kept = [c for c in (ev.verdict.checks if ev.verdict else []) if not c.name.startswith("serve.")]
    checks = kept + served_checks(ev)
    verdict = Verdict(passed=all(c.passed for c in checks), checks=checks)
    return ev.model_copy(update={"verdict": verdict}), (
        f"served check {'passed' if chk.passed else 'FAILED'}"
    )


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
        joined = []
        served_path = a.rows / f"{a.tag}-{name}-served.json"
        if served_path.is_file():
            ev, said = with_served(ev, served_path)
            joined.append(said)
        perf_path = a.perf / f"{name}.json"
        if perf_path.is_file():
            joined.append("served speed")
            perf = ServedPerf.from_json(json.loads(perf_path.read_text()), where=str(perf_path))
            ev = ev.model_copy(update={"served_perf": perf})
        (a.out / name).mkdir(parents=True, exist_ok=True)
        (a.out / name / "eval.json").write_text(json.dumps(ev.to_json(), indent=1) + "\n")
        names.append(name + (f" (+ {', '.join(joined)})" if joined else ""))
    print("\n".join(names))
    report = a.compare_out or a.out / "compare"
    qship = [sys.executable, "-m", "pipeline.cli", "compare", "--collect", str(a.out)]
    return subprocess.run([*qship, "--out", str(report)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
