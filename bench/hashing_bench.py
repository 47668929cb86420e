"""Hashing throughput of qship beside `openssl dgst -sha256` and coreutils `sha256sum`.

Measures, on multi-GiB files, in one run (interleaved, median of --repeat):
  * one file, one core, from the page cache: qship sha256_file, openssl dgst, sha256sum
  * one file, cold (pages dropped with posix_fadvise DONTNEED before each read)
  * all files on all cores: qship hash_files (threads) vs the same files sequentially
and `openssl speed sha256` (16 KiB blocks) as the per-core ceiling. Prints a Markdown
section (appended to --results FILE when given), and writes the figures to --json FILE
(what `python -m bench run hashing` keeps). Target (issue 2): qship >= 0.9x OpenSSL's per-core rate, scaling with
cores across files.

    .venv/bin/python bench/hashing_bench.py [--size-gib 2] [--files 2] [--dir /tmp/qship-hashbench] \
        [--json OUT.json] [--results bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.io.hashing import hash_files, sha256_file  # noqa: E402

GIB = 1024**3


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    block = os.urandom(64 * 1024 * 1024)
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as fh:
        while fh.read(64 * 1024 * 1024):
            pass


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_cpu(fn) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of fn()."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def openssl_speed(seconds: int = 3) -> float:
    out = subprocess.run(
        ["openssl", "speed", "-seconds", str(seconds), "-bytes", "16384", "sha256"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    m = re.search(r"^sha256\s+([\d.]+)k", out, re.M)
    return float(m.group(1)) * 1000 / 1e9  # GB/s


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qship-hashbench"))
    ap.add_argument("--results", type=Path, help="a Markdown file to append the section to")
    ap.add_argument("--json", type=Path, help="the figures as JSON")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    size = int(args.size_gib * GIB)
    args.dir.mkdir(parents=True, exist_ok=True)
    files = [args.dir / f"blob{i}.bin" for i in range(args.files)]
    for f in files:
        make_file(f, size)
    one = files[0]
    gb = size / 1e9

    rates: dict[str, list[float]] = {}

    def rec(name: str, seconds: float, nbytes: float = gb) -> None:
        rates.setdefault(name, []).append(nbytes / seconds)

    ratios, ratios_ra = [], []  # qship / openssl speed, measured back to back in each round
    cores_ra = []  # CPU seconds per wall second of the read-ahead run
    RA = "qship sha256_file, read-ahead thread (1 file, cached)"
    for _ in range(args.repeat):
        warm(one)
        speed_now = openssl_speed(2)
        rec("qship sha256_file (1 core, cached)", timed(lambda: sha256_file(one)))
        ratios.append(rates["qship sha256_file (1 core, cached)"][-1] / speed_now)
        wall, cpu = timed_cpu(lambda: sha256_file(one, readahead=True))
        rec(RA, wall)
        ratios_ra.append(rates[RA][-1] / speed_now)
        cores_ra.append(cpu / wall)
        rec(
            "openssl dgst -sha256 (1 core, cached)",
            timed(lambda: run(["openssl", "dgst", "-sha256", str(one)])),
        )
        rec("sha256sum (1 core, cached)", timed(lambda: run(["sha256sum", str(one)])))
        drop_cache(one)
        rec("qship sha256_file (1 core, cold)", timed(lambda: sha256_file(one)))
        drop_cache(one)
        rec(
            "qship sha256_file, read-ahead thread (1 file, cold)",
            timed(lambda: sha256_file(one, readahead=True)),
        )
        drop_cache(one)
        rec(
            "openssl dgst -sha256 (1 core, cold)",
            timed(lambda: run(["openssl", "dgst", "-sha256", str(one)])),
        )
        for f in files:
            warm(f)
        rels = [f.name for f in files]
        total = gb * len(files)
        rec(
            f"qship hash_files, {len(files)} files, 1 thread, no read-ahead (cached)",
            timed(lambda rels=rels: hash_files(args.dir, rels, workers=1, readahead=False)),
            total,
        )
        rec(
            f"qship hash_files, {len(files)} files, {len(files)} threads, no read-ahead (cached)",
            timed(
                lambda rels=rels: hash_files(args.dir, rels, workers=len(files), readahead=False)
            ),
            total,
        )

    speed = openssl_speed()
    med = {k: statistics.median(v) for k, v in rates.items()}
    q1 = med["qship sha256_file (1 core, cached)"]
    o1 = med["openssl dgst -sha256 (1 core, cached)"]
    par = med[f"qship hash_files, {len(files)} files, {len(files)} threads, no read-ahead (cached)"]
    seq = med[f"qship hash_files, {len(files)} files, 1 thread, no read-ahead (cached)"]

    lines = [
        f"\n## Hashing throughput — {dt.date.today().isoformat()}\n",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{subprocess.run(['openssl', 'version'], capture_output=True, text=True).stdout.strip()}",
        f"- command: `.venv/bin/python bench/hashing_bench.py --size-gib {args.size_gib:g} "
        f"--files {args.files} --repeat {args.repeat}` ({args.files} files of {args.size_gib:g} GiB, "
        f"median of {args.repeat})",
        f"- `openssl speed sha256` (16 KiB blocks, 1 core): **{speed:.2f} GB/s**\n",
        "| what | GB/s |",
        "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in med.items()],
        "",
        f"- qship / `openssl speed` per core: **{q1 / speed:.2f}x** (target >= 0.9x); "
        f"paired in each round (openssl speed run just before): median "
        f"**{statistics.median(ratios):.3f}x**, range {min(ratios):.3f}-{max(ratios):.3f}; "
        f"qship / `openssl dgst` on the same file: {q1 / o1:.2f}x",
        f"- one file with the read-ahead thread (what `hash_files` does when a core is idle): "
        f"**{med[RA] / speed:.2f}x** `openssl speed`; paired median "
        f"**{statistics.median(ratios_ra):.3f}x**, range {min(ratios_ra):.3f}-{max(ratios_ra):.3f}; "
        f"it keeps {statistics.median(cores_ra):.2f} cores busy (CPU s / wall s), so per "
        f"CPU-second it is {statistics.median(ratios_ra) / statistics.median(cores_ra):.2f}x",
        f"- scaling across files: {par / seq:.2f}x with {len(files)} threads over 1",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        with open(args.results, "a") as fh:
            fh.write(text)
    if args.json:
        figures = {"machine": cpu_model(), "cores": os.cpu_count(), "size_gib": args.size_gib,
                   "files": args.files, "repeat": args.repeat, "openssl_speed_gb_s": speed,
                   "gb_per_s": med, "qship_over_openssl_paired": statistics.median(ratios),
                   "readahead_over_openssl_paired": statistics.median(ratios_ra),
                   "readahead_cores_busy": statistics.median(cores_ra),
                   "scaling_across_files": par / seq}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
