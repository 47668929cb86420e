"""fetch from the Hugging Face Hub (or its filled cache when HF_HUB_OFFLINE=1).

The revision is resolved to a commit first (model_info) and every file is downloaded at
that commit, so a branch moving mid-download cannot mix two commits. Each file is then
copied into the cache entry and hashed once; LFS files are checked against the sha256 the
Hub lists for them, and everything against the pin `checksums/<org>--<name>@<commit>.json`.
A branch that now points at an unpinned commit while older commits of the repo are
pinned fails closed: someone must review the new revision and pin it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import log
from ..errors import IntegrityError, UsageError
from ..io.cache import stage_key
from ..io.hashing import FileDigest, Manifest
from ..io.network import HF_DOWNLOAD_RETRIES, api_timeout, retrying
from ..io.pins import pin_path, pinned_like, unpinned_error
from ..model.files import PICKLE_SUFFIXES, is_model_file
from ..records.snapshot import Snapshot
from .snapshot import SNAPSHOT_DIR, STAGE, Origin, copy_and_hash, finish, from_cache
from .sources import Source

_SHA40 = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class _Resolved:
    """The revision resolved to a commit, its files selected, and where they were put."""

    commit: str
    rels: list[str]
    local: Path | None
    """The HF cache's snapshot folder (None: nothing was downloaded)."""
    lfs: dict[str, FileDigest] = field(default_factory=dict)
    """The Hub's sha256 and size per LFS file (none offline)."""


def fetch_hub(
    src: Source,
    *,
    cache_dir: Path,
    checksums_dir: Path,
    allow_pickle: bool,
    pin: bool,
    require_pin: bool = False,
) -> Snapshot:
    from huggingface_hub import constants

    repo, rev = src.repo_id, src.revision
    assert repo is not None and rev is not None
    offline = bool(constants.HF_HUB_OFFLINE)
    if offline:
        got = _resolve_offline(src, allow_pickle)
    else:
        got = _download(src, checksums_dir, allow_pickle, pin=pin, require_pin=require_pin)
    commit, local, lfs = got.commit, got.local, got.lfs
    if not _SHA40.match(commit or ""):
        raise IntegrityError(
            f"{rev} did not resolve to a commit SHA (got {commit!r})", path=src.text
        )
    if require_pin and not pin_path(checksums_dir, Manifest.filename(repo, commit)).is_file():
        raise unpinned_error(src.text, checksums_dir / Manifest.filename(repo, commit))
    if local is None:
        raise IntegrityError(
            f"{repo}@{commit} has no model files (config, weights, tokenizer)",
            path=src.text,
            hint="check the repository: qship takes safetensors checkpoints",
        )

    manifest_path = pin_path(checksums_dir, Manifest.filename(repo, commit))
    key = stage_key(STAGE, {"kind": "hf", "repo": repo, "commit": commit, "files": got.rels,
                            "manifest": manifest_path.is_file()})  # fmt: skip

    def build(tmp: Path) -> dict:
        out = tmp / SNAPSHOT_DIR
        files = copy_and_hash(local, got.rels, out, label=f"verify {repo}")
        _check_lfs(files, lfs, local)
        checks = {
            "lfs": {
                "status": "skipped (offline)"
                if offline
                else f"{len(lfs)} LFS file(s) match the Hub's sha256",
                "files": sorted(lfs),
            },
            "requested_revision": rev,
        }
        return finish(out, files, origin=Origin(f"hf://{repo}@{commit}", repo, commit),
                      manifest_path=manifest_path, pin=pin, checks=checks, key=key,
                      require_pin=require_pin)  # fmt: skip

    return from_cache(cache_dir, key, build)


def _hub_errors() -> tuple[type[Exception], ...]:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    return (HfHubHTTPError, LocalEntryNotFoundError, OSError)


def _unreachable(src: Source, e: Exception) -> UsageError:
    return UsageError(
        f"cannot get {src.repo_id}@{src.revision} from the Hub ({type(e).__name__}: {e})",
        path=src.text,
        hint="check the name, the revision and the network/token; offline, fill the HF cache first",
    )


def _resolve_offline(src: Source, allow_pickle: bool) -> _Resolved:
    """HF_HUB_OFFLINE=1: the revision's snapshot already in the HF cache."""
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(src.repo_id, revision=src.revision, local_files_only=True))
        files = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
        rels = _select(files, allow_pickle, src)
    except _hub_errors() as e:
        raise _unreachable(src, e) from e
    return _Resolved(commit=local.name, rels=rels, local=local)


