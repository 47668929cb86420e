"""provenance.json: where an artifact came from -- the source and its hashes, the recipe,
the calibration data, how quantize ran, library versions and the qship commit."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

from ..io.cache import library_versions
from ..io.hashing import FileDigest
from ..model.files import model_hash
from ..recipe import Recipe
from ..records.artifact import (
    Provenance,
    QshipVersion,
    QuantizeProvenance,
    RecipeRef,
    SourceProvenance,
)
from ..records.checkpoint import QuantizedCheckpoint
from ..records.served import ServedCheck
from ..records.snapshot import Snapshot

PROVENANCE = "provenance.json"
# the artifact's own records, hashed into provenance.json at package time (verify compares)
RECORD_FILES = ("eval.json", "README.md", "recipe.yaml")

PIPELINE_DIR = Path(__file__).resolve().parents[1]


def qship_version() -> QshipVersion:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(PIPELINE_DIR), *args],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip()  # fmt: skip

    version = versions().get("qship", "absent")
    try:
        rev = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".")
        return QshipVersion(version=version, git_commit=rev, dirty=bool(dirty))
    except (OSError, subprocess.SubprocessError):
        return QshipVersion(version=version, git_commit=None, dirty=None)


def versions() -> dict[str, str]:
    out = library_versions()
    for name in ("safetensors", "huggingface_hub", "tokenizers", "model-signing"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return dict(sorted(out.items()))


def build_provenance(
    *,
    name: str,
    source: Snapshot | None,
    recipe: Recipe,
    checkpoint: QuantizedCheckpoint,
    checkpoint_files: dict[str, FileDigest],
    verdict_passed: bool,
    quantize_key: str | None = None,
    timings: dict[str, float] | None = None,
    served: ServedCheck | None = None,
    artifact_files: dict[str, FileDigest] | None = None,
) -> Provenance:
    """`artifact_files`: the digests of the artifact's files written so far (all but
    provenance.json and SHA256SUMS): its model hash and its records' hashes."""
    src = None
    if source is not None:
        src = SourceProvenance(
            # a local folder or file by its name: the builder's path means nothing elsewhere,
            # the file hashes below say what it was
            spec=f"local:{Path(source.source).name}"
            if Path(source.source).is_absolute()
            else source.source,
            repo_id=source.repo_id,
            revision=source.revision,
            model_hash=source.model_hash,
            manifest=source.manifest,
            pin_status=source.pin_status,
            license=source.license,
            files=source.files,
            checks=source.checks,
        )
    return Provenance(
        name=name,
        source=src,
        recipe=RecipeRef(name=recipe.name, hash=recipe.hash()),
        calibration=checkpoint.calibration,
        quantize=QuantizeProvenance(
            key=quantize_key,
            seconds=checkpoint.seconds,
            device=checkpoint.device,
            mode=checkpoint.mode,
            modifiers=checkpoint.modifiers,
            peak_memory=checkpoint.peak_memory,
        ),
        quantized_checkpoint=checkpoint_files,
        library_versions=versions(),
        qship=qship_version(),
        verdict_passed=verdict_passed,
        served=served,
        timings=timings or {},
        quantized_model_hash=model_hash(artifact_files) if artifact_files else None,
        records={r: d.sha256 for r, d in (artifact_files or {}).items() if r in RECORD_FILES},
    )
