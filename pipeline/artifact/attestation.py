"""In-toto attestations of an artifact: `attestation/provenance.json` (SLSA provenance v1)
and `attestation/results.json` (qship's QuantResults predicate), both in-toto v1 statements
whose subjects are every file SHA256SUMS lists, and SHA256SUMS itself, by sha256.

The statements live outside SHA256SUMS (they name its digest, and their run details carry
the build's start and end times), so two builds of the same inputs give the same subjects.
Signed (`--sign-key`, optionally with `--sign-cert`/`--cert-chain`), each gets a Sigstore
bundle beside it (`<statement>.sigstore.json`): a DSSE envelope over the statement, made by
model-signing's own signers, the private-key and the certificate method. `check` is what
`qship verify` runs: the statements parse, their subjects are SHA256SUMS, the recipe hash is
recipe.yaml's, the results are eval.json's, and each bundle verifies and carries its
statement; any mismatch is an IntegrityError (exit 3) naming the file and the field.
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..compat import model_signing_1_1
from ..errors import UsageError
from ..io.hashing import sha256_bytes
from ..recipe import Recipe
from ..records.artifact import Provenance
from ..records.attestation import RESULTS_PREDICATE, QuantResults
from ..records.evaluation import EvalFile

ATTESTATION_DIR = "attestation"
PROVENANCE_STATEMENT = f"{ATTESTATION_DIR}/provenance.json"
RESULTS_STATEMENT = f"{ATTESTATION_DIR}/results.json"
STATEMENTS = (PROVENANCE_STATEMENT, RESULTS_STATEMENT)
BUNDLE = ".sigstore.json"  # beside its statement: provenance.json -> provenance.sigstore.json
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:qship:build:package:v1"
BUILDER_ID = "urn:qship:builder"
SUMS = "SHA256SUMS"
HINT = "do not deploy this artifact; re-package it (qship package) from its inputs"


def covered_by_sums(rel: str) -> bool:
    """False for the attestation files: they name SHA256SUMS, so it cannot name them."""
    return not rel.startswith(f"{ATTESTATION_DIR}/")


def present(root: Path) -> list[str]:
    """The attestation files root holds (relative paths, sorted): what ships beside
    SHA256SUMS's files."""
    names = [*STATEMENTS, *(bundle_of(r) for r in STATEMENTS)]
    return sorted(r for r in names if (root / r).is_file())


def bundle_of(statement: str) -> str:
    return statement.removesuffix(".json") + BUNDLE


@dataclass(frozen=True)
class SigningKey:
    """model-signing's key methods: a PEM EC private key, optionally with its certificate
    and the chain up to a root the verifier trusts."""

    private_key: Path
    password: str | None = None
    certificate: Path | None = None
    chain: tuple[Path, ...] = field(default_factory=tuple)


def subjects(root: Path, sums: dict[str, str]) -> list[dict[str, Any]]:
    """Every listed file and SHA256SUMS, sorted by name."""
    out = {rel: digest for rel, digest in sums.items()}
    out[SUMS] = sha256_bytes((root / SUMS).read_bytes())
    return [{"name": r, "digest": {"sha256": d}} for r, d in sorted(out.items())]


def machine() -> dict[str, Any]:
    """Where it was built: platform, CPU, GPU and driver when there is one (no host name)."""
    out: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                           "python": platform.python_version()}  # fmt: skip
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001 - a machine description never fails a build
        pass
    if "gpu" in out:
        try:
            res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
            out["driver"] = res.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            out["driver"] = None
    return out


def _dependencies(prov: Provenance, ev: EvalFile) -> list[dict[str, Any]]:
    deps: list[dict[str, Any]] = []
    src = prov.source
    if src is not None:
        where = f"{src.repo_id}@{src.revision}" if src.repo_id else src.spec
        deps += [{"name": f"source/{rel}", "uri": f"{where}#{rel}", "digest": {"sha256": d.sha256}}
                 for rel, d in sorted(src.files.items())]  # fmt: skip
    cal = prov.calibration
    deps += [
        {"name": "calibration-tokens", "digest": {"sha256": cal.calib_hash},
         "annotations": {"shape": list(cal.calib_shape), "corpus": cal.source}},
        {"name": "heldout-tokens", "digest": {"sha256": cal.heldout_hash},
         "annotations": {"shape": list(cal.heldout_shape)}},
        {"name": "corpus", "digest": {"sha256": cal.corpus_hash}},
    ]  # fmt: skip
    for task, res in sorted(ev.benchmarks.tasks.items()):
        if res.status == "ok":
            deps.append({"name": f"benchmark/{task}", "uri": f"urn:qship:data:{res.data or 'unknown'}",
                         "annotations": {"split": res.split, "items": res.n}})  # fmt: skip
    q = prov.qship
    deps.append({"name": "qship", "uri": f"pkg:pypi/qship@{q.version}",
                 **({"digest": {"gitCommit": q.git_commit}} if q.git_commit else {}),
                 "annotations": {"dirty": q.dirty}})  # fmt: skip
    deps += [{"name": f"library/{n}", "uri": f"pkg:pypi/{n}@{v}"}
             for n, v in sorted(prov.library_versions.items())]  # fmt: skip
    return deps


