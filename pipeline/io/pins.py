"""Pins: the sha256 manifests in checksums/ that every input is checked against.

`verify_against_pin` compares what was fetched with its pin (any difference: exit 3,
naming each file) or writes a missing pin when asked; `check_cached` re-hashes a cache
entry before it is reused, so a file altered after it was verified is never read.

Pins are found by name (`<org>--<name>@<revision>.json`) and, failing that, by content
(`find_by_content`): the pinned Gemma GGUF copied to `./model.gguf` is still the pinned
file. `require_pin` makes an input that matches no pin fatal (exit 3), the way pip's
`--require-hashes` does.

Where pins live, from any working directory: the pin folder (`--checksums DIR`, else
`$QSHIP_CHECKSUMS`, else the project's `./checksums`) first -- `--pin` writes there --
then the manifests shipped inside qship (`pipeline/checksums/`, package data).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from ..errors import IntegrityError, UsageError
from .atomic import atomic_write_text
from .hashing import FileDigest, Manifest, compare_digests, hash_files, list_files

PinStatus = Literal["pinned", "pinned-now", "unpinned"]
ENV = "QSHIP_CHECKSUMS"
SHIPPED = Path(__file__).resolve().parent.parent / "checksums"


def checksums_dir(explicit: Path | None = None) -> Path:
    """The pin folder: `--checksums DIR`, else $QSHIP_CHECKSUMS, else ./checksums. A folder
    the user named must exist and be a folder (exit 2): a typo there would otherwise read
    as "no pin" and take an altered model. `--checksums` is checked as the CLI reads it
    (`require_folder`); `explicit` is a folder already chosen (the runner hands its own on
    to fetch). The default ./checksums may be absent."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(ENV)
    if env:
        return require_folder(Path(env), ENV)
    folder = Path("checksums")
    if folder.exists() and not folder.is_dir():
        raise _not_a_folder("./checksums (the default pin folder)", folder)
    return folder


def require_folder(folder: Path, where: str) -> Path:
    """`folder`, named by `where` (--checksums, $QSHIP_CHECKSUMS), if it is a folder."""
    if not folder.is_dir():
        raise _not_a_folder(where, folder)
    return folder


def _not_a_folder(where: str, folder: Path) -> UsageError:
    what = "is a file, not a folder" if folder.exists() else "does not exist"
    return UsageError(
        f"the pin folder {folder} named by {where} {what}",
        path=str(folder),
        hint=f"create it (mkdir -p {folder}) or correct {where}: pins are looked up and "
        "written (--pin) there",
    )


def search_dirs(first: Path) -> list[Path]:
    """Where pins are looked up, in order: the pin folder, then the shipped manifests."""
    dirs = [Path(first)]
    if Path(first).resolve() != SHIPPED:
        dirs.append(SHIPPED)
    return [d for d in dirs if d.is_dir()]


def pin_path(first: Path, filename: str) -> Path:
    """The manifest `filename`: where it is found on the search path, else where `--pin`
    writes it (the pin folder)."""
    for d in search_dirs(first):
        if (d / filename).is_file():
            return d / filename
    return Path(first) / filename


def pinned_like(first: Path, pattern: str) -> list[Path]:
    """Every manifest on the search path whose name matches the glob `pattern`."""
    return sorted(p for d in search_dirs(first) for p in d.glob(pattern))


def fail_if(problems: list[str], *, where: str, what: str, hint: str) -> None:
    if problems:
        raise IntegrityError(
            f"{what}: {len(problems)} problem(s):\n    " + "\n    ".join(problems),
            path=where,
            hint=hint,
        )


def find_by_content(checksums_dir: Path, files: dict[str, FileDigest]) -> Path | None:
    """The manifest in `checksums_dir` pinning exactly these bytes: the same files under
    the same names, or -- for a single file (a GGUF) -- the same bytes under any name."""
    want = sorted(files.values(), key=lambda d: (d.sha256, d.size))
    for path in pinned_like(checksums_dir, "*.json"):
        pinned = Manifest.load(path).files
        if pinned == files or (
            len(files) == 1 and sorted(pinned.values(), key=lambda d: (d.sha256, d.size)) == want
        ):
            return path
    return None


def refuse_altered_copy(files: dict[str, FileDigest], checksums_dir: Path, *, source: str) -> None:
    """A single file (a GGUF) named like a pinned one but holding other bytes is an altered
    copy of it, not a new model: exit 3, also without --require-pin."""
    if len(files) != 1:
        return
    ((name, got),) = files.items()
    for path in pinned_like(checksums_dir, "*.json"):
        want = Manifest.load(path).files.get(name)
        if want is not None and want != got:
            raise IntegrityError(
                f"{source} is named like the pinned {name} ({path.name}) but its bytes differ "
                f"(sha256 {got.sha256[:16]}… vs {want.sha256[:16]}…, {got.size:,} vs "
                f"{want.size:,} bytes)",
                path=source,
                hint="an altered or truncated copy of a pinned file: fetch it again from a "
                "trusted source; if it is a different model on purpose, give it another name "
                "and pin it with `qship fetch --pin`",
            )


def unpinned_error(source: str, manifest_path: Path) -> IntegrityError:
    return IntegrityError(
        f"{source} is not pinned: no manifest {manifest_path.name} and none in "
        f"{manifest_path.parent} with the same content (--require-pin)",
        path=source,
        hint="review the input, then pin it with `qship fetch SOURCE --pin` and commit "
        f"{manifest_path}; or drop --require-pin",
    )


def verify_against_pin(
    files: dict[str, FileDigest],
    manifest_path: Path,
    *,
    pin: bool,
    source: str,
    repo_id: str | None,
    revision: str | None,
    require_pin: bool = False,
) -> tuple[PinStatus, str | None]:
    """-> (pin_status, manifest path or None). Any mismatch with an existing pin: exit 3;
    no pin by name or content with `require_pin`: exit 3. `manifest_path` is where the pin
    is written; it is looked up on the whole search path first."""
    manifest_path = pin_path(manifest_path.parent, manifest_path.name)
    if not manifest_path.is_file():
        found = find_by_content(manifest_path.parent, files)
        if found is not None:
            return "pinned", str(found)
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
    refuse_altered_copy(files, manifest_path.parent, source=source)
    if require_pin:
        raise unpinned_error(source, manifest_path)
    return "unpinned", None


def check_cached(folder: Path, recorded: dict[str, Any], *, where: str) -> None:
    """Re-hash a cache entry's files against what was recorded when it was verified."""
    expected = {
        rel: d if isinstance(d, FileDigest) else FileDigest(str(d["sha256"]), int(d["size"]))
        for rel, d in recorded.items()
    }
    actual = hash_files(folder, list_files(folder))
    fail_if(
        compare_digests(expected, actual, where=where),
        where=where,
        what="the cache entry was altered after it was verified",
        hint=f"delete {where} and run again",
    )
