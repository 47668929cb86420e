"""`python -m bench list` | `python -m bench run SUITE [--results DIR] [--work DIR]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import SuiteError, load_suites, run_suite


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the suites of bench/suites.toml")
    run = sub.add_parser("run", help="run one suite; each row's JSON under bench/results/")
    run.add_argument("suite")
    run.add_argument("--results", type=Path, help="instead of bench/results/<date>-<machine>")
    run.add_argument("--work", type=Path, help="scratch folder (default $TMPDIR/qship-bench/SUITE)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "list":
            for name, suite in load_suites()["suites"].items():
                print(f"{name:14} {suite.get('machine', 'cpu'):4} {suite.get('about', '')}")
            return 0
        records = run_suite(a.suite, results=a.results, work=a.work)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if records and all(r["returncode"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
