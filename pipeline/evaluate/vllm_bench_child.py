"""Run by perf.VllmBench as a script in vLLM's own Python environment: several
`vllm bench serve` passes in one process, so vLLM's imports (~15 s) are paid once per model
rather than once per pass. Imports nothing from qship.

    python vllm_bench_child.py PASSES.json [GO]   # PASSES: argument lists for `vllm bench serve`

With GO (a file path) the child is started beside the server: it imports vLLM, then waits
until GO says `go` (the server answers) or `stop` (it failed to start: no pass runs).

Each pass goes through vLLM's own command line (`vllm.entrypoints.cli.main.main` with that
argv), exactly as `vllm bench serve ARGS` would run it; each writes its result file
(--save-result) as it completes, so a failure later loses only the passes after it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _preload() -> None:
    """What vLLM's main() imports lazily (most of its start), while the server starts."""
    import importlib

    for name in ("vllm.entrypoints.cli.benchmark.main", "vllm.benchmarks.serve"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # main() imports what it needs and reports a failure itself


def _wait_for(go: Path) -> bool:
    while True:  # the parent's timeout bounds the wait (it kills this child)
        word = go.read_text().strip() if go.is_file() else ""
        if word in ("go", "stop"):
            return word == "go"
        time.sleep(0.2)


def main(path: str, go: str | None = None) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    if go is not None:
        _preload()
        if not _wait_for(Path(go)):
            print("== the server did not start: no pass", flush=True)
            return 0
    passes = json.loads(Path(path).read_text())
    for i, argv in enumerate(passes):
        print(f"== pass {i + 1}/{len(passes)}", flush=True)
        sys.argv = ["vllm", "bench", "serve", *argv]
        vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
