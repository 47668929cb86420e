"""The package stage: a QuantizedCheckpoint + its EvalReport and Verdict -> an Artifact.

The artifact directory (complete or absent: built in a temp dir beside `out` by
io.atomic.atomic_dir, fsynced, renamed; a killed run leaves only a dot-named `.partial-`
folder that the next run removes):

    model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
    config.json, generation_config.json, tokenizer files   (copied byte for byte)
    recipe.yaml      the resolved recipe (its hash is Recipe.hash())
    eval.json        EvalFile: the evaluation, the verdict, the quantize figures, the probe
    provenance.json  Provenance: source, hashes, calibration, versions, qship commit, timings
    README.md        the model card (model_card.py)
    bom.cdx.json     CycloneDX 1.6 ML-BOM over the files above and the inputs (bom.py)
    qship/measured.safetensors  the held-out ids and measured top-k log-probs that
                     `qship verify --serve` compares a serving engine with (when evaluated
                     with evaluation.measured_topk > 0)
    SHA256SUMS       coreutils format over every file above
    attestation/     in-toto statements over those files (attestation.py): SLSA provenance
                     v1 and qship's results, with Sigstore bundles when signed
    model.sig        optional OpenSSF model-signing signature over all of the above

Determinism: the same inputs give byte-identical files, SHA256SUMS included; only the
attestation/ folder (its run details' times and seconds) and the signatures (ECDSA is
randomized) differ. The artifact passes verify's checks before it gets its final name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ..errors import UsageError
from ..io.atomic import atomic_dir, remove_stale_partials
from ..io.hashing import format_sha256sums, hash_files, sha256_file
from ..model.checkpoint import text_config
from ..model.files import CONFIG_FILES, TOKENIZER_FILES, TOKENIZER_KEYS
from ..recipe import Recipe
from ..records.artifact import Artifact
from ..records.checkpoint import QuantizedCheckpoint
from ..records.evaluation import EvalFile, EvalReport
from ..records.snapshot import Snapshot
from ..records.verdict import Verdict
from . import attestation, attestation_check, bom, model_card
from .probe import fingerprint, probe_ids
from .provenance import PROVENANCE, build_provenance
from .signing import sign_artifact
from .verify import SUMS, check_cross, check_records, check_sums, check_weights
from .weights import DEFAULT_SHARD_SIZE, source_weights, write_weights

COPIED = (*CONFIG_FILES, *TOKENIZER_FILES)
# beside the weights but not at the top level: engines load every top-level *.safetensors
MEASURED_IN_ARTIFACT = "qship/measured.safetensors"


def artifact_name(source: Snapshot | None, recipe: Recipe, fallback: str) -> str:
    """<base model>-<recipe>, from the inputs (not from --out: any --out gives the same bytes)."""
    base = source.repo_id if source else None
    return f"{str(base).rstrip('/').rsplit('/', 1)[-1]}-{recipe.name}" if base else fallback


def package(
    *,
    checkpoint: QuantizedCheckpoint,
    recipe: Recipe,
    evaluation: EvalReport,
    verdict: Verdict,
    out: Path,
    source: Snapshot | None = None,
    quantize_key: str | None = None,
    timings: dict[str, float] | None = None,
    sign_key: Path | None = None,
    sign_password: str | None = None,
    sign_cert: Path | None = None,
    cert_chain: tuple[Path, ...] = (),
    shard_size: int = DEFAULT_SHARD_SIZE,
    probe: bool = True,
    overwrite: bool = False,
) -> Artifact:
    """Build the artifact at `out` (see the module docstring).

    probe=False skips the load-probe fingerprint (it loads the model in float32 on CPU,
    which a large model may not fit); `verify --load` then has nothing to compare with.
    """
    t_start = time.perf_counter()
    # the run began when its first stage did: the stages' seconds before packaging
    started = datetime.now(UTC) - timedelta(seconds=sum((timings or {}).values()))
    steps: dict[str, float] = {}
    model_dir, out = Path(checkpoint.path), Path(out)
    if not model_dir.is_dir():
        raise UsageError("quantized checkpoint folder not found", path=str(model_dir))
    if shard_size <= 0:
        raise UsageError(f"shard_size must be positive, got {shard_size}", path="--shard-size")
    if sign_key is not None and not Path(sign_key).is_file():
        raise UsageError("signing key not found", path=str(sign_key))
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise UsageError(
            "config.json has no quantization_config: not a quantized checkpoint",
            path=str(model_dir / "config.json"),
            hint="package the output of `qship quantize`",
        )
    headers = source_weights(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_KEYS):
        raise UsageError(
            f"no tokenizer in the model directory (expected one of {list(TOKENIZER_KEYS)})",
            path=str(model_dir),
            hint="save the tokenizer next to the quantized weights (tokenizer.save_pretrained)",
        )
    if out.exists() and not overwrite:
        raise UsageError(
            "output already exists; an artifact is never overwritten silently",
            path=str(out),
            hint="choose another --out, or delete the old artifact first",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent)
    inputs = hash_files(
        model_dir,
        [p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")],
    )
    steps["inputs_s"] = round(time.perf_counter() - t_start, 3)
    name = artifact_name(source, recipe, out.name)

    with atomic_dir(out, replace=overwrite) as tmp:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; an artifact is for others too
        t = time.perf_counter()
        shards = write_weights(model_dir, headers, tmp, shard_size)
        steps["weights_s"] = round(time.perf_counter() - t, 3)
        for fname in COPIED:
            if (model_dir / fname).is_file():
                shutil.copyfile(model_dir / fname, tmp / fname)
        (tmp / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")

        t = time.perf_counter()
        vocab = text_config(config).get("vocab_size")
        fp = None
        if probe:
            fp = fingerprint(tmp, probe_ids(model_dir, vocab if isinstance(vocab, int) else None))
        steps["probe_s"] = round(time.perf_counter() - t, 3)
        if evaluation.measured is not None:
            (tmp / MEASURED_IN_ARTIFACT).parent.mkdir()
            shutil.copyfile(evaluation.measured.file, tmp / MEASURED_IN_ARTIFACT)
            measured = evaluation.measured.model_copy(update={"file": MEASURED_IN_ARTIFACT})
            evaluation = evaluation.model_copy(update={"measured": measured})
        ev = portable(EvalFile.of(evaluation, verdict=verdict, quantize=checkpoint.brief(),
                                  probe=fp))  # fmt: skip
        (tmp / "eval.json").write_text(json.dumps(ev.to_json(), indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(
            model_card.render(
                name=name,
                source=source,
                recipe=recipe,
                dense_bytes=checkpoint.plan.params.dense_bytes,
                dtype=checkpoint.plan.dtype,
                quantization_config=qc,
                evaluation=ev,
            ),
            encoding="utf-8",
        )
        rels = [p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()]
        digests = hash_files(tmp, rels)  # everything but provenance.json and SHA256SUMS
        steps["package_s"] = round(time.perf_counter() - t_start, 3)
        prov = build_provenance(
            name=name,
            source=source,
            recipe=recipe,
            checkpoint=checkpoint,
            checkpoint_files=inputs,
            verdict_passed=verdict.passed,
            quantize_key=quantize_key,
            served=evaluation.served,
            artifact_files=digests,
        )
        (tmp / PROVENANCE).write_text(json.dumps(prov.to_json(), indent=2, sort_keys=True) + "\n")
        digests[PROVENANCE] = sha256_file(tmp / PROVENANCE)
        written = {r: d.sha256 for r, d in sorted(digests.items())}
        (tmp / bom.BOM).write_text(bom.build(written, name=name, prov=prov, ckpt=checkpoint, ev=ev))
        sums = {**written, bom.BOM: sha256_file(tmp / bom.BOM).sha256}
        sums = dict(sorted(sums.items()))
        (tmp / SUMS).write_text(format_sha256sums(sums))
        # the artifact must pass its own gate before it may exist under its final name
        checks: list[str] = []
        check_sums(tmp, checks)
        check_records(tmp, checks)
        check_weights(tmp, checks)
        check_cross(tmp, sums, checks)
        attestation.write(tmp, sums, prov=prov, recipe=recipe, ev=ev, started=started,
                          timings={**(timings or {}), **{f"package.{k}": v for k, v in steps.items()}})  # fmt: skip
        attestation_check.check(tmp, sums, prov=prov, ev=ev, checks=checks)
        if sign_key is not None:
            key = attestation.SigningKey(
                Path(sign_key), sign_password, sign_cert, tuple(cert_chain)
            )
            attestation.sign(tmp, key)
            sign_artifact(tmp, Path(sign_key), sign_password)
    return Artifact(
        path=out,
        files=sums,
        shards=shards,
        signed=sign_key is not None,
        passed=verdict.passed,
        timings=steps,
    )


def portable(ev: EvalFile) -> EvalFile:
    """eval.json as the artifact carries it: no path of the building machine. The candidate
    is the artifact itself (`.`); the reference and its cached log-probs are named by what
    identifies them (the model hash, the cache key), not where they were."""
    update: dict = {"candidate": ev.candidate.model_copy(update={"path": Path(".")}),
                    "reference": ev.reference.model_copy(
                        update={"path": Path(f"model-hash-{ev.reference.model_hash[:16]}")})}  # fmt: skip
    if ev.reference_cache is not None:
        update["reference_cache"] = ev.reference_cache.model_copy(
            update={"path": Path(f"reference/{ev.reference_cache.key}")})  # fmt: skip
    return ev.model_copy(update=update)