def slsa_predicate(prov: Provenance, recipe: Recipe, ev: EvalFile, *, started: datetime,
                   finished: datetime, timings: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """SLSA provenance v1: the recipe (hash and content) and the source as the external
    parameters, every input by its digest, the machine and the times as run details."""
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {
                "source": prov.source.spec if prov.source else None,
                "recipe": {
                    "name": recipe.name,
                    "sha256": recipe.hash(),
                    "content": recipe.resolved(),
                },  # fmt: skip
            },
            "internalParameters": {
                "quantize_key": prov.quantize.key,
                "mode": prov.quantize.mode,
                "modifiers": prov.quantize.modifiers,
                "device": prov.quantize.device,
            },  # fmt: skip
            "resolvedDependencies": _dependencies(prov, ev),
        },
        "runDetails": {
            "builder": {"id": BUILDER_ID, "version": {"qship": prov.qship.version}},
            "metadata": {"startedOn": _iso(started), "finishedOn": _iso(finished)},
            "byproducts": [
                {"name": "machine", "annotations": machine()},
                {"name": "timings", "annotations": timings},
            ],  # fmt: skip
        },
    }


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def statement(subs: list[dict[str, Any]], predicate_type: str, predicate: dict) -> dict[str, Any]:
    return {"_type": STATEMENT_TYPE, "subject": subs, "predicateType": predicate_type,
            "predicate": predicate}  # fmt: skip


def write(root: Path, sums: dict[str, str], *, prov: Provenance, recipe: Recipe, ev: EvalFile,
          started: datetime, timings: dict[str, float]) -> list[str]:  # fmt: skip
    """Write both statements under root/attestation/; their relative paths."""
    subs = subjects(root, sums)
    eval_sha = sums["eval.json"]
    slsa = slsa_predicate(prov, recipe, ev, started=started, finished=datetime.now(UTC),
                          timings=timings)  # fmt: skip
    results = QuantResults.of(ev, eval_sha).to_json()
    (root / ATTESTATION_DIR).mkdir(exist_ok=True)
    for rel, st in ((PROVENANCE_STATEMENT, statement(subs, SLSA_PREDICATE, slsa)),
                    (RESULTS_STATEMENT, statement(subs, RESULTS_PREDICATE, results))):  # fmt: skip
        (root / rel).write_text(json.dumps(st, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return list(STATEMENTS)


def _signer(key: SigningKey) -> Any:
    return model_signing_1_1.signer(key.private_key, key.password, key.certificate, key.chain)


class _Payload:
    """What model-signing's signers read: `.statement`, an in-toto Statement binding."""

    def __init__(self, data: dict[str, Any]):
        from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
        from in_toto_attestation.v1.statement import Statement

        subs = [ResourceDescriptor(name=s["name"], digest=s["digest"]).pb for s in data["subject"]]
        self.statement = Statement(subs, data["predicateType"], data["predicate"])
        self.statement.validate()


def sign(root: Path, key: SigningKey) -> list[str]:
    """A DSSE envelope (in a Sigstore bundle) over each statement; their relative paths."""
    try:
        signer = _signer(key)
        out = []
        for rel in STATEMENTS:
            data = json.loads((root / rel).read_text(encoding="utf-8"))
            signer.sign(_Payload(data)).write(root / bundle_of(rel))
            out.append(bundle_of(rel))
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(
            f"cannot sign the attestations with this key ({type(e).__name__}: {e})",
            path=str(key.certificate or key.private_key),
            hint="give a PEM elliptic-curve private key (P-256/384/521) and, for the "
            "certificate method, its certificate and chain",
        ) from e
    return out
