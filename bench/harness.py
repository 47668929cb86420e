"""Run a benchmark suite of bench/suites.toml and keep each row's raw result.

Every row runs in its own process from the repository root; as soon as it ends, its JSON
(the command, the commit, the machine, the time it took, its exit code and its result) is
written to bench/results/<date>-<machine>/<suite>/<row>.json, so rows finished before a
crash or a lost machine are kept. A failed row stops its suite: later rows may read what it
was to build.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SUITES = BENCH / "suites.toml"
PLACEHOLDER = re.compile(r"\{(out|dir|work|model|recipe)\}")
TAIL = 4000  # characters of a row's stdout / stderr kept in its JSON


class SuiteError(ValueError):
    """A suite or row that bench/suites.toml does not describe correctly."""


def load_suites(path: Path = SUITES) -> dict:
    """suites.toml, checked: every row names a script of bench/ or a qship command, and its
    model is one of [models]."""
    data = tomllib.loads(path.read_text())
    models = data.get("models", {})
    for name, suite in data.get("suites", {}).items():
        for row in suite.get("rows", []):
            where = f"{path.name}: suite {name!r}, row {row.get('name')!r}"
            if ("script" in row) == ("qship" in row):
                raise SuiteError(f"{where}: give exactly one of `script` or `qship`")
            if "script" in row and not (BENCH / row["script"]).is_file():
                raise SuiteError(f"{where}: no script bench/{row['script']}")
            if "model" in row and row["model"] not in models:
                raise SuiteError(f"{where}: model {row['model']!r} is not in [models] "
                                 f"({', '.join(sorted(models))})")  # fmt: skip
    return data


def machine_name() -> str:
    """The GPU's name where there is one (nvidia-smi), else the CPU's core count: 'cpu16'."""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        gpu = ""
    first = gpu.strip().splitlines()[0] if gpu.strip() else f"cpu{os.cpu_count()}"
    return re.sub(r"[^a-z0-9]+", "-", first.lower()).strip("-")


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    head = git("rev-parse", "HEAD").strip() or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def fetched(source: str) -> str:
    """A qship source fetched (verified, cached) to its local folder; a local folder as is."""
    if "://" not in source:
        return str(ROOT / source)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "fetch", source, "--json"],
                       cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        raise SuiteError(f"qship fetch {source} failed (exit {p.returncode}): {p.stdout[-TAIL:]}")
    return json.loads(p.stdout)["path"]


def command(row: dict, values: dict) -> list[str]:
    def fill(arg: str) -> str:
        return PLACEHOLDER.sub(lambda m: values[m.group(1)], arg)

    args = [fill(a) for a in row.get("args", row.get("qship", []))]
    if "script" in row:
        return [sys.executable, str(BENCH / row["script"]), *args]
    return [sys.executable, "-m", "pipeline.cli", *args]


def result_of(out: Path, stdout: str):
    """What the row wrote to {out}; else the last JSON document it printed; else None."""
    if out.is_file():
        return json.loads(out.read_text())
    for start in (m.start() for m in re.finditer(r"^[\[{]", stdout, re.M)):
        try:
            return json.loads(stdout[start:])
        except json.JSONDecodeError:
            continue
    return None


def run_row(suite: str, row: dict, models: dict, work: Path, dest: Path) -> dict:
    """Run one row; write and return its record (dest/<row>.json)."""
    out = dest / f"{row['name']}.out.json"
    files = dest / row["name"]  # {dir}: for a row that writes several files of results
    values = {"out": str(out), "dir": str(files), "work": str(work),
              "recipe": str(ROOT / row.get("recipe", ""))}  # fmt: skip
    if any("{dir}" in a for a in row.get("args", row.get("qship", []))):
        files.mkdir(parents=True, exist_ok=True)
    if "model" in row:
        values["model"] = fetched(models[row["model"]])
    cmd = command(row, values)
    started = dt.datetime.now(dt.UTC)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    result = result_of(out, p.stdout) if p.returncode == 0 else None
    record = {
        "suite": suite, "row": row["name"], "command": cmd, "commit": commit(),
        "machine": machine_name(), "started": started.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 2), "returncode": p.returncode,
        "result": result,  # what it printed is kept where it gave no result
        "stdout_tail": p.stdout[-TAIL:] if result is None else "", "stderr_tail": p.stderr[-TAIL:],
    }  # fmt: skip
    out.unlink(missing_ok=True)
    (dest / f"{row['name']}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_suite(name: str, *, results: Path | None = None, work: Path | None = None,
              suites: Path = SUITES) -> list[dict]:  # fmt: skip
    """Every row of suite `name` in order, until one fails; their records."""
    data = load_suites(suites)
    if name not in data.get("suites", {}):
        known = ", ".join(sorted(data.get("suites", {})))
        raise SuiteError(f"{suites.name}: no suite {name!r} (suites: {known})")
    day = dt.date.today().isoformat()
    dest = (results or BENCH / "results" / f"{day}-{machine_name()}") / name
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / "qship-bench" / name
    dest.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    records = []
    for row in data["suites"][name]["rows"]:
        print(f"bench {name}: {row['name']} ...", file=sys.stderr, flush=True)
        records.append(run_row(name, row, data.get("models", {}), work, dest))
        print(f"bench {name}: {row['name']} exit {records[-1]['returncode']} in "
              f"{records[-1]['seconds']} s -> {dest / (row['name'] + '.json')}",
              file=sys.stderr, flush=True)  # fmt: skip
        if records[-1]["returncode"] != 0:
            break
    return records
