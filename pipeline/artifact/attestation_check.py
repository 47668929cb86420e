"""`qship verify`'s checks of the attestations (attestation.py writes them): every problem
is an IntegrityError (exit 3) naming the file and the field, the expected and the actual."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from ..compat import model_signing_1_1
from ..errors import IntegrityError, QshipError, UsageError
from ..io.problems import Problems, read_json_object
from ..records.artifact import Provenance
from ..records.attestation import RESULTS_PREDICATE, QuantResults
from ..records.evaluation import EvalFile
from .attestation import (
    ATTESTATION_DIR,
    HINT,
    PROVENANCE_STATEMENT,
    RESULTS_STATEMENT,
    SLSA_PREDICATE,
    STATEMENT_TYPE,
    STATEMENTS,
    bundle_of,
    subjects,
)

Signed = Literal["absent", "present-unverified", "verified"]
PREDICATES = {PROVENANCE_STATEMENT: SLSA_PREDICATE, RESULTS_STATEMENT: RESULTS_PREDICATE}


def read_statement(root: Path, rel: str, problems: Problems) -> dict[str, Any] | None:
    """The statement at rel when it is a well-formed in-toto v1 statement of its type."""
    if not (root / rel).is_file():
        problems.add(rel, "missing: the artifact carries no such attestation")
        return None
    data = read_json_object(root / rel, problems, rel)
    if data is None:
        return None
    for key, want in (("_type", STATEMENT_TYPE), ("predicateType", PREDICATES[rel])):
        if data.get(key) != want:
            problems.add(rel, f"field `{key}` is {data.get(key)!r}, expected {want!r}")
    if not isinstance(data.get("subject"), list) or not isinstance(data.get("predicate"), dict):
        problems.add(rel, "field `subject` must be a list and `predicate` an object")
        return None
    return data


def check_subjects(rel: str, data: dict[str, Any], want: list[dict], problems: Problems) -> None:
    """The statement's subjects are SHA256SUMS's files (and SHA256SUMS), digest for digest."""
    got: dict[str, Any] = {}
    for i, s in enumerate(data["subject"]):
        if not isinstance(s, dict) or not isinstance(s.get("digest"), dict):
            problems.add(rel, f"field `subject.{i}` is not a name with a digest")
            return
        got[str(s.get("name"))] = s["digest"].get("sha256")
    expect = {s["name"]: s["digest"]["sha256"] for s in want}
    for name in sorted(set(expect) | set(got)):
        if name not in got:
            problems.add(rel, f"field `subject`: {name} is in SHA256SUMS but not a subject")
        elif name not in expect:
            problems.add(rel, f"field `subject`: {name} is a subject but not in the artifact")
        elif got[name] != expect[name]:
            problems.add(rel, f"field `subject` {name}: sha256 {got[name]} != {expect[name]} "
                         "(the file as SHA256SUMS lists it)")  # fmt: skip


def check_provenance(root: Path, data: dict[str, Any], recorded_hash: str, p: Problems) -> None:
    """SLSA v1 field names (the in-toto binding parses it), recipe hash = recipe.yaml's."""
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2

    rel = PROVENANCE_STATEMENT
    try:
        json_format.ParseDict(data["predicate"], provenance_pb2.Provenance())
    except json_format.ParseError as e:
        p.add(rel, f"field `predicate` is not SLSA provenance v1: {str(e)[:300]}")
        return
    recipe = (
        data["predicate"].get("buildDefinition", {}).get("externalParameters", {}).get("recipe")
    )
    if not isinstance(recipe, dict):
        p.add(rel, "field `predicate.buildDefinition.externalParameters.recipe` is missing")
        return
    from ..recipe import load_recipe

    try:
        actual = load_recipe(root / "recipe.yaml")
    except QshipError as e:
        p.add("recipe.yaml", f"does not load as a recipe: {e.message}")
        return
    field = "predicate.buildDefinition.externalParameters.recipe"
    if recipe.get("sha256") != actual.hash():
        p.add(rel, f"field `{field}.sha256` is {recipe.get('sha256')}, recipe.yaml hashes to "
              f"{actual.hash()}")  # fmt: skip
    elif recipe.get("content") != actual.resolved():
        p.add(rel, f"field `{field}.content` differs from recipe.yaml")
    if recorded_hash != actual.hash():
        p.add("provenance.json", f"field `recipe.hash` is {recorded_hash}, recipe.yaml hashes "
              f"to {actual.hash()}")  # fmt: skip


