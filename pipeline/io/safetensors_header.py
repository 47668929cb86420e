"""A bounds-checked safetensors reader and a deterministic writer.

Never trusts a header before checking it: the 8-byte little-endian length must be at
most MAX_HEADER and fit in the file; the JSON must be an object of tensors, each with a
known dtype, a shape of non-negative ints and `data_offsets` [begin, end] whose span is
exactly numel * itemsize; the spans must tile the data region from 0 to its end with no
gap and no overlap (the layout the safetensors library itself requires). Any violation
is an IntegrityError naming the file; no other exception escapes `parse_header`.

The writer lays tensors out sorted by name with a canonical JSON header (sorted keys, no
spaces, padded with spaces to a multiple of 8), so the same tensors give the same bytes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import IntegrityError

MAX_HEADER = 100 * 1024 * 1024  # 100 MB, the limit the safetensors library enforces
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
MAX_RANK = 8


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data region
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Header:
    path: str
    header_len: int
    file_size: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] | None = None

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(prefix: bytes, file_size: int, *, where: str = "<safetensors>") -> Header:
    """Validate a safetensors header given the file's first bytes and its total size.

    `prefix` must hold at least the 8 length bytes plus the header (read_header reads
    exactly that much after checking the length).
    """
    fail = functools.partial(_malformed, where=where)
    n, obj = _header_object(prefix, file_size, fail)
    meta = obj.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise fail("__metadata__ must map strings to strings")
    data_len = file_size - 8 - n
    tensors = {name: _tensor_info(name, t, data_len, fail) for name, t in obj.items()}
    pos = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != pos:
            kind = "overlaps the previous tensor" if t.begin < pos else f"leaves a gap at {pos}"
            raise fail(f"tensor {name!r} at [{t.begin}, {t.end}] {kind}")
        pos = t.end
    if pos != data_len:
        raise fail(f"tensors cover {pos} bytes but the data region has {data_len} (trailing bytes)")
    return Header(where, n, file_size, tensors, meta)


def _malformed(msg: str, *, where: str) -> IntegrityError:
    return IntegrityError(
        f"malformed safetensors file: {msg}",
        path=where,
        hint="re-package the artifact from the quantized checkpoint; do not deploy this file",
    )


def _header_object(
    prefix: bytes, file_size: int, fail: Callable[[str], IntegrityError]
) -> tuple[int, dict]:
    """(header length, the header's JSON object): its length within the file, UTF-8 JSON,
    an object, no key twice."""
    if file_size < 8 or len(prefix) < 8:
        raise fail(f"file is {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0 or n > MAX_HEADER:
        raise fail(f"header length {n} is outside 1..{MAX_HEADER} bytes")
    if n > file_size - 8:
        raise fail(f"header length {n} exceeds the file size {file_size} - 8 (truncated file?)")
    if len(prefix) < 8 + n:
        raise fail(f"could read only {len(prefix) - 8} of {n} header bytes")
    raw = prefix[8 : 8 + n]
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("header does not start with '{'")
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise fail(f"header is not a JSON object ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise fail("header is not a JSON object")
    return n, obj


def _tensor_info(
    name: str, t: Any, data_len: int, fail: Callable[[str], IntegrityError]
) -> TensorInfo:
    """One header entry: a known dtype, a shape, offsets that span exactly its bytes and
    end within the data region."""
    if not name or not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
        raise fail(f"tensor {name[:80]!r}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise fail(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_int(d) and 0 <= d < 2**48 for d in shape)
    ):
        raise fail(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of sizes")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(_is_int(o) for o in offs)
        and 0 <= offs[0] <= offs[1]
    ):
        raise fail(f"tensor {name!r}: data_offsets {str(offs)[:80]} is not [begin, end]")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offs[1] - offs[0] != nbytes:
        raise fail(
            f"tensor {name!r}: data_offsets span {offs[1] - offs[0]} bytes, "
            f"but {dtype}{shape} needs {nbytes}"
        )
    if offs[1] > data_len:
        raise fail(
            f"tensor {name!r}: data ends at {offs[1]}, beyond the {data_len} data bytes "
            "(truncated file?)"
        )
    return TensorInfo(dtype, tuple(shape), offs[0], offs[1])


def read_header(path: Path) -> Header:
    """Read and validate the header of a file on disk (reads only 8 + header bytes)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if 0 < n <= min(MAX_HEADER, size - 8):
                    head += fh.read(n)
    except OSError as e:
        raise IntegrityError(f"cannot read ({e.strerror})", path=str(path)) from e
    return parse_header(head, size, where=str(path))


def read_tensor_bytes(fh: BinaryIO, header: Header, name: str) -> bytes:
    t = header.tensors[name]
    fh.seek(header.data_start + t.begin)
    data = fh.read(t.end - t.begin)
    if len(data) != t.end - t.begin:
        raise IntegrityError(f"tensor {name!r}: short read", path=header.path)
    return data


def read_int_tensor(path: Path, header: Header, name: str, *, max_numel: int = 16) -> list[int]:
    """Values of a small integer tensor (e.g. compressed-tensors' `weight_shape`)."""
    t = header.tensors[name]
    fmt = {"I64": "q", "I32": "i", "I16": "h", "U8": "B", "I8": "b", "U32": "I", "U64": "Q"}
    if t.dtype not in fmt or t.numel > max_numel:
        raise IntegrityError(
            f"tensor {name!r}: expected a small integer tensor, found {t.dtype}{list(t.shape)}",
            path=header.path,
        )
    with open(path, "rb") as fh:
        data = read_tensor_bytes(fh, header, name)
    return list(struct.unpack(f"<{t.numel}{fmt[t.dtype]}", data))


def header_bytes(tensors: dict[str, TensorInfo], metadata: dict[str, str] | None) -> bytes:
    obj: dict = {}
    if metadata is not None:
        obj["__metadata__"] = dict(sorted(metadata.items()))
    for name in sorted(tensors):
        t = tensors[name]
        obj[name] = {"data_offsets": [t.begin, t.end], "dtype": t.dtype, "shape": list(t.shape)}
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw


def layout(specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, TensorInfo]:
    """Offsets for tensors stored in name order: {name: (dtype, shape)} -> TensorInfo."""
    out, pos = {}, 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        out[name] = TensorInfo(dtype, tuple(shape), pos, pos + n)
        pos += n
    return out


def shard_plan(tensors: dict[str, TensorInfo], shard_size: int) -> list[list[str]]:
    """Split names (sorted) into consecutive shards of at most shard_size data bytes each
    (a tensor larger than shard_size gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].end - tensors[name].begin
        if shards[-1] and size + n > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards
