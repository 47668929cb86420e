"""`qship verify ARTIFACT`: the pre-deploy gate, usable without the rest of qship.

Checks, in order (every problem of a group is collected; any problem is an IntegrityError,
exit 3, whose `path` is the first offending file and whose message lists them all):

1. the artifact is a real directory; nothing inside is a symlink or a special file;
2. `SHA256SUMS` parses (coreutils format; relative paths only, no `..`, no duplicates),
   every listed file exists and matches, and every file present is listed, except
   `SHA256SUMS` itself and the signature `model.sig`. A renamed file shows up as one
   missing and one extra file; both are named;
3. the required files are there, and eval.json / provenance.json are the records this
   version of qship writes (eval.json with a verdict);
4. the weights against config.json: the shared checkpoint validator
   (pipeline.model.checkpoint, which quantize's post-save check uses too);
5. the signature when `model.sig` exists and a public key is given, or when required;
   then the in-toto statements (attestation_check.py): subjects = SHA256SUMS, recipe hash
   = recipe.yaml's, results = eval.json's, their signatures (required with model.sig's);
6. the records against each other (a file edited and re-summed): recipe.yaml hashes to
   provenance's recipe hash, the model files to its quantized_model_hash, eval.json /
   README.md / recipe.yaml to the sha256 it recorded, and the model card's figures are
   eval.json's, re-rendered (model_card.figures); the ML-BOM (bom.py) valid and its file
   hashes = SHA256SUMS;
7. with `load=True`, a smoke test: load with transformers, run the stored probe and compare
   it with the fingerprint in eval.json (probe.py).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import IntegrityError, QshipError, UsageError
from ..io.hashing import FileDigest, hash_files, parse_sha256sums
from ..io.problems import Problems, read_json_object
from ..model.checkpoint import inspect_checkpoint
from ..model.files import TOKENIZER_KEYS, is_model_file, model_hash
from ..recipe import load_recipe
from ..records.artifact import Provenance, VerifyReport
from ..records.evaluation import EvalFile
from . import attestation_check, bom, model_card
from .attestation import covered_by_sums
from .probe import compare_fingerprint, probe_logits
from .provenance import PROVENANCE, RECORD_FILES
from .signing import SIGNATURE, check_signature

SUMS = "SHA256SUMS"
REQUIRED = ("config.json", "eval.json", "provenance.json", "recipe.yaml", "README.md")
MAX_SUMS_BYTES = 16 * 1024 * 1024
HINT = "do not deploy this artifact; re-package it (qship package) from its inputs"


def scan_tree(root: Path, problems: Problems) -> list[str]:
    """Regular files below root (sorted relpaths); symlinks and special files are problems."""
    out = []

    def unreadable(err: OSError) -> None:
        rel = Path(err.filename).relative_to(root).as_posix() if err.filename else "."
        problems.add(rel, f"cannot be listed ({err.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=unreadable):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            p = base / name
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                problems.add(rel, f"is a symlink (-> {os.readlink(p)}); artifacts hold plain files")
            elif stat.S_ISREG(st.st_mode):
                out.append(rel)
            elif not stat.S_ISDIR(st.st_mode):
                problems.add(rel, "is not a regular file")
    return sorted(out)


def check_sums(root: Path, checks: list[str]) -> dict[str, str]:
    """SHA256SUMS complete and matching, no extra file, no symlink, the required files."""
    problems = Problems(root, hint=HINT)
    if root.is_symlink() or not root.is_dir():
        raise IntegrityError("artifact is not a directory (or is a symlink)", path=str(root))
    present = scan_tree(root, problems)
    sums_path = root / SUMS
    if SUMS not in present:
        problems.add(SUMS, "missing: the artifact has no checksum list")
        problems.raise_if_any("integrity check")
    if sums_path.stat().st_size > MAX_SUMS_BYTES:
        problems.add(SUMS, f"larger than {MAX_SUMS_BYTES} bytes")
        problems.raise_if_any("integrity check")
    listed = parse_sha256sums(sums_path.read_bytes(), where=str(sums_path))
    for rel in [SUMS, SIGNATURE, *(r for r in listed if not covered_by_sums(r))]:
        if rel in listed:
            problems.add(SUMS, f"lists {rel!r}, which is never covered by SHA256SUMS")
    others = [r for r in present if r not in (SUMS, SIGNATURE) and covered_by_sums(r)]
    missing = sorted(set(listed) - set(others) - {SUMS, SIGNATURE})
    extra = sorted(set(others) - set(listed))
    digests = hash_files(root, [r for r in others if r in listed or r in extra])
    by_hash: dict[str, list[str]] = {}
    for rel in extra:
        by_hash.setdefault(digests[rel].sha256, []).append(rel)
    for rel in missing:
        renamed = [e for e in by_hash.get(listed[rel], [])]
        also = f" (renamed to {', '.join(renamed)}?)" if renamed else ""
        problems.add(rel, f"listed in SHA256SUMS but absent{also}")
    for rel in extra:
        was = [m for m in missing if listed[m] == digests[rel].sha256]
        also = f" (renamed from {', '.join(was)}?)" if was else ""
        problems.add(rel, f"present but not listed in SHA256SUMS (extra file){also}")
    for rel in sorted(set(listed) & set(others)):
        if digests[rel].sha256 != listed[rel]:
            problems.add(rel, f"sha256 {digests[rel].sha256} != {listed[rel]} listed in SHA256SUMS")
    for rel in REQUIRED:
        if rel not in present and rel not in missing:
            problems.add(rel, "required file absent (and not listed in SHA256SUMS)")
    if not any(r in present for r in TOKENIZER_KEYS):
        problems.add("tokenizer.json", f"no tokenizer (one of {', '.join(TOKENIZER_KEYS)})")
    if not any(r.endswith(".safetensors") for r in present):
        problems.add("model.safetensors", "no *.safetensors weight file in the artifact")
    problems.raise_if_any("integrity check")
    checks.append(f"SHA256SUMS: {len(listed)} files listed, all present and matching")
    checks.append("no symlinks, no unlisted files, no unsafe paths")
    return listed


def read_eval(root: Path) -> EvalFile:
    """The artifact's eval.json as a record (IntegrityError when it is not one)."""
    p = Problems(root, hint=HINT)
    data = read_json_object(root / "eval.json", p, "eval.json")
    p.raise_if_any("record check")
    return EvalFile.from_json(data, where=str(root / "eval.json"), error=IntegrityError)


