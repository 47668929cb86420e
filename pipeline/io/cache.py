"""Content-addressed stage cache: <root>/<stage>/<key>/ holds one complete stage output.

The key is the SHA-256 of the stage's inputs (input hashes, resolved recipe, library
versions) in canonical JSON. An entry is written to a temp dir beside its final name and
renamed when complete (fsutil.atomic_dir), with `stage.json` (the stage's record) as the
last file written, so a killed stage leaves no entry that a later run could take for done.

Two processes on one cache (two CI jobs, a recipe sweep) build an entry once: the builder
holds an exclusive lock (`<root>/.locks/<stage>-<key>.lock`, flock: released by the
kernel when the holder dies), the other waits and then takes the finished entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import log
from ..errors import TransientError
from .atomic import atomic_dir, remove_stale_partials

RECORD = "stage.json"
_VERSIONED = ("qship", "torch", "transformers", "llmcompressor", "compressed-tensors", "lm-eval")


def library_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stage_key(stage: str, inputs: dict[str, Any], *, versions: bool = True) -> str:
    payload = {"stage": stage, "inputs": inputs}
    if versions:
        payload["versions"] = library_versions()
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Entry:
    path: Path  # the entry directory; the stage's files live inside it
    record: dict  # what the stage wrote to stage.json
    hit: bool  # True when taken from the cache without running the stage


class StageCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def entry_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, stage: str, key: str) -> Entry | None:
        d = self.entry_dir(stage, key)
        rec = d / RECORD
        if not rec.is_file():
            return None
        try:
            return Entry(d, json.loads(rec.read_text()), True)
        except (OSError, ValueError):
            return None  # unreadable record: treat as absent, the build replaces it

    def get_or_build(
        self, stage: str, key: str, build: Callable[[Path], dict], *, force: bool = False
    ) -> Entry:
        """Return the cached entry, or run build(tmpdir) -> record and store it atomically
        (once, when several processes ask at the same time)."""
        if not force and (hit := self.lookup(stage, key)):
            return hit
        with entry_lock(self.root / ".locks" / f"{stage}-{key}.lock", what=f"{stage} {key}"):
            if not force and (hit := self.lookup(stage, key)):
                return hit  # built by the process we waited for
            parent = self.root / stage
            remove_stale_partials(parent)
            final = self.entry_dir(stage, key)
            with atomic_dir(final, replace=True) as tmp:
                record = build(tmp)
                (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        return Entry(final, record, False)


@contextlib.contextmanager
def entry_lock(path: Path, *, what: str) -> Iterator[None]:
    """An exclusive flock on `path`; waits (with a message) while another process holds
    it, at most $QSHIP_LOCK_TIMEOUT seconds (default 24 h), then exit 5."""
    path.parent.mkdir(parents=True, exist_ok=True)
    limit = float(os.environ.get("QSHIP_LOCK_TIMEOUT", str(24 * 3600)))
    with open(path, "a+") as fh:
        t0 = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                if not told:
                    log.info(f"  waiting: {holder} is building cache entry {what}", style="dim")
                    told = True
                if time.monotonic() - t0 > limit:
                    raise TransientError(
                        f"cache entry {what} has been locked by {holder} for {limit:.0f} s",
                        path=str(path),
                        hint="wait for that run to finish, or stop it; a lock dies with "
                        "its process (raise QSHIP_LOCK_TIMEOUT to wait longer)",
                    ) from None
                time.sleep(0.2)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"qship pid {os.getpid()} on {socket.gethostname()}")
            fh.flush()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
