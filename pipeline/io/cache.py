"""Content-addressed stage cache: <root>/<stage>/<key>/ holds one complete stage output.

The key is the SHA-256 of the stage's inputs (input hashes, resolved recipe, library
versions) in canonical JSON. An entry is written to a temp dir beside its final name and
renamed when complete (fsutil.atomic_dir), with `stage.json` (the stage's record) as the
last file written, so a killed stage leaves no entry that a later run could take for done.

Two processes on one cache (two CI jobs, a recipe sweep) build an entry once: the builder
holds an exclusive lock (`<root>/.locks/<stage>-<key>.lock`, flock: released by the
kernel when the holder dies), the other waits and then takes the finished entry.

A hit is verified before it is used: every entry stores the sha256 of each file it wrote,
stage.json included (`files.sha256`, coreutils format, written just before stage.json), and
a hit re-hashes them (streaming, io.hashing). An entry that fails -- a file altered,
truncated, added or removed, or no digests at all (an entry of an older qship) -- is a
miss: rebuilt, with a warning naming it; with `strict` (--require-pin) a digest mismatch is
an integrity failure (exit 3). Stages that re-check their own files against a pin (fetch,
the benchmark data) pass verify=False.
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
from ..errors import IntegrityError, TransientError
from .atomic import atomic_dir, remove_stale_partials
from .hashing import format_sha256sums, hash_files, list_files, parse_sha256sums

RECORD = "stage.json"
DIGESTS = "files.sha256"
NO_DIGESTS = "has no readable file digests (written by an older qship)"
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
    def __init__(self, root: Path, *, strict: bool = False):
        self.root = Path(root)
        self.strict = strict  # a hit that fails its digests: exit 3 instead of a rebuild

    def entry_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, stage: str, key: str, *, verify: bool = True) -> Entry | None:
        d = self.entry_dir(stage, key)
        rec = d / RECORD
        if not rec.is_file():
            return None
        try:
            record = json.loads(rec.read_text())
        except (OSError, ValueError):
            return None  # unreadable record: treat as absent, the build replaces it
        if verify and (why := self._unverified(d)):
            where = f"{stage}/{key}"
            # strict: an entry that fails its digests is evidence; one written before qship
            # recorded digests is only old, and is rebuilt like any miss
            if self.strict and why != NO_DIGESTS:
                raise IntegrityError(f"cache entry {where} {why}", path=str(d),
                                     hint=f"delete {d} and run again; find out who altered it")  # fmt: skip
            log.info(f"  ! cache entry {where} {why}: not used, rebuilt", style="yellow")
            return None
        return Entry(d, record, True)

    @staticmethod
    def _unverified(d: Path) -> str | None:
        """Why the entry's files cannot be trusted, or None when they match their digests."""
        try:
            want = parse_sha256sums((d / DIGESTS).read_bytes(), where=str(d / DIGESTS))
        except (OSError, IntegrityError):
            return NO_DIGESTS
        have = set(list_files(d)) - {DIGESTS}
        if have != set(want):
            extra, gone = sorted(have - set(want)), sorted(set(want) - have)
            return f"has other files than it was written with (extra {extra}, missing {gone})"
        got = hash_files(d, sorted(want))
        bad = sorted(r for r, dg in got.items() if dg.sha256 != want[r])
        return f"fails its sha256 ({', '.join(bad[:5])})" if bad else None

    def get_or_build(
        self, stage: str, key: str, build: Callable[[Path], dict], *, force: bool = False,
        verify: bool = True,
    ) -> Entry:  # fmt: skip
        """Return the cached entry (its files re-checked against their digests unless
        `verify` is off), or run build(tmpdir) -> record and store it atomically (once,
        when several processes ask at the same time)."""
        if not force and (hit := self.lookup(stage, key, verify=verify)):
            return hit
        with entry_lock(self.root / ".locks" / f"{stage}-{key}.lock", what=f"{stage} {key}"):
            if not force and (hit := self.lookup(stage, key, verify=verify)):
                return hit  # built by the process we waited for
            parent = self.root / stage
            remove_stale_partials(parent)
            final = self.entry_dir(stage, key)
            with atomic_dir(final, replace=True) as tmp:
                record = build(tmp)
                text = json.dumps(record, indent=2, sort_keys=True, default=str)
                rels = [r for r in list_files(tmp) if r not in (RECORD, DIGESTS)]
                sums = {r: dg.sha256 for r, dg in hash_files(tmp, rels).items()}
                sums[RECORD] = hashlib.sha256(text.encode()).hexdigest()  # the record too
                (tmp / DIGESTS).write_text(format_sha256sums(sums))
                (tmp / RECORD).write_text(text)
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