def read_provenance(root: Path) -> Provenance:
    """The artifact's provenance.json as a record (IntegrityError when it is not one)."""
    p = Problems(root, hint=HINT)
    data = read_json_object(root / "provenance.json", p, "provenance.json")
    p.raise_if_any("record check")
    return Provenance.from_json(data, where=str(root / "provenance.json"), error=IntegrityError)


def check_records(root: Path, checks: list[str]) -> EvalFile:
    """eval.json is an EvalFile with a verdict; provenance.json a Provenance."""
    ev = read_eval(root)
    if ev.verdict is None:
        raise IntegrityError("eval.json has no verdict", path=str(root / "eval.json"), hint=HINT)
    read_provenance(root)
    checks.append(f"eval.json verdict: {'passed' if ev.verdict.passed else 'FAILED'}")
    return ev


def check_weights(root: Path, checks: list[str]) -> int:
    insp = inspect_checkpoint(root, hint=HINT)
    checks.append(
        f"{insp.tensors} tensors consistent with config.json ({insp.architecture}) and its "
        f"quantization_config; scales finite and positive"
    )
    return insp.tensors


def check_cross(root: Path, listed: dict[str, str], checks: list[str]) -> None:
    """The artifact's records against each other, so that a file edited and re-summed
    fails: recipe.yaml against provenance's recipe hash, the weights against its model
    hash, eval.json / README.md / recipe.yaml against the hashes it recorded, and the
    card's figures against eval.json (re-rendered from it)."""
    prov, ev = read_provenance(root), read_eval(root)
    p = Problems(root, hint=HINT)
    _cross_recipe(root, prov, p)
    files = {r: FileDigest(sha, 0) for r, sha in listed.items()}
    if prov.quantized_model_hash is None:
        p.add(PROVENANCE, "records no hash of the packaged model files (quantized_model_hash): "
              "packaged by an older qship, nothing ties the weights to the evaluation")  # fmt: skip
    elif (got := model_hash(files)) != prov.quantized_model_hash:
        shards = ", ".join(r for r in sorted(files) if is_model_file(r))
        p.add(_first_weight(listed), f"the model files ({shards}) hash to {got}, not the "
              f"quantized_model_hash {prov.quantized_model_hash} in {PROVENANCE}: the weights, "
              "config or tokenizer were changed after packaging")  # fmt: skip
    for rel in RECORD_FILES:
        want = prov.records.get(rel)
        if want is None:
            p.add(PROVENANCE, f"records no sha256 of {rel} (packaged by an older qship?)")
        elif listed.get(rel) != want:
            p.add(rel, f"sha256 {listed.get(rel)} != {want} recorded in {PROVENANCE}: "
                  "changed after packaging")  # fmt: skip
    card = (root / "README.md").read_text(encoding="utf-8", errors="replace")
    for block in model_card.figures(ev):
        if block not in card:
            head = block.splitlines()[0]
            p.add("README.md", f"the model card's figures differ from eval.json's (the block "
                  f"{head!r} re-rendered from eval.json is not in it)")  # fmt: skip
    p.raise_if_any("record cross-check")
    checks.append("recipe.yaml, the weights, eval.json and README.md agree with "
                  f"{PROVENANCE}; the model card's figures are eval.json's")  # fmt: skip


