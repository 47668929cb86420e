"""Streaming SHA-256 and the two manifest formats qship reads and writes.

* pinned JSON manifests, `checksums/<org>--<name>@<revision>.json`:
  {"source", "repo_id", "revision", "files": {relpath: {"sha256", "size"}}}
* coreutils `SHA256SUMS` ("<hex>  <relpath>" lines), accepted by `sha256sum -c`.

Hashing reads into reused buffers (constant memory for any file size); hashlib releases
the GIL on large updates, so several files hash in parallel threads. With a core to spare
per file (at most half as many files as cores), each file also gets a read-ahead thread
that copies the next
chunk out of the page cache while this one is hashed: that copy is what keeps a single
reader at ~0.9x of `openssl speed`, and read ahead one file hashes at ~0.99x
(bench/RESULTS.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import IntegrityError

CHUNK = 1024 * 1024  # large reads, yet small enough that the buffer stays in L2 while hashed
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}


def sha256_file(
    path: Path,
    *,
    chunk: int = CHUNK,
    on_bytes: Callable[[int], None] | None = None,
    readahead: bool = False,
) -> FileDigest:
    """SHA-256 and size of one file, read in `chunk`-byte pieces into reused buffers;
    `readahead` reads the next pieces in a second thread (for when a core is idle)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        size = (_digest_readahead if readahead else _digest)(fh, h, chunk, on_bytes)
    return FileDigest(h.hexdigest(), size)


def _digest(fh, h, chunk: int, on_bytes) -> int:
    buf = bytearray(chunk)
    view = memoryview(buf)
    size = 0
    while n := fh.readinto(buf):
        h.update(view[:n])
        size += n
        if on_bytes:
            on_bytes(n)
    return size


def _digest_readahead(fh, h, chunk: int, on_bytes, depth: int = 3) -> int:
    """`_digest` with the reads in a thread, `depth` buffers in flight. A read error is
    raised here; an error here (or in on_bytes) stops the reader before returning."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(depth):
        free.put(bytearray(chunk))

    def read() -> None:
        try:
            while (buf := free.get()) is not None:
                n = fh.readinto(buf)
                full.put((buf, n))
                if not n:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the hashing thread
            full.put((e, 0))

    reader = threading.Thread(target=read, name="sha256-readahead", daemon=True)
    reader.start()
    size = 0
    try:
        while True:
            buf, n = full.get()
            if isinstance(buf, BaseException):
                raise buf
            if not n:
                return size
            h.update(memoryview(buf)[:n])
            size += n
            if on_bytes:
                on_bytes(n)
            free.put(buf)
    finally:
        free.put(None)  # wakes a reader waiting for a buffer; one that is reading sees it next
        reader.join()


def copy_hash_file(
    src: Path, dst: Path, *, on_bytes: Callable[[int], None] | None = None
) -> FileDigest:
    """Copy `src` to `dst` (following a symlink) and hash the bytes as they are written."""
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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_files(
    root: Path,
    relpaths: Iterable[str],
    *,
    workers: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    readahead: bool | None = None,
) -> dict[str, FileDigest]:
    """Hash files under root in parallel threads; returns relpath -> FileDigest (sorted).
    readahead=None: each file is read ahead in a thread of its own when there is a core to
    spare per file."""
    rels = sorted(set(relpaths))
    cores = os.cpu_count() or 1
    workers = workers or min(len(rels), cores) or 1
    if readahead is None:
        readahead = cores >= 2 * min(workers, len(rels) or 1)
    root = Path(root)
    digests = map_files(
        lambda r, cb: sha256_file(root / r, on_bytes=cb, readahead=readahead), rels,
        workers=workers, on_bytes=on_bytes,
    )  # fmt: skip
    return dict(zip(rels, digests, strict=True))


class _Stopped(Exception):
    """Raised in a worker at its next chunk once the caller was interrupted."""


def map_files(
    fn: Callable[[str, Callable[[int], None]], FileDigest],
    rels: list[str],
    *,
    workers: int,
    on_bytes: Callable[[int], None] | None = None,
) -> list[FileDigest]:
    """`fn(rel, on_bytes)` for each file in a thread pool, in order. When the caller is
    interrupted (Ctrl-C, SIGTERM: raised in the main thread while it waits) or one file
    fails, the others stop at their next chunk -- `on_bytes` raises in them -- instead of
    reading their files to the end before the interrupt can end the command."""
    stop = threading.Event()

    def counted(n: int) -> None:
        if stop.is_set():
            raise _Stopped
        if on_bytes:
            on_bytes(n)

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        return list(pool.map(lambda r: fn(r, counted), rels))
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def list_files(root: Path) -> list[str]:
    """Every regular file and symlink below root, as sorted POSIX relative paths."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        # symlinked folders are not descended into but must still be seen
        out += [
            (base / d).relative_to(root).as_posix() for d in dirnames if (base / d).is_symlink()
        ]
        out += [(base / f).relative_to(root).as_posix() for f in filenames]
    return sorted(out)


