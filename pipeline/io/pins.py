"""Pins: the sha256 manifests in checksums/ that every input is checked against.

`verify_against_pin` compares what was fetched with its pin (any difference: exit 3,
naming each file) or writes a missing pin when asked; `check_cached` re-hashes a cache
entry before it is reused, so a file altered after it was verified is never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..errors import IntegrityError
from .atomic import atomic_write_text
from .hashing import FileDigest, Manifest, compare_digests, hash_files, list_files

PinStatus = Literal["pinned", "pinned-now", "unpinned"]


def fail_if(problems: list[str], *, where: str, what: str, hint: str) -> None:
    if problems:
        raise IntegrityError(
            f"{what}: {len(problems)} problem(s):\n    " + "\n    ".join(problems),
            path=where,
            hint=hint,
        )


def verify_against_pin(
    files: dict[str, FileDigest],
    manifest_path: Path,
    *,
    pin: bool,
    source: str,
    repo_id: str | None,
    revision: str | None,
) -> tuple[PinStatus, str | None]:
    """-> (pin_status, manifest path or None). Any mismatch with an existing pin: exit 3."""
    if manifest_path.is_file():
        expected = Manifest.load(manifest_path).files
        fail_if(
            compare_digests(expected, files, where=str(manifest_path)),
            where=str(manifest_path),
            what=f"{source} does not match its pinned manifest",
            hint="the download or the folder was altered (or the upstream changed): "
            "re-fetch from a trusted source; only re-pin after checking why it changed",
        )
        return "pinned", str(manifest_path)
    if pin:
        atomic_write_text(manifest_path, Manifest(source, repo_id, revision, dict(files)).dumps())
        return "pinned-now", str(manifest_path)
    return "unpinned", None


def check_cached(folder: Path, recorded: dict[str, Any], *, where: str) -> None:
    """Re-hash a cache entry's files against what was recorded when it was verified."""
    expected = {
        rel: d if isinstance(d, FileDigest) else FileDigest(str(d["sha256"]), int(d["size"]))
        for rel, d in recorded.items()
    }
    actual = hash_files(folder, list_files(folder))
    fail_if(
        compare_digests(expected, actual, where=where),
        where=where,
        what="the cache entry was altered after it was verified",
        hint=f"delete {where} and run again",
    )