def _cross_recipe(root: Path, prov: Provenance, p: Problems) -> None:
    try:
        got = load_recipe(root / "recipe.yaml").hash()
    except QshipError as e:
        p.add("recipe.yaml", f"not a valid recipe ({e.message})")
        return
    if got != prov.recipe.hash:
        p.add("recipe.yaml", f"hashes to sha256:{got}, not the recipe hash "
              f"sha256:{prov.recipe.hash} in {PROVENANCE} ({prov.recipe.name}): the recipe "
              "(its gates, its schemes) was changed after packaging")  # fmt: skip


def _first_weight(listed: dict[str, str]) -> str:
    return next((r for r in sorted(listed) if r.endswith(".safetensors") and "/" not in r),
                "model.safetensors")  # fmt: skip


def check_load(root: Path, ev: EvalFile, checks: list[str], *, atol: float) -> None:
    if ev.probe is None:
        raise IntegrityError(
            "eval.json has no probe fingerprint (qship-probe-v1)",
            path=str(root / "eval.json"),
            hint="re-package with qship package (it stores the probe)",
        )
    try:
        logits = probe_logits(root, ev.probe.prompt_ids)
    except Exception as e:  # noqa: BLE001 - a model that does not load fails the gate
        raise IntegrityError(
            f"transformers could not load and run the model ({type(e).__name__}: {str(e)[:300]})",
            path=str(root / "config.json"),
        ) from e
    try:
        mismatches = compare_fingerprint(ev.probe, logits, atol=atol)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise IntegrityError(
            f"malformed probe fingerprint ({type(e).__name__}: {str(e)[:200]})",
            path=str(root / "eval.json"),
        ) from e
    p = Problems(root, hint=HINT)
    for msg in mismatches:
        p.add("eval.json", f"probe mismatch: {msg}")
    p.raise_if_any("load smoke test")
    checks.append(f"loaded with transformers; probe of {len(ev.probe.prompt_ids)} tokens matched")


def verify(
    artifact: Path,
    *,
    require_signature: bool = False,
    pubkey: Path | None = None,
    load: bool = False,
    atol: float = 0.05,
    cert_chain: list[Path] | None = None,
) -> VerifyReport:
    """Run every check; raise IntegrityError (exit 3) on the first failing group."""
    root = Path(artifact)
    if not root.exists():
        raise UsageError("artifact directory not found", path=str(root))
    checks: list[str] = []
    listed = check_sums(root, checks)
    ev = check_records(root, checks)
    tensors = check_weights(root, checks)
    signature = check_signature(root, pubkey=Path(pubkey) if pubkey else None,
                                require=require_signature)  # fmt: skip
    check_cross(root, listed, checks)  # after the signature: a signed artifact names it
    bom.check(root, listed, checks)
    attested = attestation_check.check(root, listed, prov=read_provenance(root), ev=ev,
                                       pubkey=Path(pubkey) if pubkey else None,
                                       cert_chain=cert_chain, require=require_signature,
                                       checks=checks)  # fmt: skip
    warnings = []
    if signature == "verified":
        checks.append(f"signature {SIGNATURE} valid for {Path(str(pubkey)).name}")
    elif signature == "present-unverified":
        warnings.append(f"{SIGNATURE} present but not verified (no --pubkey given)")
    if load:
        check_load(root, ev, checks, atol=atol)
    return VerifyReport(
        path=str(root),
        files=len(listed) + 1 + (signature != "absent") + attestation_check.count(root),
        tensors=tensors,
        signature=signature,
        attestation_signature=attested,
        load="matched" if load else "skipped",
        checks=checks,
        warnings=warnings,
    )
