"""fetch from a local folder: a plain checkpoint, or an HF cache snapshot folder
(`.../models--org--name/snapshots/<commit>`, whose symlinks into `blobs/` are fine)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import IntegrityError
from ..io.cache import stage_key
from ..io.hashing import Manifest, list_files
from ..io.pins import pin_path
from ..model.files import PICKLE_SUFFIXES, WEIGHT_SUFFIXES, is_model_file
from ..records.snapshot import Snapshot
from .snapshot import SNAPSHOT_DIR, STAGE, Origin, copy_and_hash, finish, from_cache
from .sources import Source, hf_cache_layout


def fetch_dir(
    src: Source,
    *,
    cache_dir: Path,
    checksums_dir: Path,
    allow_pickle: bool,
    pin: bool,
    require_pin: bool = False,
) -> Snapshot:
    assert src.path is not None
    root = src.path
    layout = hf_cache_layout(root)
    if layout:
        repo_id, revision, contain = layout
    else:
        repo_id, revision, contain = f"local/{root.name}", "local", root
    rels = scan_dir(root, contain=contain, allow_pickle=allow_pickle)
    manifest_path = pin_path(checksums_dir, Manifest.filename(repo_id, revision))
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
        files = copy_and_hash(root, rels, out, label=f"copy {root.name}")
        return finish(out, files, origin=Origin(src.text, repo_id, revision),
                      manifest_path=manifest_path, pin=pin, checks={}, key=key,
                      require_pin=require_pin)  # fmt: skip

    return from_cache(cache_dir, key, build)


def _stat(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _manifest_state(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def scan_dir(root: Path, *, contain: Path, allow_pickle: bool) -> list[str]:
    """The model files to take from a local folder; fails closed on escaping symlinks,
    pickle weights (unless allowed) and anything that is not a regular file."""
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
        if is_model_file(rel):
            out.append(rel)
    if not any(r.endswith(WEIGHT_SUFFIXES) for r in out):
        raise IntegrityError(
            "no weight file (*.safetensors) in the snapshot",
            path=str(root),
            hint="point qship at a folder with config.json and *.safetensors",
        )
    return out
