"""Artifact, Provenance and PublishResult: what package and publish hand on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..io.hashing import FileDigest
from .base import SCHEMA_VERSION, Record
from .checkpoint import PeakMemory
from .perf import ServedPerf, perf_lines
from .served import LongContextCheck, ServedCheck
from .tokens import TokenSetInfo


class SourceProvenance(Record):
    spec: str
    """The source as resolved (a local folder or file: `local:<name>`, its hashes in `files`)."""
    repo_id: str | None
    """Repository (or local/, gguf/, pypi/ name)."""
    revision: str | None
    """Commit, package version or `local`."""
    model_hash: str
    """The source model's identity."""
    manifest: str | None
    """The pin it was checked against."""
    pin_status: str
    """pinned, pinned-now or unpinned."""
    license: str | None = None
    """The license the source declares."""
    files: dict[str, FileDigest]
    """Every source file with its sha256 and size."""
    checks: dict[str, Any] = {}
    """Source-specific checks (LFS hashes, the GGUF's pin)."""


class RecipeRef(Record):
    name: str
    """The recipe's name."""
    hash: str
    """Recipe.hash(): sha256 of the resolved recipe's canonical JSON (recipe.yaml in the
    artifact is that resolved recipe)."""


class QuantizeProvenance(Record):
    key: str | None
    """The quantize entry's key in the stage cache."""
    seconds: float
    """Wall time of quantize."""
    device: str
    """Where it was quantized."""
    mode: str
    """qship defaults or bare llm-compressor defaults."""
    modifiers: list[str]
    """The llm-compressor modifiers, in order."""
    peak_memory: PeakMemory
    """Peak memory per phase."""


class QshipVersion(Record):
    version: str
    """qship's package version."""
    git_commit: str | None
    """The qship commit it ran from (null outside a git checkout)."""
    dirty: bool | None
    """Uncommitted changes under pipeline/ when it ran."""


class Provenance(Record):
    schema_version: int = SCHEMA_VERSION
    """Version of this record's layout."""
    name: str
    """The artifact's name: <base model>-<recipe>."""
    source: SourceProvenance | None
    """The fetched model (null when packaged by hand from a folder without a fetch record)."""
    recipe: RecipeRef
    """The resolved recipe (recipe.yaml in the artifact)."""
    calibration: TokenSetInfo
    """The calibration and held-out token sets."""
    quantize: QuantizeProvenance
    """How quantize ran."""
    quantized_checkpoint: dict[str, FileDigest]
    """The files of the quantized checkpoint that was packaged."""
    library_versions: dict[str, str]
    """Versions of torch, transformers, llm-compressor, compressed-tensors, lm-eval and others."""
    qship: QshipVersion
    """The qship that made it."""
    verdict_passed: bool
    """The gate passed (publish refuses otherwise)."""
    quantized_model_hash: str | None = None
    """`model_hash` of the artifact's own model files (weights, config, tokenizer) as
    packaged; `qship verify` recomputes it, so weights edited and re-summed fail (null:
    packaged before qship recorded it, which verify refuses)."""
    records: dict[str, str] = {}
    """sha256 of the artifact's eval.json, README.md (the model card) and recipe.yaml as
    packaged; `qship verify` compares them, so a record edited and re-summed fails."""
    served: ServedCheck | None = None
    """The served-artifact check's figures, when the recipe's `serve:` gate ran."""
    timings: dict[str, float] = {}
    """Empty in artifacts: the seconds per stage, like the start and end times, are in the
    SLSA statement's run details (attestation/provenance.json), outside SHA256SUMS, so
    that two builds of the same inputs give the same files."""


class Artifact(Record):
    path: Path
    """The artifact folder."""
    files: dict[str, str]
    """Relative path -> sha256, as SHA256SUMS lists them."""
    shards: list[str]
    """Weight files, in order."""
    signed: bool
    """model.sig was written."""
    passed: bool
    """The gate's verdict."""
    timings: dict[str, float] = {}
    """Seconds per packaging step."""

    def summary(self) -> str:
        s = "signed" if self.signed else "unsigned"
        return (
            f"artifact {self.path}: {len(self.files)} files, {len(self.shards)} weight "
            f"shard(s), {s}, gate {'PASSED' if self.passed else 'FAILED'}"
        )


class PublishResult(Record):
    target: str
    """file:// registry or hf:// repository."""
    name: str
    """Name in the registry."""
    version: str
    """Version in the registry (content-addressed by default)."""
    location: str
    """Where it now is."""
    status: Literal["published", "unchanged"]
    """published, or unchanged (the same content was already there)."""
    commit_message: str
    """Names the recipe and the verdict."""
    commit_url: str | None = None
    """The Hub commit (hf:// targets)."""

    def summary(self) -> str:
        return f"{self.status}: {self.name} {self.version} -> {self.location}"


class VerifyReport(Record):
    path: str
    """The artifact verified."""
    ok: bool = True
    """Every check passed (a failure raises instead)."""
    files: int
    """Files in the artifact."""
    tensors: int
    """Tensors checked against config.json."""
    signature: Literal["absent", "present-unverified", "verified"]
    """model.sig: absent, present-unverified (no key given) or verified."""
    attestation_signature: Literal["absent", "present-unverified", "verified"] = "absent"
    """The in-toto statements' Sigstore bundles (attestation/*.sigstore.json): absent,
    present-unverified (no key or chain given) or verified."""
    load: Literal["skipped", "matched"]
    """matched when --load ran the probe."""
    checks: list[str]
    """What was checked and held."""
    warnings: list[str] = []
    """What was not checked and why."""
    served: ServedCheck | None = None
    """`--serve ENGINE`: the artifact as that engine serves it vs the measured model."""
    served_perf: ServedPerf | None = None
    """`--perf`: served speed and memory beside the 16-bit reference, same run, same GPU."""
    long_context: LongContextCheck | None = None
    """`--serve` with the recipe's serve.long_context and `--reference`: retrieval at long
    context, artifact as served vs the reference."""

    def summary(self) -> str:
        lines = [f"verify {self.path}: OK ({self.files} files, {self.tensors} tensors)"]
        lines += [f"  ✓ {c}" for c in self.checks]
        lines += [f"  ! {w}" for w in self.warnings]
        if self.served is not None:
            lines.append("  " + self.served.summary().replace("\n", "\n  "))
        if self.served_perf is not None:
            lines += ["  " + ln for ln in perf_lines(self.served_perf)]
        if self.long_context is not None:
            lines.append("  " + self.long_context.summary().replace("\n", "\n  "))
        return "\n".join(lines)
