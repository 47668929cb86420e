"""A GGUF file's header checked against the file before any library reads it.

transformers and gguf's GGUFReader trust the header: a truncated file or one claiming
10^12 tensors ends in an uncaught struct.error, a reshape ValueError or an allocation as
large as the claim. `check_gguf` walks the header itself (GGUF v2/v3: magic, counts,
metadata, tensor infos), holding every count and length to the bytes that remain, and every
tensor's data to the file's data section; anything else is exit 3, "malformed file".
Nothing is allocated by a claim: fixed-size arrays are skipped, not read.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..errors import IntegrityError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4
DEFAULT_ALIGNMENT = 32
# value types (gguf.GGUFValueType): fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# the smallest encodings: a key (empty name) with a 1-byte value; a 0-d tensor info
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8


class Malformed(Exception):
    """Raised inside the walk; check_gguf turns it into an IntegrityError."""


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos = buf, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> int:
        """Advance over `n` bytes; the offset they start at."""
        if n < 0 or n > self.left():
            raise Malformed(f"{what} needs {n:,} bytes at offset {self.pos:,}, the file has "
                            f"{self.left():,} left (truncated, or a false length)")  # fmt: skip
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return int(struct.unpack_from(fmt, self.buf, start)[0])

    def count(self, what: str, each: int) -> int:
        """A uint64 count of items at least `each` bytes long, held to the bytes left."""
        n = self.unpack("<Q", what)
        if n * each > self.left():
            raise Malformed(f"{what} is {n:,}, but {self.left():,} bytes remain for them "
                            f"(at least {each} each)")  # fmt: skip
        return n

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", f"{what}'s length")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n])


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> int | None:
    """Skip one metadata value; a uint32/uint64 (for general.alignment) is returned."""
    if vtype in _FIXED:
        size = _FIXED[vtype]
        start = cur.take(size, f"the value of {key}")
        return int.from_bytes(cur.buf[start : start + size], "little") if vtype in (4, 10) else None
    if vtype == _STRING:
        cur.string(f"the value of {key}")
        return None
    if vtype != _ARRAY:
        raise Malformed(f"metadata {key} has value type {vtype}, not a GGUF type")
    if depth >= MAX_ARRAY_NESTING:
        raise Malformed(f"metadata {key} nests arrays deeper than {MAX_ARRAY_NESTING}")
    etype = cur.unpack("<I", f"{key}'s element type")
    n = cur.count(f"{key}'s element count", _FIXED.get(etype, 8))
    if etype in _FIXED:
        cur.take(n * _FIXED[etype], f"the elements of {key}")
    elif etype == _STRING:
        _skip_strings(cur, n, key)
    else:
        for _ in range(n):
            _value(cur, etype, key, depth + 1)
    return None


def _skip_strings(cur: _Cursor, n: int, key: str) -> None:
    """n length-prefixed strings (a vocabulary: 262k for Gemma), in one tight loop."""
    buf, pos, end, read = cur.buf, cur.pos, len(cur.buf), struct.Struct("<Q").unpack_from
    for i in range(n):
        if pos + 8 > end or (pos := pos + 8 + read(buf, pos)[0]) > end:
            raise Malformed(f"string {i:,} of {key} runs past the end of the file (truncated, "
                            "or a false length)")  # fmt: skip
    cur.pos = pos


def _tensor_bytes(ggml_type: int, dims: list[int], name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise Malformed(f"tensor {name} has type {ggml_type}, not a GGML type") from None
    n = 1
    for d in dims:
        n *= d
    if dims and dims[0] % block:
        raise Malformed(f"tensor {name}: its rows of {dims[0]} are not whole blocks of {block}")
    return n // block * type_size


def walk(buf: mmap.mmap | bytes) -> int:
    """Walk a GGUF header in `buf`; the number of tensors. Malformed on any violation."""
    cur = _Cursor(buf)
    if cur.left() < 4 or bytes(buf[:4]) != MAGIC:
        raise Malformed("no GGUF magic at offset 0")
    cur.take(4, "the magic")
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        raise Malformed(f"GGUF version {version}, qship reads versions {VERSIONS}")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.count("the metadata count", _MIN_KV)
    if n_tensors * _MIN_TENSOR > cur.left():
        raise Malformed(f"the tensor count is {n_tensors:,}, but {cur.left():,} bytes remain "
                        "for the header")  # fmt: skip
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string("a metadata key").decode("utf-8", "replace")
        value = _value(cur, cur.unpack("<I", f"{key}'s type"), key)
        if key == "general.alignment":
            if not value or value & (value - 1):
                raise Malformed(f"general.alignment is {value}, not a power of two")
            alignment = value
    tensors: list[tuple[str, int, int]] = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name").decode("utf-8", "replace")
        n_dims = cur.unpack("<I", f"tensor {name}'s dimension count")
        if n_dims > MAX_DIMS:
            raise Malformed(f"tensor {name} has {n_dims} dimensions, GGML has at most {MAX_DIMS}")
        dims = [cur.unpack("<Q", f"tensor {name}'s shape") for _ in range(n_dims)]
        nbytes = _tensor_bytes(cur.unpack("<I", f"tensor {name}'s type"), dims, name)
        tensors.append((name, cur.unpack("<Q", f"tensor {name}'s offset"), nbytes))
    data_start = -(-cur.pos // alignment) * alignment
    data_size = len(buf) - data_start
    for name, offset, nbytes in tensors:
        if offset % alignment or offset + nbytes > data_size:
            raise Malformed(f"tensor {name}'s {nbytes:,} bytes at data offset {offset:,} lie "
                            f"outside the file's {max(data_size, 0):,}-byte data section "
                            f"(or off its {alignment}-byte alignment)")  # fmt: skip
    return n_tensors


def check_gguf(path: Path) -> int:
    """Exit 3 (IntegrityError) for a GGUF whose header does not hold against the file; the
    number of tensors otherwise."""
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, 2) == 0:
                raise Malformed("the file is empty")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return walk(buf)
    except Malformed as e:
        raise IntegrityError(
            f"malformed file: {e}",
            path=str(path),
            hint="not a complete GGUF: fetch it again from a trusted source (a partial "
            "download is truncated), or check that this is the file you meant",
        ) from None
