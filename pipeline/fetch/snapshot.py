"""Building a snapshot in the stage cache, and every check it must pass before it exists.

Each source (local.py, hub.py, gguf.py) gives `from_cache` a build function that copies
the files into the entry while hashing them and ends with `finish`: the consistency checks
that need no pin (safetensors headers fit their files, the index lists exactly the shards,
config.json is there), then the pin `checksums/<org>--<name>@<revision>.json`. When a pin
exists any difference fails closed (IntegrityError, exit 3) naming the file, the expected
and the actual hash; `pin=True` writes a missing pin. The entry is renamed into place only
after every check passed, so a failed fetch leaves nothing a later run could take for
verified; a cache hit is re-hashed before it is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import log
from ..errors import IntegrityError
from ..io.cache import StageCache
from ..io.hashing import FileDigest, copy_hash_file, map_files
from ..io.pins import check_cached, fail_if, verify_against_pin
from ..io.safetensors_header import read_header
from ..model.files import model_hash
from ..records.snapshot import Snapshot

STAGE = "fetch"
SNAPSHOT_DIR = "model"  # inside the cache entry


def copy_and_hash(
    src_root: Path, rels: Iterable[str], dst_root: Path, *, label: str = "copy"
) -> dict[str, FileDigest]:
    """Copy files (symlinks dereferenced) and hash the bytes as they are written, in
    parallel threads; returns relpath -> digest of what landed in dst_root."""
    rels = sorted(rels)
    total = sum((Path(src_root) / r).stat().st_size for r in rels)
    with log.Progress(label, total, nbytes=True) as bar:

        def one(rel: str, on_bytes: Callable[[int], None]) -> FileDigest:
            dst = Path(dst_root) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            return copy_hash_file(Path(src_root) / rel, dst, on_bytes=on_bytes)

        workers = min(len(rels), os.cpu_count() or 1) or 1
        digests = map_files(one, rels, workers=workers, on_bytes=bar.advance)
        return dict(zip(rels, digests, strict=True))


def check_consistency(snap_dir: Path, files: dict[str, FileDigest]) -> list[str]:
    """Checks that need no pin: safetensors headers fit their files (catches truncation),
    the index lists exactly the shards present, config.json is there."""
    problems = []
    shards = sorted(r for r in files if r.endswith(".safetensors"))
    for rel in shards:
        try:
            read_header(snap_dir / rel)
        except IntegrityError as e:
            problems.append(f"{rel}: malformed or truncated safetensors ({e.message}); "
                            f"sha256 {files[rel].sha256}, {files[rel].size} bytes")  # fmt: skip
    for index in (r for r in files if r.endswith(".safetensors.index.json")):
        try:
            listed = set(json.loads((snap_dir / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{index}: unreadable index ({e})")
            continue
        prefix = index.rsplit("/", 1)[0] + "/" if "/" in index else ""
        present = {r[len(prefix) :] for r in shards if r.startswith(prefix)}
        for m in sorted(listed - present):
            problems.append(f"{prefix}{m}: weight shard listed in {index} is missing")
        for x in sorted(present - listed):
            problems.append(f"{prefix}{x}: extra weight shard not listed in {index}")
    if "config.json" not in files:
        problems.append("config.json: missing")
    return problems


@dataclass(frozen=True)
class Origin:
    """Where a snapshot came from, as its record and its pin name it."""

    source: str
    """The source as given (hf://org/name@commit, a folder, pypi:...)."""
    repo_id: str | None
    revision: str | None
    license: str | None = None


def finish(
    out: Path,
    files: dict[str, FileDigest],
    *,
    origin: Origin,
    manifest_path: Path,
    pin: bool,
    checks: dict[str, Any],
    key: str,
    require_pin: bool = False,
) -> dict:
    """Every check on a built snapshot; returns the cache record (its path relative)."""
    source, repo_id, revision = origin.source, origin.repo_id, origin.revision
    fail_if(
        check_consistency(out, files),
        where=source,
        what="snapshot is not a consistent checkpoint",
        hint="re-fetch it; a truncated or partial copy must not be used",
    )
    status, mpath = verify_against_pin(
        files, manifest_path, pin=pin, source=source, repo_id=repo_id, revision=revision,
        require_pin=require_pin,
    )  # fmt: skip
    snap = Snapshot(
        path=Path(SNAPSHOT_DIR),
        source=source,
        repo_id=repo_id,
        revision=revision,
        files=files,
        manifest=mpath,
        model_hash=model_hash(files),
        pin_status=status,
        license=origin.license,
        checks=checks,
        cache_key=key,
    )
    return {"snapshot": snap.to_json()}


def from_cache(cache_dir: Path, key: str, build: Callable[[Path], dict]) -> Snapshot:
    """Build (atomically) or take the entry; a cache hit is re-hashed before it is used."""
    # verify=False: the snapshot's files are re-hashed against its record (and pin) below
    entry = StageCache(Path(cache_dir)).get_or_build(STAGE, key, build, verify=False)
    rec = Snapshot.from_json(entry.record["snapshot"], where=str(entry.path), error=IntegrityError)
    snap = rec.model_copy(update={"path": entry.path / rec.path, "cache_hit": entry.hit})
    if entry.hit:
        check_cached(snap.path, dict(snap.files), where=str(entry.path))
    return snap
