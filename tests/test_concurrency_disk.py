"""Two processes on one cache, and a full disk.

* StageCache builds an entry once when two processes ask for it at the same moment (the
  second waits on the entry's lock, then takes the finished entry).
* Three `qship run` at the same time on one cache (two with the same recipe, one with
  another) all succeed with the same shared entries, and nothing half-written is left.
* A file-size limit (RLIMIT_FSIZE, what a full disk looks like to a writer) during
  quantize or package: exit 5 naming the file, no artifact, no cache entry or partial
  left; the same command passes once the limit is gone, re-using the cache.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from factories import RECIPE, recipe  # noqa: F401  (RECIPE: the recipe() base)

ROOT = Path(__file__).resolve().parent.parent
TRANSIENT = 5


def qship_proc(*args: str, fsize: int | None = None) -> subprocess.Popen:
    def limit() -> None:  # in the child: writes past `fsize` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args, "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=limit if fsize else None,
    )  # fmt: skip


def result(p: subprocess.Popen) -> tuple[int, dict]:
    out, err = p.communicate(timeout=600)
    return p.returncode, (json.loads(out) if out.strip() else {"stderr": err[-3000:]})


def partials(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".partial-" in p.name or ".old-" in p.name]


def test_stage_cache_builds_once_for_two_processes(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from pipeline.io.cache import StageCache
        def build(tmp):
            with open({str(tmp_path / "builds.log")!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(1.5)
            (tmp / "x").write_text("done")
            return {{"by": os.getpid()}}
        e = StageCache(Path({str(tmp_path / "cache")!r})).get_or_build("s", "k", build)
        print(e.record["by"], e.hit, (e.path / "x").read_text())
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    builders = (tmp_path / "builds.log").read_text().split()
    assert len(builders) == 1, builders  # built once
    lines = [o.split() for o, _ in outs]
    assert {ln[0] for ln in lines} == set(builders) and {ln[2] for ln in lines} == {"done"}
    assert sorted(ln[1] for ln in lines) == ["False", "True"]  # one built, one waited
    assert partials(tmp_path / "cache") == []


def test_three_runs_at_once_on_one_cache(tmp_path, tiny_llama):
    cache = tmp_path / "cache"
    r4, r8 = recipe(tmp_path, "rtn4"), recipe(tmp_path, "rtn8", bits=8)
    jobs = {
        "a": r4,
        "b": r4,  # the same recipe: one builds quantize, the other waits and takes it
        "c": r8,
    }
    procs = {
        name: qship_proc(
            "run",
            "--model",
            str(tiny_llama),
            "--recipe",
            str(r),
            "--out",
            str(tmp_path / name),
            "--cache-dir",
            str(cache),
            "--device",
            "cpu",
        )  # fmt: skip
        for name, r in jobs.items()
    }
    res = {name: result(p) for name, p in procs.items()}
    assert all(rc == 0 for rc, _ in res.values()), res
    weights = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in jobs}
    assert weights["a"] == weights["b"] != weights["c"]
    for stage in ("fetch", "tokens", "quantize"):
        n = len(list((cache / stage).glob("*/stage.json")))
        assert n == (2 if stage == "quantize" else 1), (stage, n)
    assert partials(cache) == [] and partials(tmp_path) == []


@pytest.mark.parametrize("where", ["quantize", "package"])
def test_full_disk_leaves_nothing_and_the_rerun_passes(tmp_path, tiny_llama, where):
    cache, r = tmp_path / "cache", recipe(tmp_path, "rtn4")
    args = ["run", "--model", str(tiny_llama), "--recipe", str(r), "--cache-dir", str(cache),
            "--device", "cpu"]  # fmt: skip
    # fill the cache up to the stage before: fetch and tokens (quantize), or everything
    # but the artifact (package: a first run to another folder)
    warm = ["fetch", str(tiny_llama), "--cache-dir", str(cache)] if where == "quantize" else [
        *args, "--out", str(tmp_path / "first")]  # fmt: skip
    rc, out = result(qship_proc(*warm))
    assert rc == 0, out
    # the smallest limit that lets the cached inputs be read and small records written,
    # and that the quantized weights (about 1 MB) cannot fit
    art = tmp_path / "art"
    rc, err = result(qship_proc(*args, "--out", str(art), fsize=200_000))
    assert rc == TRANSIENT, err
    assert err["error"] == "DiskFull" and "no space left" in err["message"], err
    assert "run the same command again" in err["hint"]
    assert (str(art) if where == "package" else str(cache / "quantize")) in err["path"], err
    assert not art.exists()
    if where == "quantize":
        assert not list((cache / "quantize").glob("*/stage.json"))
    assert partials(cache) == [] and partials(tmp_path) == []
    rc, ok = result(qship_proc(*args, "--out", str(art)))
    assert rc == 0 and Path(ok["artifact"]) == art, ok
