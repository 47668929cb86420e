"""pipeline.hashing: streaming SHA-256 equals hashlib and coreutils `sha256sum`, stays in
constant memory on a file larger than 1 GiB, and the SHA256SUMS reader/writer agrees with
`sha256sum -c` and rejects anything malformed or unsafe."""

from __future__ import annotations

import hashlib
import io
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import IntegrityError
from pipeline.io.hashing import (
    CHUNK,
    FileDigest,
    format_sha256sums,
    hash_files,
    list_files,
    parse_sha256sums,
    sha256_file,
)

SHA256SUM = shutil.which("sha256sum")
needs_sha256sum = pytest.mark.skipif(SHA256SUM is None, reason="coreutils sha256sum missing")


def coreutils_sha256(path: Path) -> str:
    out = subprocess.run([SHA256SUM, "-b", str(path)], check=True, capture_output=True, text=True)
    return out.stdout.split()[0].lstrip("\\")


# sizes around the chunk boundary, empty, one byte, odd sizes
SIZES = [0, 1, 63, 64, 65, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 12345]


@pytest.fixture(scope="module")
def random_files(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("random_files")
    rng = random.Random(1234)
    contents = {}
    for i, n in enumerate(SIZES):
        rel = f"f{i}_{n}.bin" if i % 2 else f"sub/dir/f{i}_{n}.bin"
        data = rng.randbytes(n)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        contents[rel] = data
    # a name with a space and non-ASCII characters (sha256sum handles them unescaped)
    (root / "a name é.json").write_bytes(b'{"x": 1}\n')
    contents["a name é.json"] = b'{"x": 1}\n'
    return root, contents


@needs_sha256sum
@pytest.mark.parametrize("readahead", [False, True])
def test_sha256_file_equals_hashlib_and_coreutils(random_files, readahead):
    root, contents = random_files
    for rel, data in contents.items():
        d = sha256_file(root / rel, readahead=readahead)
        assert d == FileDigest(hashlib.sha256(data).hexdigest(), len(data)), rel
        assert d.sha256 == coreutils_sha256(root / rel), rel
    # odd chunk sizes give the same digest
    rel = next(r for r in contents if len(contents[r]) == 3 * CHUNK + 12345)
    want = hashlib.sha256(contents[rel]).hexdigest()
    for chunk in (7, 4096, CHUNK * 2):  # 1 is too slow for 3 MiB; the 65-byte file has it
        assert sha256_file(root / rel, chunk=chunk, readahead=readahead).sha256 == want
    small = next(r for r in contents if len(contents[r]) == 65)
    assert (
        sha256_file(root / small, chunk=1, readahead=readahead).sha256
        == hashlib.sha256(contents[small]).hexdigest()
    )


def _readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sha256-readahead"]


def test_readahead_errors_propagate_and_stop_the_reader(random_files):
    """A read error reaches the caller; so does an error while hashing (here from the
    progress callback), and in both cases no reader thread is left behind."""
    from pipeline.io.hashing import _digest_readahead

    class Failing(io.BytesIO):
        def readinto(self, b):
            if self.tell() >= 2 * 4096:
                raise OSError(5, "Input/output error")
            return super().readinto(b)

    with pytest.raises(OSError, match="Input/output error"):
        _digest_readahead(Failing(bytes(10 * 4096)), hashlib.sha256(), 4096, None)
    assert not _readahead_threads()

    root, contents = random_files
    big = next(r for r in contents if len(contents[r]) == 3 * CHUNK + 12345)
    calls = []

    def stop_after_two(n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sha256_file(root / big, chunk=4096, readahead=True, on_bytes=stop_after_two)
    assert not _readahead_threads()


def test_hash_files_reads_ahead_only_with_cores_to_spare(random_files, monkeypatch):
    import pipeline.io.hashing as hashing

    root, contents = random_files
    seen = []
    real = hashing.sha256_file

    def spy(path, **kw):
        seen.append(kw["readahead"])
        return real(path, **kw)

    monkeypatch.setattr(hashing, "sha256_file", spy)
    for cores, files, workers, want in [
        (2, 1, None, True),  # one big file, a core idle: read ahead
        (2, 2, None, False),  # every core hashes a file
        (8, 3, None, True),
        (8, 8, None, False),
        (8, 8, 2, True),  # capped at 2 workers: 6 cores idle
    ]:
        monkeypatch.setattr(hashing.os, "cpu_count", lambda cores=cores: cores)
        seen.clear()
        got = hashing.hash_files(root, list(contents)[:files], workers=workers)
        assert set(seen) == {want}, (cores, files, workers)
        for rel, d in got.items():
            assert d.sha256 == hashlib.sha256(contents[rel]).hexdigest()


def test_hash_files_threads_and_list_files(random_files):
    root, contents = random_files
    assert list_files(root) == sorted(contents)
    seen = []
    lock = threading.Lock()

    def on_bytes(n):
        with lock:
            seen.append(n)

    got = hash_files(root, list(contents) + list(contents)[:2], workers=2, on_bytes=on_bytes)
    assert list(got) == sorted(contents)  # sorted, duplicates collapsed
    for rel, data in contents.items():
        assert got[rel] == FileDigest(hashlib.sha256(data).hexdigest(), len(data))
    assert sum(seen) == sum(len(d) for d in contents.values())


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@needs_sha256sum
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_larger_than_1gib_constant_memory(tmp_path):
    """A 1 GiB + 1 MiB + 17 B file: same digest as hashlib and sha256sum, and the resident
    set grows by far less than the file while it is hashed (sampled every 5 ms)."""
    block = random.Random(7).randbytes(CHUNK)
    tail = b"tail-of-the-file!"
    n_blocks = 1025
    path = tmp_path / "big.bin"
    ref = hashlib.sha256()
    with open(path, "wb") as fh:
        for i in range(n_blocks):
            # vary each block so a reader that skipped or repeated a chunk would be caught
            b = i.to_bytes(8, "little") + block[8:]
            fh.write(b)
            ref.update(b)
        fh.write(tail)
        ref.update(tail)
    size = n_blocks * CHUNK + len(tail)
    assert size > 1 << 30
    try:
        base = _rss_bytes()
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes())
                time.sleep(0.005)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.monotonic()
        d = sha256_file(path)
        elapsed = time.monotonic() - t0
        done.set()
        t.join()
        peak[0] = max(peak[0], _rss_bytes())
        assert d == FileDigest(ref.hexdigest(), size)
        growth = peak[0] - base
        assert growth < 32 * 1024 * 1024, f"RSS grew by {growth / 2**20:.1f} MiB in {elapsed:.1f} s"
        assert coreutils_sha256(path) == d.sha256
    finally:
        path.unlink(missing_ok=True)


@needs_sha256sum
def test_format_sha256sums_round_trips_through_sha256sum_c(random_files):
    root, contents = random_files
    digests = {rel: sha256_file(root / rel).sha256 for rel in contents}
    text = format_sha256sums(digests)
    assert text.endswith("\n") and text.count("\n") == len(contents)
    assert [line.split("  ", 1)[1] for line in text.splitlines()] == sorted(contents)
    (root / "SHA256SUMS").write_text(text)
    try:
        ok = subprocess.run(
            [SHA256SUM, "-c", "--strict", "SHA256SUMS"], cwd=root, capture_output=True, text=True
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.count(": OK") == len(contents)
        assert parse_sha256sums(text.encode()) == digests
        # the reverse direction: what sha256sum writes, parse_sha256sums reads
        theirs = subprocess.run(
            [SHA256SUM, *sorted(contents)], cwd=root, check=True, capture_output=True
        ).stdout
        assert parse_sha256sums(theirs) == digests
        theirs_b = subprocess.run(
            [SHA256SUM, "-b", *sorted(contents)], cwd=root, check=True, capture_output=True
        ).stdout
        assert b" *" in theirs_b and parse_sha256sums(theirs_b) == digests
        # sha256sum -c catches a changed file listed by format_sha256sums
        victim = root / sorted(contents)[-1]
        original = victim.read_bytes()
        victim.write_bytes(original + b"x")
        try:
            bad = subprocess.run(
                [SHA256SUM, "-c", "SHA256SUMS"], cwd=root, capture_output=True, text=True
            )
            assert bad.returncode == 1 and f"{victim.name}: FAILED" in bad.stdout
        finally:
            victim.write_bytes(original)
    finally:
        (root / "SHA256SUMS").unlink()


def test_format_sha256sums_refuses_unsafe_paths():
    for rel in ("../x", "/etc/passwd", "a/../../b", "a\\b", "a\nb", ""):
        with pytest.raises(IntegrityError):
            format_sha256sums({rel: "0" * 64})


H = "ab" * 32


@pytest.mark.parametrize(
    "data, what",
    [
        (f"{H} ../evil\n".encode(), "line 1"),  # one space: not the format
        (f"{H}  ../evil\n".encode(), "unsafe path"),
        (f"{H}  a/../../evil\n".encode(), "unsafe path"),
        (f"{H}  /etc/passwd\n".encode(), "unsafe path"),
        (f"{H}  //etc/passwd\n".encode(), "unsafe path"),
        (f"{H}  a\\b\n".encode(), "unsafe path"),
        (f"{H}  ./a\n".encode(), "unsafe path"),
        (f"{H}  a//b\n".encode(), "unsafe path"),
        (f"{H}  a.bin\n{H}  a.bin\n".encode(), "listed twice"),
        (f"{H}  a.bin\n{'cd' * 32} *a.bin\n".encode(), "listed twice"),
        (f"{H[:-1]}  a.bin\n".encode(), "line 1"),  # 63 hex
        (f"{H}0  a.bin\n".encode(), "line 1"),  # 65 hex
        (f"{H.upper()}  a.bin\n".encode(), "line 1"),  # upper-case hex
        (f"{'g' * 64}  a.bin\n".encode(), "line 1"),
        (f"{H}a.bin\n".encode(), "line 1"),  # no separator
        (f"{H}\ta.bin\n".encode(), "line 1"),
        (f"{H}  \n".encode(), "line 1"),  # no name
        (f"\\{H}  a\\nb\n".encode(), "line 1"),  # coreutils escaped name
        (f"{H}  ok.bin\n\n".encode(), "line 2"),  # blank line
        (f"{H}  ok.bin\ngarbage\n".encode(), "line 2"),
        (f"SHA256 (a.bin) = {H}\n".encode(), "line 1"),  # BSD tag format
        (b"\xff\xfe not utf-8\n", "UTF-8"),
        (f"{H}  a\x01b\n".encode(), "unsafe path"),
    ],
)
def test_parse_sha256sums_rejects(data, what):
    with pytest.raises(IntegrityError) as ei:
        parse_sha256sums(data, where="pkg/SHA256SUMS")
    msg = str(ei.value)
    assert what in msg, msg
    assert ei.value.exit_code == 3


def test_parse_sha256sums_accepts():
    assert parse_sha256sums(b"") == {}
    assert parse_sha256sums(f"{H}  a.bin".encode()) == {"a.bin": H}  # no final newline
    assert parse_sha256sums(f"{H} *d/b c.bin\n{H}  a.bin\n".encode()) == {
        "d/b c.bin": H,
        "a.bin": H,
    }