def _download(
    src: Source, checksums_dir: Path, allow_pickle: bool, *, pin: bool, require_pin: bool
) -> _Resolved:
    """Resolve the revision to a commit (model_info, with the LFS sha256s), refuse a moved
    or unpinned revision, then download every selected file at that commit."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    repo, rev = src.repo_id, src.revision
    assert repo is not None and rev is not None
    try:
        info = retrying(
            lambda: HfApi(endpoint=constants.ENDPOINT).model_info(
                repo, revision=rev, files_metadata=True, timeout=api_timeout()
            ),
            what=f"file list of {repo}@{rev}", host=f"Hub API {constants.ENDPOINT}",
            path=src.text,
        )  # fmt: skip
        commit = info.sha
        rels = _select([s.rfilename for s in info.siblings or []], allow_pickle, src)
        lfs = {
            s.rfilename: FileDigest(s.lfs.sha256, int(s.lfs.size))
            for s in info.siblings or []
            if s.rfilename in rels and s.lfs is not None
        }
        _check_revision_move(checksums_dir, repo, rev, commit, pin)
        if require_pin and not pin_path(checksums_dir, Manifest.filename(repo, commit)).is_file():
            raise unpinned_error(src.text, checksums_dir / Manifest.filename(repo, commit))
        local = None
        with log.Progress(f"download {repo}@{commit[:12]}", len(rels), unit="files") as bar:
            for i, name in enumerate(rels, 1):
                local = Path(
                    retrying(
                        functools.partial(hf_hub_download, repo, name, revision=commit),
                        what=f"download of {name}", path=f"hf://{repo}@{commit}/{name}",
                        host=f"Hub file server behind {constants.ENDPOINT}",
                        library_retries=HF_DOWNLOAD_RETRIES,
                    )
                ).parent  # fmt: skip
                bar.update(i, name)
    except _hub_errors() as e:
        raise _unreachable(src, e) from e
    return _Resolved(commit=commit, rels=rels, local=local, lfs=lfs)


def _check_lfs(files: dict[str, FileDigest], lfs: dict[str, FileDigest], local: Path) -> None:
    """Exit 3 for a copied file that differs from the Hub's LFS sha256; the corrupt blobs
    are dropped from the HF cache so that a retry downloads them again."""
    bad = [
        f"{rel}: sha256 {files[rel].sha256} ({files[rel].size} bytes) != the Hub's LFS "
        f"sha256 {exp.sha256} ({exp.size} bytes)"
        for rel, exp in sorted(lfs.items())
        if files[rel] != exp
    ]
    if not bad:
        return
    for rel in lfs:
        if files[rel] != lfs[rel]:
            (local / rel).resolve().unlink(missing_ok=True)
            (local / rel).unlink(missing_ok=True)
    raise IntegrityError(
        "corrupted download (differs from the Hub's LFS sha256):\n    " + "\n    ".join(bad),
        path=str(local / bad[0].split(":", 1)[0]),
        hint="fetch again: the corrupt copy was removed from the HF cache",
    )


def _select(names: list[str], allow_pickle: bool, src: Source) -> list[str]:
    """Weights, config and tokenizer files; pickle weights only when there is no
    safetensors and --allow-pickle was given."""
    top = [n for n in names if is_model_file(n)]
    has_st = any(n.endswith(".safetensors") for n in top)
    pickles = [
        n for n in top if n.lower().endswith(PICKLE_SUFFIXES) or n.startswith("pytorch_model.bin")
    ]
    if has_st:
        return sorted(n for n in top if n not in pickles)
    if pickles and not allow_pickle:
        raise IntegrityError(
            f"{src.repo_id} has only pickle weights ({', '.join(pickles)}); pickle can run code when loaded",
            path=src.text,
            hint="use a revision with safetensors, or --allow-pickle if you trust the source",
        )
    return sorted(top)


def _check_revision_move(
    checksums_dir: Path, repo: str, rev: str | None, commit: str, pin: bool
) -> None:
    pinned = pinned_like(checksums_dir, Manifest.filename(repo, "*"))
    if pin or not pinned or pin_path(checksums_dir, Manifest.filename(repo, commit)).exists():
        return
    old = ", ".join(p.stem.rsplit("@", 1)[1] for p in pinned)
    raise IntegrityError(
        f"revision {rev} of {repo} now resolves to commit {commit}, which is not pinned "
        f"(pinned: {old})",
        path=str(Path(checksums_dir) / Manifest.filename(repo, commit)),
        hint=f"ask for a pinned commit (hf://{repo}@<commit>), or review the new revision "
        "and pin it with `qship fetch --pin`",
    )


def hub_config(src: Source):
    """config.json at the source's revision only (no weights): for the recipe check."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from transformers import AutoConfig

    repo = src.repo_id
    assert repo is not None
    try:
        path = retrying(
            lambda: hf_hub_download(repo, "config.json", revision=src.revision),
            what=f"config.json of {repo}@{src.revision}", path=src.text,
            host=f"Hub {constants.ENDPOINT}", library_retries=HF_DOWNLOAD_RETRIES,
        )  # fmt: skip
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise UsageError(
            f"cannot get config.json of {src.repo_id}@{src.revision} from the Hub "
            f"({type(e).__name__}: {e})",
            path=src.text,
            hint="check the name, the revision and the network/token; offline, fill the HF cache first",
        ) from e
    return AutoConfig.from_pretrained(str(Path(path).parent))
