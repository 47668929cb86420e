"""What a verified stage-cache hit costs: an entry of the size of a quantized checkpoint is
looked up with its files re-hashed (io/cache.py) and without, beside coreutils `sha256sum`
on the same files in the same run (the anchor).

    .venv/bin/python bench/cache_verify_bench.py [--sizes-gb 0.39 5.7] [--dir /tmp/x] [--repeat 3]

0.39 GB is the gptq-w4 checkpoint of Gemma 3 270M, 5.7 GB that of the 8B-dims Llama (both
measured on the H200, bench/RESULTS.md). Entries are written once per size (random bytes in
1 GB safetensors-sized shards, as a sharded checkpoint would be); each lookup is timed warm
(page cache), the usual case on a hit right after a build or a previous hit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.io.cache import StageCache  # noqa: E402

SHARD = 1 << 30


def build(cache: StageCache, key: str, nbytes: int) -> None:
    def write(tmp: Path) -> dict:
        left, i = nbytes, 0
        while left > 0:
            n = min(SHARD, left)
            with open(tmp / f"model-{i:05d}.safetensors", "wb") as fh:
                for _ in range(0, n, 1 << 26):
                    fh.write(os.urandom(min(1 << 26, n)))
            left, i = left - n, i + 1
        return {"size": nbytes}

    cache.get_or_build("bench", key, write)


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[0.39, 5.7])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qship-cache-verify-bench"))
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cache = StageCache(a.dir)
    rows = []
    for gb in a.sizes_gb:
        key = f"{gb:g}gb"
        build(cache, key, int(gb * 1e9))
        entry = cache.entry_dir("bench", key)
        files = sorted(str(p) for p in entry.glob("*.safetensors"))
        cache.lookup("bench", key)  # warm the page cache
        verified = timed(lambda k=key: cache.lookup("bench", k), a.repeat)
        bare = timed(lambda k=key: cache.lookup("bench", k, verify=False), a.repeat)
        coreutils = timed(lambda f=files: subprocess.run(["sha256sum", *f], check=True,
                                                         capture_output=True), a.repeat)  # fmt: skip
        rows.append({"size_gb": gb, "verified_hit_s": round(verified, 3),
                     "unverified_hit_s": round(bare, 4), "sha256sum_s": round(coreutils, 3),
                     "gb_per_s": round(gb / verified, 2)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "rows": rows}, indent=2))  # fmt: skip
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
