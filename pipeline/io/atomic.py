"""Atomic file and directory writes: a result is complete or absent, never half-written."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import DiskFull

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _rust_io_errno(text: str) -> int | None:
    """safetensors (Rust) reports an I/O error as text: "... (os error 28)"."""
    m = re.search(r"\(os error (\d+)\)", text)
    return int(m.group(1)) if m else None


def no_space(err: BaseException, target: Path) -> DiskFull | None:
    """A DiskFull naming `target` when `err` (or what caused it: libraries re-wrap OSError)
    is a full disk, an exhausted quota or a file-size limit; else None."""
    if isinstance(err, DiskFull):
        return None  # already named by the innermost write
    e: BaseException | None = err
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else _rust_io_errno(str(e))
        if code in _NO_SPACE:
            return DiskFull(
                f"no space left while writing {target} ({os.strerror(code)}); nothing "
                "half-written was kept",
                path=str(target),
                hint="free space on that file system (or raise the quota), or point --out / "
                "$QSHIP_CACHE at a larger one, then run the same command again",
            )
        e = e.__cause__ or e.__context__
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder below root, so a rename publishes durable content."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))


def umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would hide reports from a team
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if full := no_space(e, path):
            raise full from e
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success fsync it and rename it to `target`.

    On any exception (or a kill) the temp dir is removed / left under a dot-name that
    no reader takes for a result. With replace=False an existing target is an error.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~umask())  # mkdtemp's 0700 would hide the artifact from a team
        yield tmp
        fsync_tree(tmp)
        if target.exists():
            if not replace:
                raise FileExistsError(f"{target} already exists")
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        fsync_dir(target.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if full := no_space(e, target):
            raise full from e
        raise


def remove_stale_partials(parent: Path) -> None:
    """Delete leftovers of killed atomic_dir() writes whose writer process is gone."""
    if not Path(parent).is_dir():
        return
    for p in Path(parent).iterdir():
        if not (p.name.startswith(".") and ".partial-" in p.name):
            continue
        pid = p.name.split(".partial-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
