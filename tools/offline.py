"""Getting qship onto a GPU host without internet (README "GPU host without internet").

    python tools/offline.py wheelhouse requirements/gpu.lock DIR   # online: every locked file
    python tools/offline.py split FILE DIR [--size 40000000]       # big file -> parts + manifest
    python tools/offline.py join DIR [OUT]                         # parts -> file, sha256-checked
    python tools/offline.py complete DIR                           # exit 0 once every part is in

`wheelhouse` downloads each pinned distribution of a hash-locked requirements file for a
Python 3.12 manylinux x86_64 host (a wheel where one exists, else the sdist, which pip
builds there from the same folder) and checks every file against the lock's hashes, so
`pip install --no-index --find-links DIR --require-hashes -r LOCK` works offline.
`split` cuts a file into parts of at most --size bytes (the device tool carries 64 MiB a
call) and writes `manifest.json` (sha256 of the whole and of each part); `join` refuses a
missing, extra or altered part and writes the file atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
MANIFEST = "manifest.json"
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def parse_lock(text: str) -> dict[str, set[str]]:
    """'name==version' -> its allowed sha256s, from a pip/uv hash-locked requirements file."""
    out: dict[str, set[str]] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+==[^\s;]+)", line)
        if m:
            current = m.group(1)
            out[current] = set()
        if current:
            out[current] |= set(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return out


def wheelhouse(lock: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    pins = parse_lock(lock.read_text())
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    for i, req in enumerate(sorted(pins), 1):
        print(f"[{i}/{len(pins)}] {req}", flush=True)
        binary = [*base, "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                  "cp", *plat, req]  # fmt: skip
        if subprocess.run(binary, capture_output=True).returncode != 0:
            subprocess.run([*base, "--no-binary=:all:", req], check=True)
    present = {sha256(p): p.name for p in dest.iterdir() if p.is_file()}
    missing = [req for req, hashes in pins.items() if hashes and not hashes & present.keys()]
    if missing:
        sys.exit(f"no file matching the lock's hashes for: {', '.join(missing)}")
    print(f"{len(pins)} pinned distributions in {dest}, every one matching a locked hash")


def split(path: Path, dest: Path, size: int) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        i = 0
        while block := f.read(size):
            name = f"{path.name}.part{i:03d}"
            (dest / name).write_bytes(block)
            parts.append({"name": name, "size": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})  # fmt: skip
            i += 1
    manifest = {"file": path.name, "size": path.stat().st_size, "sha256": sha256(path),
                "parts": parts}  # fmt: skip
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{path.name}: {len(parts)} parts of <= {size} bytes in {dest}")


def missing(src: Path, m: dict) -> list[str]:
    """The parts manifest `m` names that are not (yet) in `src`."""
    return [p["name"] for p in m["parts"] if not (src / p["name"]).is_file()]


def join(src: Path, out: Path | None) -> Path:
    if not (src / MANIFEST).is_file():  # it travels with one of the parts: not staged yet
        sys.exit(f"{src}: no {MANIFEST}: stage the carry that holds it (with one of the parts)")
    m = json.loads((src / MANIFEST).read_text())
    names = [p["name"] for p in m["parts"]]
    extra = sorted({p.name for p in src.glob(f"{m['file']}.part*")} - set(names))
    bad = [f"{n}: missing" for n in missing(src, m)] + [f"{n}: not in {MANIFEST}" for n in extra]
    bad += [f"{p['name']}: sha256 differs (a damaged copy)" for p in m["parts"]
            if (src / p["name"]).is_file() and sha256(src / p["name"]) != p["sha256"]]  # fmt: skip
    if bad:
        sys.exit(f"{src}: cannot join {m['file']}:\n  " + "\n  ".join(bad))
    out = out or src / m["file"]
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    with open(tmp, "wb") as f:
        for n in names:
            f.write((src / n).read_bytes())
    if sha256(tmp) != m["sha256"]:
        tmp.unlink()
        sys.exit(f"{out}: the joined file's sha256 differs from the manifest")
    os.replace(tmp, out)
    print(f"{out}: {m['size']} bytes, sha256 {m['sha256']} (matches)")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheelhouse")
    w.add_argument("lock", type=Path)
    w.add_argument("dest", type=Path)
    s = sub.add_parser("split")
    s.add_argument("file", type=Path)
    s.add_argument("dest", type=Path)
    s.add_argument("--size", type=int, default=40_000_000)
    j = sub.add_parser("join")
    j.add_argument("src", type=Path)
    j.add_argument("out", type=Path, nargs="?")
    c = sub.add_parser("complete")  # a GPU session's stage: all parts carried in yet?
    c.add_argument("src", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "wheelhouse":
        wheelhouse(a.lock, a.dest)
    elif a.cmd == "split":
        split(a.file, a.dest, a.size)
    elif a.cmd == "complete":
        manifest = a.src / MANIFEST
        sys.exit(not manifest.is_file() or bool(missing(a.src, json.loads(manifest.read_text()))))
    else:
        join(a.src, a.out)


if __name__ == "__main__":
    main()
