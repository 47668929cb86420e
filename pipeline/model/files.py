"""Which files make a Hugging Face checkpoint, the one reader of its config.json, and the
one formula for a model's identity.

`model_hash` is the sha256 of the SHA256SUMS text of the model files (config, generation
config, tokenizer, weights): fetch records it for the snapshot, quantize for its
checkpoint, and evaluate, the reference cache and provenance use those values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..io.hashing import FileDigest, hash_files, list_files
from ..io.problems import Problems, read_json_object

CONFIG = "config.json"
CONFIG_FILES = (CONFIG, "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
TOKENIZER_KEYS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them must exist
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")


def is_model_file(rel: str) -> bool:
    """True for the top-level files that define a checkpoint (and its identity)."""
    if "/" in rel:
        return False
    return (
        rel in CONFIG_FILES
        or rel in TOKENIZER_FILES
        or rel.endswith(WEIGHT_SUFFIXES)
        or rel.endswith(INDEX_SUFFIXES)
    )


def model_hash(files: Mapping[str, FileDigest]) -> str:
    """sha256 over the sorted '<sha256>  <relpath>' lines of the model files in `files`."""
    rels = sorted(r for r in files if is_model_file(r))
    text = "".join(f"{files[r].sha256}  {r}\n" for r in rels)
    return hashlib.sha256(text.encode()).hexdigest()


def hash_model_dir(path: Path) -> tuple[dict[str, FileDigest], str]:
    """(digests of the model files in `path`, model_hash) -- for a folder no stage recorded."""
    files = hash_files(Path(path), [r for r in list_files(Path(path)) if is_model_file(r)])
    return files, model_hash(files)


def require_config_file(folder: Path) -> Path:
    """`folder`/config.json; exit 2 when there is none (not a checkpoint folder)."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise UsageError(
            f"{folder} is not a checkpoint directory (no config.json)",
            path=str(folder),
            hint="pass a folder with config.json and *.safetensors (e.g. written by qship fetch)",
        )
    return path


def collect_config_json(folder: Path, problems: Problems) -> dict[str, Any] | None:
    """The checkpoint's config.json as a dict, or None with the reason in `problems` (for a
    check that lists every problem before it fails)."""
    return read_json_object(Path(folder) / CONFIG, problems, CONFIG)


def read_config_json(folder: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict: exit 2 when the folder has none, exit 3 when
    it is not a JSON object (or over io.problems.MAX_JSON_BYTES)."""
    require_config_file(folder)
    p = Problems(Path(folder), hint="config.json is corrupt: fetch or quantize the model again")
    config = collect_config_json(folder, p)
    p.raise_if_any("config.json check")
    assert config is not None
    return config
