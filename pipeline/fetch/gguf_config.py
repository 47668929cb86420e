"""A GGUF's transformers config from its metadata, without parsing its vocabulary.

transformers 5.17 builds a GGUF's config (`AutoConfig.from_pretrained(gguf_file=...)`, its
`load_gguf_checkpoint`) on gguf's `GGUFReader`, which turns every metadata value into numpy
views first: for Gemma 3 270M the 262,144 tokens, their scores and types, 25 s of a 2-core
CPU and most of the recipe stage on the H100 host, for a config of some twenty keys.
transformers' own header reader (`integrations.gguf.reader.read_gguf_metadata`) walks the
same metadata in 0.1 s and leaves a vocabulary as its length. The library's conversion
(architecture renames, its defaults, Gemma 3's text-only model type) then runs unchanged on
a reader made of that metadata: every field except the tokenizer's arrays, and the
vocabulary's length as `<arch>.vocab_size` where the file states none (the token count is
what transformers takes for it then). tests/test_fetch_gguf.py holds the result to the
library's own reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# string arrays left as their length: the vocabulary and the BPE merges (llama.cpp's keys)
_LENGTH_ONLY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


class _KeepStrings:
    """`read_gguf_metadata`'s `string_arrays`: every string array read but the large two."""

    def __contains__(self, key: object) -> bool:
        return key not in _LENGTH_ONLY


def gguf_config(path: Path) -> Any:
    """The config transformers reads from the GGUF at `path`."""
    from transformers import AutoConfig

    def read() -> Any:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)

    reader = _MetadataReader(path)
    with _lean_reader(reader):
        config = read()
    if reader.vocab_from_tokens not in (None, getattr(config, "vocab_size", None)):
        return read()  # a family whose config takes no `vocab_size` key: the library's way
    return config


@contextlib.contextmanager
def _lean_reader(reader: _MetadataReader) -> Iterator[None]:
    """`gguf.GGUFReader(...)` gives `reader` inside the block (transformers' loader imports
    the name when it runs)."""
    import gguf

    old = gguf.GGUFReader
    gguf.GGUFReader = lambda *_a, **_k: reader
    try:
        yield
    finally:
        gguf.GGUFReader = old


class _MetadataReader:
    """What `load_gguf_checkpoint(return_tensors=False)` reads of a `GGUFReader`: `fields`
    (gguf `ReaderField`s) and the tensors' names."""

    def __init__(self, path: Path) -> None:
        from types import SimpleNamespace

        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, names = read_gguf_metadata(str(path), _KeepStrings())
        self.tensors = [SimpleNamespace(name=n) for n in names]
        arch = metadata["general.architecture"]
        vocab = metadata.get("tokenizer.ggml.tokens")
        self.vocab_from_tokens: int | None = None
        if f"{arch}.vocab_size" not in metadata and isinstance(vocab, int):
            metadata[f"{arch}.vocab_size"] = self.vocab_from_tokens = vocab
        self.fields = {
            k: _field(k, v)
            for k, v in metadata.items()
            if not (k.startswith("tokenizer.") and (k in _LENGTH_ONLY or isinstance(v, list)))
        }


def _field(name: str, value: Any) -> Any:
    """A gguf `ReaderField` holding `value` as GGUFReader would: one part per value, `data`
    indexing them, `types` the value type (and an array's element type)."""
    import numpy as np
    from gguf import GGUFValueType as T
    from gguf import ReaderField

    def kind(v: Any) -> Any:
        if isinstance(v, bool):
            return T.BOOL
        if isinstance(v, int):
            return T.INT64 if v < 0 else T.UINT64
        return T.FLOAT64 if isinstance(v, float) else T.STRING

    def part(v: Any) -> Any:
        return (
            np.frombuffer(v.encode("utf-8"), dtype=np.uint8)
            if isinstance(v, str)
            else np.array([v])
        )

    if isinstance(value, list):
        types = [T.ARRAY, kind(value[0]) if value else T.UINT8]
        return ReaderField(0, name, [part(v) for v in value], list(range(len(value))), types)
    return ReaderField(0, name, [part(value)], [0], [kind(value)])