def check_results(data: dict[str, Any], expected: QuantResults, p: Problems) -> None:
    """The results predicate is a QuantResults and says what eval.json says."""
    rel = RESULTS_STATEMENT
    try:
        got = QuantResults.from_json(data["predicate"], where=rel, error=IntegrityError)
    except IntegrityError as e:
        p.add(rel, f"field `predicate`: {e.message}")
        return
    for name in QuantResults.model_fields:
        if getattr(got, name) != getattr(expected, name):
            p.add(rel, f"field `predicate.{name}` differs from eval.json's")


def check_bundles(root: Path, statements: dict[str, dict], *, pubkey: Path | None,
                  cert_chain: list[Path], require: bool, p: Problems) -> Signed:  # fmt: skip
    """Each statement's Sigstore bundle verifies with the key (or chain) and carries it."""
    present = [rel for rel in STATEMENTS if (root / bundle_of(rel)).is_file()]
    if not present:
        if require:
            p.add(bundle_of(PROVENANCE_STATEMENT), "absent but a signature is required")
        return "absent"
    if pubkey is None and not cert_chain:
        if require:
            raise UsageError("--require-signature needs --pubkey (or --cert-chain)",
                             path=str(root / bundle_of(present[0])))  # fmt: skip
        return "present-unverified"
    verifier = _verifier(pubkey, cert_chain)

    for rel in STATEMENTS:
        brel = bundle_of(rel)
        if rel not in present:
            p.add(brel, "missing: the other statement is signed, this one is not")
            continue
        try:
            # the verifying half of model-signing's verify(), without its own predicate
            ptype, payload = model_signing_1_1.signed_payload(verifier, root / brel)
        except Exception as e:  # noqa: BLE001 - any failure of the verifier fails closed
            p.add(brel, f"signature does not verify ({type(e).__name__}: {str(e)[:200]})")
            continue
        if ptype != "application/vnd.in-toto+json":
            p.add(brel, f"field `dsseEnvelope.payloadType` is {ptype!r}")
        elif rel in statements and json.loads(payload) != statements[rel]:
            p.add(brel, f"the signed statement differs from {rel}")
    return "verified"


def _verifier(pubkey: Path | None, cert_chain: list[Path]) -> Any:
    for path in [*([pubkey] if pubkey else []), *cert_chain]:
        if not Path(path).is_file():
            raise UsageError("key or certificate file not found", path=str(path))
    return model_signing_1_1.verifier(pubkey, cert_chain)


def check(root: Path, listed: dict[str, str], *, prov: Provenance, ev: EvalFile,
          pubkey: Path | None = None, cert_chain: list[Path] | None = None,
          require: bool = False, checks: list[str]) -> Signed:  # fmt: skip
    """Every check of the module docstring; IntegrityError listing each problem."""
    p = Problems(root, hint=HINT)
    allowed = {*STATEMENTS, *(bundle_of(r) for r in STATEMENTS)}
    folder = root / ATTESTATION_DIR
    for f in sorted(folder.rglob("*")) if folder.is_dir() else []:
        rel = f.relative_to(root).as_posix()
        if rel not in allowed and not f.is_dir():
            p.add(rel, f"unexpected file in {ATTESTATION_DIR}/ (holds only {sorted(allowed)})")
    want = subjects(root, listed)
    statements: dict[str, dict] = {}
    for rel in STATEMENTS:
        data = read_statement(root, rel, p)
        if data is not None:
            statements[rel] = data
            check_subjects(rel, data, want, p)
    p.raise_if_any("attestation check")
    check_provenance(root, statements[PROVENANCE_STATEMENT], prov.recipe.hash, p)
    check_results(statements[RESULTS_STATEMENT], QuantResults.of(ev, listed["eval.json"]), p)
    p.raise_if_any("attestation check")
    signed = check_bundles(root, statements, pubkey=pubkey, cert_chain=list(cert_chain or []),
                           require=require, p=p)  # fmt: skip
    p.raise_if_any("attestation signature check")
    checks.append(f"in-toto statements: {len(want)} subjects = SHA256SUMS, recipe hash = "
                  "recipe.yaml, results = eval.json" + (", signatures valid" if signed ==
                                                       "verified" else ""))  # fmt: skip
    return signed


def count(root: Path) -> int:
    """Files under attestation/ (what verify reports beside SHA256SUMS's)."""
    folder = root / ATTESTATION_DIR
    return sum(1 for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
