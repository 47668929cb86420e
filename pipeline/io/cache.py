"""Content-addressed stage cache: <root>/<stage>/<key>/ holds one complete stage output.

The key is the SHA-256 of the stage's inputs (input hashes, resolved recipe, library
versions) in canonical JSON. An entry is written to a temp dir beside its final name and
renamed when complete (fsutil.atomic_dir), with `stage.json` (the stage's record) as the
last file written, so a killed stage leaves no entry that a later run could take for done.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

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
        """Return the cached entry, or run build(tmpdir) -> record and store it atomically."""
        if not force and (hit := self.lookup(stage, key)):
            return hit
        parent = self.root / stage
        remove_stale_partials(parent)
        final = self.entry_dir(stage, key)
        with atomic_dir(final, replace=True) as tmp:
            record = build(tmp)
            (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        return Entry(final, record, False)
