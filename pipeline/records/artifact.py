"""Artifact, Provenance and PublishResult: what package and publish hand on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..io.hashing import FileDigest
from .base import SCHEMA_VERSION, Record
from .checkpoint import PeakMemory
from .tokens import TokenSetInfo


class SourceProvenance(Record):
    spec: str
    repo_id: str | None
    revision: str | None
    model_hash: str
    manifest: str | None
    pin_status: str
    license: str | None = None
    files: dict[str, FileDigest]
    checks: dict[str, Any] = {}


class RecipeRef(Record):
    name: str
    hash: str
    """Recipe.hash(): sha256 of the resolved recipe's canonical JSON (recipe.yaml in the
    artifact is that resolved recipe)."""


class QuantizeProvenance(Record):
    key: str | None
    """The quantize entry's key in the stage cache."""
    seconds: float
    device: str
    mode: str
    modifiers: list[str]
    peak_memory: PeakMemory


class QshipVersion(Record):
    version: str
    git_commit: str | None
    dirty: bool | None
    """Uncommitted changes under pipeline/ when it ran."""


class Provenance(Record):
    schema_version: int = SCHEMA_VERSION
    name: str
    """The artifact's name: <base model>-<recipe>."""
    source: SourceProvenance | None
    """The fetched model (null when packaged by hand from a folder without a fetch record)."""
    recipe: RecipeRef
    calibration: TokenSetInfo
    quantize: QuantizeProvenance
    quantized_checkpoint: dict[str, FileDigest]
    """The files of the quantized checkpoint that was packaged."""
    library_versions: dict[str, str]
    qship: QshipVersion
    verdict_passed: bool
    timings: dict[str, float] = {}
    """Seconds per stage; the only field that differs between two identical runs."""


class Artifact(Record):
    path: Path
    files: dict[str, str]
    """Relative path -> sha256, as SHA256SUMS lists them."""
    shards: list[str]
    signed: bool
    passed: bool
    timings: dict[str, float] = {}

    def summary(self) -> str:
        s = "signed" if self.signed else "unsigned"
        return (
            f"artifact {self.path}: {len(self.files)} files, {len(self.shards)} weight "
            f"shard(s), {s}, gate {'PASSED' if self.passed else 'FAILED'}"
        )


class PublishResult(Record):
    target: str
    name: str
    version: str
    location: str
    status: Literal["published", "unchanged"]
    commit_message: str
    commit_url: str | None = None

    def summary(self) -> str:
        return f"{self.status}: {self.name} {self.version} -> {self.location}"


class VerifyReport(Record):
    path: str
    ok: bool = True
    files: int
    tensors: int
    signature: Literal["absent", "present-unverified", "verified"]
    load: Literal["skipped", "matched"]
    checks: list[str]
    """What was checked and held."""
    warnings: list[str] = []

    def summary(self) -> str:
        lines = [f"verify {self.path}: OK ({self.files} files, {self.tensors} tensors)"]
        lines += [f"  ✓ {c}" for c in self.checks]
        lines += [f"  ! {w}" for w in self.warnings]
        return "\n".join(lines)
