"""Run by perf.VllmBench as a script in vLLM's own Python environment: several
`vllm bench serve` passes in one process, so vLLM's imports (~15 s) are paid once per model
rather than once per pass. Imports nothing from qship.

    python vllm_bench_child.py PASSES.json   # a list of argument lists for `vllm bench serve`

Each pass goes through vLLM's own command line (`vllm.entrypoints.cli.main.main` with that
argv), exactly as `vllm bench serve ARGS` would run it; each writes its result file
(--save-result) as it completes, so a failure later loses only the passes after it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    passes = json.loads(Path(path).read_text())
    for i, argv in enumerate(passes):
        print(f"== pass {i + 1}/{len(passes)}", flush=True)
        sys.argv = ["vllm", "bench", "serve", *argv]
        vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
