"""`qship publish ARTIFACT --to TARGET`: ship only what passed the gate and verifies.

Order: `verify.verify` first (exit 3 on any integrity failure: nothing in eval.json is
trusted before that), then `eval.json["verdict"]["passed"]` must be true (else exit 4).

Targets
* `file:///path/registry` — a local registry directory:

      <registry>/index.json                 {"format": "qship-registry-v1", "models":
                                             {name: {version: {sha256sums, recipe, ...}}}}
      <registry>/<name>/<version>/...       a verified copy of the artifact

  The version is given or defaults to `sha-` + the first 16 hex of sha256(SHA256SUMS)
  (content-addressed). A version directory is written with fsutil.atomic_dir (complete
  or absent) and verified again before its rename; index.json is rebuilt from what the
  registry holds and replaced atomically, all under an exclusive lock file
  (`<registry>/.lock`). An existing version is never overwritten: identical content
  (same SHA256SUMS and model.sig) is an idempotent no-op, anything else is a UsageError
  (exit 2).
* `oci://HOST/REPO:TAG` — an OCI registry, as an OCI artifact (oci.py): every file a layer
  with its digest, the attestations and the BOM with their media types; the tag last.
* `hf://org/name` — the Hugging Face Hub, through `HfApi(endpoint=...).upload_folder`,
  only the files SHA256SUMS lists plus SHA256SUMS and model.sig, with a commit message
  naming the recipe (name and sha256) and the verdict.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import GateFailed, IntegrityError, UsageError
from ..io.atomic import atomic_dir, atomic_write_text, remove_stale_partials
from ..io.hashing import parse_sha256sums, sha256_bytes
from ..io.network import retrying
from ..records.artifact import Provenance, PublishResult
from ..records.verdict import Verdict
from . import attestation, oci
from .signing import SIGNATURE
from .verify import SUMS, check_sums, read_eval, verify

INDEX_FORMAT = "qship-registry-v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Facts:
    """What publishing needs to know of an artifact, from its (verified) records."""

    verdict: Verdict
    recipe_name: str
    recipe_hash: str
    name: str


def _artifact_facts(root: Path) -> Facts:
    ev = read_eval(root)
    prov = Provenance.from_json(
        json.loads((root / "provenance.json").read_text(encoding="utf-8")),
        where=str(root / "provenance.json"),
        error=IntegrityError,
    )
    assert ev.verdict is not None  # verify's check_records requires it
    return Facts(ev.verdict, prov.recipe.name, prov.recipe.hash, prov.name or root.name)


def commit_message(name: str, facts: Facts) -> str:
    checks = facts.verdict.checks
    ok = sum(1 for c in checks if c.passed)
    state = "PASSED" if facts.verdict.passed else "FAILED"
    return (
        f"qship: publish {name} (recipe {facts.recipe_name} "
        f"sha256:{facts.recipe_hash[:12]}; gate {state}, {ok}/{len(checks)} checks)"
    )


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise UsageError(
            f"{what} {value!r} must match {_NAME.pattern}", path=what, hint=f"pass a plain {what}"
        )
    return value


@contextlib.contextmanager
def _locked(registry: Path):
    registry.mkdir(parents=True, exist_ok=True)
    with open(registry / ".lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _same_content(a: Path, b: Path) -> bool:
    for rel in (SUMS, SIGNATURE):
        pa, pb = a / rel, b / rel
        if pa.exists() != pb.exists():
            return False
        if pa.exists() and pa.read_bytes() != pb.read_bytes():
            return False
    return True


def rebuild_index(registry: Path) -> dict:
    models: dict = {}
    for name_dir in sorted(p for p in registry.iterdir() if p.is_dir() and _NAME.match(p.name)):
        for vdir in sorted(p for p in name_dir.iterdir() if p.is_dir() and _NAME.match(p.name)):
            sums = vdir / SUMS
            if not sums.is_file():
                continue
            try:
                facts = _artifact_facts(vdir)
                files = parse_sha256sums(sums.read_bytes(), where=str(sums))
            except (OSError, ValueError, IntegrityError):
                continue
            models.setdefault(name_dir.name, {})[vdir.name] = {
                "path": f"{name_dir.name}/{vdir.name}",
                "sha256sums": sha256_bytes(sums.read_bytes()),
                "files": len(files),
                "bytes": sum((vdir / r).stat().st_size for r in files),
                "signed": (vdir / SIGNATURE).exists(),
                "recipe": {"name": facts.recipe_name, "sha256": facts.recipe_hash},
                "verdict_passed": facts.verdict.passed,
            }
    index = {"format": INDEX_FORMAT, "models": models}
    atomic_write_text(registry / "index.json", json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.chmod(registry / "index.json", 0o644)  # mkstemp made it 0600; readers are not only us
    return index


def _publish_local(root: Path, registry: Path, name: str, version: str, msg: str) -> PublishResult:
    sums_bytes = (root / SUMS).read_bytes()
    listed = parse_sha256sums(sums_bytes, where=str(root / SUMS))
    dest = registry / name / version
    with _locked(registry):
        remove_stale_partials(dest.parent)
        if dest.exists():
            if _same_content(root, dest):
                check_sums(dest, [])
                rebuild_index(registry)
                return PublishResult(target=f"file://{registry}", name=name, version=version,
                                     location=str(dest), status="unchanged", commit_message=msg)  # fmt: skip
            raise UsageError(
                f"{name} version {version} is already in the registry with different content",
                path=str(dest),
                hint="publish under another --version; a published version is never overwritten",
            )
        with atomic_dir(dest) as tmp:
            os.chmod(tmp, 0o755)
            for rel in sorted(listed):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / rel, tmp / rel)
            (tmp / SUMS).write_bytes(sums_bytes)
            for rel in [SIGNATURE, *attestation.present(root)]:
                if (root / rel).exists():
                    (tmp / rel).parent.mkdir(exist_ok=True)
                    shutil.copyfile(root / rel, tmp / rel)
            check_sums(tmp, [])  # the copy, not the source, is shipped
        rebuild_index(registry)
    return PublishResult(target=f"file://{registry}", name=name, version=version,
                         location=str(dest), status="published", commit_message=msg)  # fmt: skip


def _publish_hub(
    root: Path,
    repo_id: str,
    msg: str,
    *,
    endpoint: str | None,
    token: str | None,
    revision: str | None,
    private: bool,
) -> PublishResult:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    listed = parse_sha256sums((root / SUMS).read_bytes(), where=str(root / SUMS))
    allow = sorted(listed) + [SUMS] + ([SIGNATURE] if (root / SIGNATURE).exists() else [])
    allow += attestation.present(root)
    api = HfApi(endpoint=endpoint, token=token)
    host = f"Hub API {endpoint or constants.ENDPOINT}"
    where = f"hf://{repo_id}"
    hint = "the artifact is built and verified: the same `qship run` or `qship publish` " \
        "command publishes it without recomputing"  # fmt: skip
    try:
        retrying(lambda: api.create_repo(repo_id, repo_type="model", exist_ok=True,
                                         private=private),
                 what=f"creating {repo_id}", host=host, path=where, hint=hint)  # fmt: skip
        info = retrying(
            lambda: api.upload_folder(
                repo_id=repo_id,
                repo_type="model",
                folder_path=str(root),
                allow_patterns=allow,
                commit_message=msg,
                commit_description=(
                    "Published by qship after `qship verify` passed. "
                    "Check with `sha256sum -c SHA256SUMS` or `qship verify`."
                ),
                revision=revision,
            ),
            what=f"upload of {root.name} to {repo_id}", host=host, path=where, hint=hint,
        )  # fmt: skip
    except HfHubHTTPError as e:  # not transient: refused (a bad token, no rights, bad name)
        raise UsageError(f"the Hub refused the upload to {repo_id}: {e}", path=where,
                         hint="check HF_TOKEN's write access to the repository and its "
                         "name") from e  # fmt: skip
    url = getattr(info, "commit_url", None) or str(info)
    return PublishResult(target=f"hf://{repo_id}", name=repo_id, version=revision or "main",
                         location=url, status="published", commit_message=msg, commit_url=url)  # fmt: skip


def publish(
    artifact: Path,
    target: str,
    *,
    name: str | None = None,
    version: str | None = None,
    pubkey: Path | None = None,
    require_signature: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    private: bool = False,
    layout: str = "artifact",
) -> PublishResult:
    root = Path(artifact)
    verify(root, require_signature=require_signature, pubkey=pubkey)  # exit 3 on failure
    facts = _artifact_facts(root)
    if not facts.verdict.passed:
        failed = facts.verdict.failed
        raise GateFailed(
            f"the quality gate did not pass (failed checks: {failed}); refusing to publish",
            path=str(root / "eval.json"),
            hint="change the recipe or the gates and re-run; only passing artifacts are published",
        )
    u = urlparse(target)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise UsageError(f"file:// target with host {u.netloc!r}", path=target)
        registry = Path(unquote(u.path))
        if not registry.is_absolute():
            raise UsageError("file:// target must be an absolute path", path=target)
        n = _check_name(name or facts.name, "name")
        v = _check_name(
            version or "sha-" + sha256_bytes((root / SUMS).read_bytes())[:16], "version"
        )
        return _publish_local(root, registry, n, v, commit_message(n, facts))
    if u.scheme == "hf":
        repo_id = (u.netloc + u.path).strip("/")
        rev = None
        if "@" in repo_id:
            repo_id, rev = repo_id.split("@", 1)
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
            raise UsageError(f"hf:// target must be hf://org/name, got {target!r}", path=target)
        return _publish_hub(
            root,
            repo_id,
            commit_message(repo_id, facts),
            endpoint=endpoint,
            token=token,
            revision=rev,
            private=private,
        )
    if u.scheme == "oci":
        ref, digest, status = oci.push(root, target, layout)
        return PublishResult(target=target, name=ref.repo, version=str(ref.tag),
                             location=f"oci://{ref.host}/{ref.repo}@{digest}", status=status,
                             commit_message=commit_message(ref.repo, facts))  # fmt: skip
    raise UsageError(
        f"unknown publish target {target!r}",
        path=target,
        hint="use file:///abs/path/registry, hf://org/name or oci://HOST/REPO:TAG",
    )
