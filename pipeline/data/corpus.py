"""Text corpora for calibration and held-out evaluation, loaded through `datasets`.

Sources (`calibration.source` in a recipe):

* `builtin:english` -- real English text that installs from PyPI / ships with the OS:
  gensim's Lee corpus (`lee_background.cor`, 300 news articles, + `lee.cor`, 50 more),
  the license texts in /usr/share/common-licenses and Python's `pydoc_data` topics.
* `builtin:python` -- real code offline: Python's own standard library source (the
  running interpreter's; test suites left out), files picked in a fixed hash order up to
  PYTHON_BYTES, one document per file (part "code").
* `hf:<dataset>[:config]` -- a Hub dataset with a `text` column, when it can be had;
  otherwise (offline, no such dataset) the builtin corpus, and the source says so.
* a local `.txt` (documents = paragraphs) or `.jsonl`/`.json` file (a `text` field per row;
  rows that also carry `doc_id` and `part` keep them, so a corpus exported with
  `bench/device/export_corpus.py` gives the same split and the same tokens as its source).

Every corpus is a `datasets.Dataset` with columns text, doc_id and part.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .. import log
from ..errors import UsageError

LICENSES_DIR = Path("/usr/share/common-licenses")
# the distributions a corpus source needs at run time beyond qship's core (a GPU host's
# wheel list, bench/device/gpu_wheels.txt, must carry them: tests/test_cli.py checks)
SOURCE_NEEDS = {"builtin:english": ("gensim", "smart_open", "wrapt")}


def _gensim_dir() -> Path:
    try:
        import gensim  # noqa: F401  (only to locate its test data)
    except ImportError as e:  # pragma: no cover - it is a pinned dependency
        raise UsageError(
            "builtin:english needs gensim (its Lee news corpus)", hint="pip install gensim==4.4.0"
        ) from e
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "test" / "test_data"


def _builtin_english() -> Any:
    import pydoc_data.topics

    import datasets

    parts = []
    gdir = _gensim_dir()
    for fname in ("lee_background.cor", "lee.cor"):
        # lee.cor is Latin-1 (a pound sign); lee_background.cor is ASCII
        ds = datasets.load_dataset(
            "text", data_files=str(gdir / fname), encoding="latin-1", split="train"
        )
        ds = ds.filter(lambda r: bool(r["text"].strip()))
        parts.append(
            ds.map(
                lambda r, i, f=fname: {"doc_id": f"{f}:{i}", "part": "news"},
                with_indices=True,
            )
        )
    lic = (
        sorted(str(p) for p in LICENSES_DIR.iterdir() if p.is_file() and not p.is_symlink())
        if LICENSES_DIR.is_dir()
        else []
    )
    if lic:
        ds = datasets.load_dataset("text", data_files=lic, sample_by="document", split="train")
        parts.append(
            ds.map(
                lambda r, i: {"doc_id": f"license:{Path(lic[i]).name}", "part": "licenses"},
                with_indices=True,
            )
        )
    topics = pydoc_data.topics.topics
    parts.append(
        datasets.Dataset.from_list(
            [{"text": topics[k], "doc_id": f"pydoc:{k}", "part": "pydoc"} for k in sorted(topics)]
        )
    )
    return datasets.concatenate_datasets(parts)


PYTHON_BYTES = 2_000_000  # enough for any mix's share of calibration windows, quick to tokenize
_TEST_DIRS = {"test", "tests", "idle_test", "unittest"}


def _builtin_python() -> Any:
    import sysconfig

    import datasets

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if p.is_file() and not p.is_symlink()
             and not _TEST_DIRS & set(p.relative_to(root).parts)
             and "site-packages" not in p.parts and p.stat().st_size < 200_000]  # fmt: skip
    files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())
    rows, total = [], 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        rows.append({"text": text, "doc_id": f"python:{p.relative_to(root)}", "part": "code"})
        total += len(text)
        if total >= PYTHON_BYTES:
            break
    return datasets.Dataset.from_list(rows)


def _local(path: Path) -> Any:
    import datasets

    if not path.is_file():
        raise UsageError(
            f"calibration source {path} does not exist",
            path=str(path),
            hint="use builtin:english, hf:<dataset>[:config], or an existing .txt/.jsonl file",
        )
    if path.suffix in (".jsonl", ".json"):
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        if "text" not in ds.column_names:
            raise UsageError(
                f"no 'text' field in {path} (fields: {ds.column_names})",
                path=str(path),
                hint="write one JSON object per line with a 'text' field",
            )
        # doc_id/part, when present, are kept: `bench/device/export_corpus.py` writes builtin:english
        # this way so a machine without gensim builds the very same token sets
        if {"doc_id", "part"} <= set(ds.column_names):
            cols = ["text", "doc_id", "part"]
            return ds.select_columns(cols).filter(lambda r: bool(r["text"].strip()))
        ds = ds.select_columns(["text"])
    else:
        ds = datasets.load_dataset(
            "text", data_files=str(path), sample_by="paragraph", split="train"
        )
    ds = ds.filter(lambda r: bool(r["text"].strip()))
    return ds.map(lambda r, i: {"doc_id": f"{path.name}:{i}", "part": "local"}, with_indices=True)


def _hub(spec: str) -> Any:
    import datasets

    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None, split="train")
    if "text" not in ds.column_names:
        raise UsageError(f"Hub dataset {name} has no 'text' column ({ds.column_names})")
    ds = ds.select_columns(["text"]).filter(lambda r: bool(r["text"].strip()))
    return ds.map(lambda r, i: {"doc_id": f"{name}:{i}", "part": "hub"}, with_indices=True)


def load_corpus(source: str) -> tuple[Any, str]:
    """Return (datasets.Dataset with text/doc_id/part, source actually used)."""
    if source == "builtin:english":
        return _builtin_english(), source
    if source == "builtin:python":
        return _builtin_python(), source
    if source.startswith("hf:"):
        try:
            return _hub(source[3:]), source
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - offline or missing: fall back, and say so
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            log.info(f"Hub dataset {source[3:]} unavailable ({msg}); using builtin:english")
            return _builtin_english(), f"builtin:english (fallback from {source}: unavailable)"
    return _local(Path(source)), source


def corpus_hash(ds: Any) -> str:
    h = hashlib.sha256()
    for doc_id, text in zip(ds["doc_id"], ds["text"], strict=True):
        h.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()