def check_relpath(rel: str, *, where: str) -> str:
    """A manifest path must stay inside its folder: relative, no '..', no odd characters."""
    p = PurePosixPath(rel)
    if (
        not rel
        or rel.startswith("/")
        or p.is_absolute()
        or ".." in p.parts
        or "\\" in rel
        or any(ord(c) < 32 for c in rel)
        or rel != p.as_posix()
    ):
        raise IntegrityError(
            f"unsafe path {rel!r}: manifest paths must be relative and stay inside the folder",
            path=where,
        )
    return rel


# ---------------------------------------------------------------- pinned JSON manifests


@dataclass
class Manifest:
    source: str
    repo_id: str | None
    revision: str | None
    files: dict[str, FileDigest] = field(default_factory=dict)
    # what a pinned file is, for the model card: the Hub id of the model it was made from
    # and one line about it (a GGUF's quantization)
    base_model: str | None = None
    about: str | None = None

    @staticmethod
    def filename(repo_id: str, revision: str) -> str:
        return f"{repo_id.replace('/', '--')}@{revision}.json"

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            **({"base_model": self.base_model} if self.base_model else {}),
            **({"about": self.about} if self.about else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> Manifest:
        try:
            data = json.loads(Path(path).read_text())
            files = {
                check_relpath(k, where=str(path)): FileDigest(str(v["sha256"]), int(v["size"]))
                for k, v in data["files"].items()
            }
        except IntegrityError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise IntegrityError(
                f"unreadable checksum manifest ({type(e).__name__}: {e})",
                path=str(path),
                hint="restore it from git, or re-pin with `qship fetch --pin`",
            ) from e
        for rel, d in files.items():
            if not _HEX64.match(d.sha256) or d.size < 0:
                raise IntegrityError(f"bad entry for {rel!r}", path=str(path))
        return cls(data.get("source", ""), data.get("repo_id"), data.get("revision"), files,
                   base_model=data.get("base_model"), about=data.get("about"))  # fmt: skip


def compare_digests(
    expected: dict[str, FileDigest], actual: dict[str, FileDigest], *, where: str
) -> list[str]:
    """Human-readable problems (empty = identical): differing, missing and extra files."""
    problems = []
    for rel in sorted(expected.keys() | actual.keys()):
        e, a = expected.get(rel), actual.get(rel)
        if a is None:
            assert e is not None
            problems.append(f"{rel}: missing (expected sha256 {e.sha256}, {e.size} bytes)")
        elif e is None:
            problems.append(f"{rel}: extra file not in {where} (sha256 {a.sha256})")
        elif e.size != a.size:
            problems.append(
                f"{rel}: size {a.size} != expected {e.size} (truncated or grown); "
                f"sha256 {a.sha256} != expected {e.sha256}"
            )
        elif e.sha256 != a.sha256:
            problems.append(f"{rel}: sha256 {a.sha256} != expected {e.sha256}")
    return problems


# ---------------------------------------------------------------- coreutils SHA256SUMS


def format_sha256sums(entries: dict[str, str]) -> str:
    """coreutils text format, sorted by path: '<hex>  <path>\\n'."""
    lines = []
    for rel in sorted(entries):
        check_relpath(rel, where="SHA256SUMS")
        lines.append(f"{entries[rel]}  {rel}\n")
    return "".join(lines)


def parse_sha256sums(data: bytes, *, where: str = "SHA256SUMS") -> dict[str, str]:
    """Parse and validate a SHA256SUMS file; any malformed line is an IntegrityError.

    Accepts text (' ') and binary ('*') markers; rejects escaped names, duplicates,
    unsafe paths and non-UTF-8 content.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IntegrityError(f"not UTF-8 text ({e})", path=where) from e
    entries: dict[str, str] = {}
    for n, line in enumerate(text.split("\n"), 1):
        if line == "" and n == text.count("\n") + 1:
            break  # text after the last newline is empty
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if not m:
            raise IntegrityError(
                f"line {n} is not '<64 hex>  <path>': {line[:80]!r}",
                path=where,
                hint="regenerate the file with `qship package` or `sha256sum`",
            )
        digest, rel = m.groups()
        check_relpath(rel, where=f"{where} line {n}")
        if rel in entries:
            raise IntegrityError(f"line {n}: {rel!r} listed twice", path=where)
        entries[rel] = digest
    return entries
