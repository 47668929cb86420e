"""Calibration and held-out evaluation token sets, built through `datasets`, cached by hash.

Sources (`calibration.source` in the recipe):

* `builtin:english` -- real English text that installs from PyPI / ships with the OS:
  gensim's Lee corpus (`lee_background.cor`, 300 news articles, + `lee.cor`, 50 more),
  the license texts in /usr/share/common-licenses and Python's `pydoc_data` topics.
* `hf:<dataset>[:config]` -- a Hub dataset with a `text` column, when it can be had;
  otherwise (offline, no such dataset) qship falls back to `builtin:english` and says so
  in `TokenSets.source`.
* a local `.txt` (documents = paragraphs) or `.jsonl`/`.json` file (a `text` field per row;
  rows that also carry `doc_id` and `part` keep them, so a corpus exported with
  `bench/export_corpus.py` gives the same split and the same tokens as its source).

The split is by DOCUMENT: the held-out documents are chosen by a fixed hash of their text
(independent of the calibration seed, so every recipe is evaluated on the same tokens),
from the news part for `builtin:english`; all other documents feed calibration. No text is
shared between the two sets; this is asserted on document ids and on the token windows.

Each window is `seq_len` tokens: BOS (when the tokenizer has one) + `seq_len - 1` tokens
of the concatenated documents (EOS between documents). Tensors are cached under
`cache_dir/tokens/<key>/` with key = (tokenizer hash, corpus hash, config).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cache import StageCache, stage_key
from .errors import UsageError
from .recipe import CalibrationConfig, EvaluationConfig

HELDOUT_SALT = "qship-heldout-v1"
LICENSES_DIR = Path("/usr/share/common-licenses")


@dataclass
class TokenSets:
    calib_ids: torch.Tensor  # LongTensor [num_samples, seq_len]
    heldout_ids: torch.Tensor  # LongTensor [sequences, seq_len]
    calib_hash: str
    heldout_hash: str
    corpus_hash: str
    source: str
    stats: dict | None = None

    def to_json(self) -> dict:
        return {
            "calib_shape": list(self.calib_ids.shape),
            "heldout_shape": list(self.heldout_ids.shape),
            "calib_hash": self.calib_hash,
            "heldout_hash": self.heldout_hash,
            "corpus_hash": self.corpus_hash,
            "source": self.source,
            "stats": self.stats or {},
        }

    def summary(self) -> str:
        c, h = self.calib_ids.shape, self.heldout_ids.shape
        return (
            f"calibration {c[0]}×{c[1]} tokens ({self.calib_hash[:12]}), held-out "
            f"{h[0]}×{h[1]} ({self.heldout_hash[:12]}), source {self.source}"
        )


def tensor_hash(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(list(t.shape)).encode())
    h.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: hash its vocabulary
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# corpora (each row: text, doc_id, part)


def _gensim_dir() -> Path:
    try:
        import gensim  # noqa: F401  (only to locate its test data)
    except ImportError as e:  # pragma: no cover - it is a pinned dependency
        raise UsageError(
            "builtin:english needs gensim (its Lee news corpus)", hint="pip install gensim==4.4.0"
        ) from e
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    return Path(spec.origin).parent / "test" / "test_data"


def _builtin_english():
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


def _local(path: Path):
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
        # doc_id/part, when present, are kept: `bench/export_corpus.py` writes builtin:english
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


def _hub(spec: str):
    import datasets

    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None, split="train")
    if "text" not in ds.column_names:
        raise UsageError(f"Hub dataset {name} has no 'text' column ({ds.column_names})")
    ds = ds.select_columns(["text"]).filter(lambda r: bool(r["text"].strip()))
    return ds.map(lambda r, i: {"doc_id": f"{name}:{i}", "part": "hub"}, with_indices=True)


def load_corpus(source: str):
    """Return (datasets.Dataset with text/doc_id/part, source actually used)."""
    if source == "builtin:english":
        return _builtin_english(), source
    if source.startswith("hf:"):
        try:
            return _hub(source[3:]), source
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - offline or missing: fall back, and say so
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            print(
                f"qship: Hub dataset {source[3:]} unavailable ({msg}); using builtin:english",
                file=sys.stderr,
            )
            return _builtin_english(), f"builtin:english (fallback from {source}: unavailable)"
    return _local(Path(source)), source


def corpus_hash(ds) -> str:
    h = hashlib.sha256()
    for doc_id, text in zip(ds["doc_id"], ds["text"], strict=True):
        h.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------


def _windows(docs: list[list[int]], seq_len: int, bos: int | None, eos: int | None) -> torch.Tensor:
    stream: list[int] = []
    for ids in docs:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    body = seq_len - 1 if bos is not None else seq_len
    n = len(stream) // body
    if n == 0:
        return torch.empty((0, seq_len), dtype=torch.long)
    t = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    if bos is not None:
        t = torch.cat([torch.full((n, 1), bos, dtype=torch.long), t], dim=1)
    return t


def _split_and_window(
    ds, tokenizer, calib: CalibrationConfig, evaluation: EvaluationConfig, source: str
):
    texts = list(ds["text"])
    doc_ids = list(ds["doc_id"])
    parts = list(ds["part"])
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    # held-out: documents ranked by a fixed hash of their text, from the news part when
    # the corpus has one, until the evaluation windows are covered
    prefer = "news" if "news" in parts else None
    cands = [i for i in range(len(texts)) if prefer is None or parts[i] == prefer]
    cands.sort(key=lambda i: hashlib.sha256((HELDOUT_SALT + texts[i]).encode()).hexdigest())
    body = evaluation.seq_len - (1 if bos is not None else 0)
    need = evaluation.sequences * body
    held: list[int] = []
    have = 0
    for i in cands:
        if have >= need:
            break
        held.append(i)
        have += len(enc[i]) + (1 if eos is not None else 0)
    held_set = set(held)
    calib_docs = [i for i in range(len(texts)) if i not in held_set]
    heldout = _windows([enc[i] for i in held], evaluation.seq_len, bos, eos)
    if heldout.shape[0] < evaluation.sequences:
        total = sum(len(enc[i]) for i in cands)
        raise UsageError(
            f"not enough held-out text in {source}: evaluation needs {evaluation.sequences} × "
            f"{evaluation.seq_len} tokens ({need} tokens) but the eligible documents hold {total}",
            hint="lower evaluation.sequences / evaluation.seq_len or use a larger corpus",
        )
    heldout = heldout[: evaluation.sequences]

    windows = _windows([enc[i] for i in calib_docs], calib.seq_len, bos, eos)
    if windows.shape[0] < calib.num_samples:
        raise UsageError(
            f"not enough calibration text in {source}: calibration needs {calib.num_samples} × "
            f"{calib.seq_len} tokens but the {len(calib_docs)} calibration documents give only "
            f"{windows.shape[0]} windows of {calib.seq_len} (held-out documents excluded)",
            hint="lower calibration.num_samples / calibration.seq_len or use a larger corpus",
        )
    g = torch.Generator().manual_seed(calib.seed)
    pick = torch.randperm(windows.shape[0], generator=g)[: calib.num_samples]
    calib_ids = windows[pick.sort().values]

    # the two sets share no document and no window
    assert held_set.isdisjoint(calib_docs), "held-out and calibration documents overlap"
    held_rows = {r.numpy().tobytes() for r in heldout}
    assert not any(r.numpy().tobytes() in held_rows for r in calib_ids), (
        "a calibration window equals a held-out window"
    )
    stats = {
        "documents": len(texts),
        "heldout_documents": [doc_ids[i] for i in held],
        "calibration_documents": len(calib_docs),
        "calibration_windows_available": int(windows.shape[0]),
        "tokens_total": int(sum(len(e) for e in enc)),
    }
    return calib_ids, heldout, stats


def build_token_sets(
    tokenizer: Any,
    calib: CalibrationConfig,
    evaluation: EvaluationConfig,
    *,
    cache_dir: Path | None = None,
) -> TokenSets:
    """Tokenize the corpus once; return disjoint calibration and held-out token sets."""
    from safetensors.torch import load_file, save_file

    ds, source = load_corpus(calib.source)
    c_hash = corpus_hash(ds)
    inputs = {
        "tokenizer": tokenizer_hash(tokenizer),
        "corpus": c_hash,
        "calibration": calib.model_dump(mode="json"),
        "evaluation": {"sequences": evaluation.sequences, "seq_len": evaluation.seq_len},
        "salt": HELDOUT_SALT,
    }

    def build(tmp: Path) -> dict:
        calib_ids, heldout, stats = _split_and_window(ds, tokenizer, calib, evaluation, source)
        save_file({"calib_ids": calib_ids, "heldout_ids": heldout}, str(tmp / "tokens.safetensors"))
        return {
            "file": "tokens.safetensors",
            "calib_hash": tensor_hash(calib_ids),
            "heldout_hash": tensor_hash(heldout),
            "corpus_hash": c_hash,
            "source": source,
            "stats": stats,
        }

    if cache_dir is None:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            rec = build(Path(d))
            t = load_file(str(Path(d) / rec["file"]))
    else:
        key = stage_key("tokens", inputs, versions=False)
        entry = StageCache(Path(cache_dir)).get_or_build("tokens", key, build)
        rec = entry.record
        t = load_file(str(entry.path / rec["file"]))
    ts = TokenSets(
        calib_ids=t["calib_ids"].long(),
        heldout_ids=t["heldout_ids"].long(),
        calib_hash=rec["calib_hash"],
        heldout_hash=rec["heldout_hash"],
        corpus_hash=rec["corpus_hash"],
        source=rec["source"],
        stats=rec.get("stats"),
    )
    assert tensor_hash(ts.calib_ids) == ts.calib_hash, (
        "cached calibration tokens do not match their hash"
    )
    assert tensor_hash(ts.heldout_ids) == ts.heldout_hash, (
        "cached held-out tokens do not match their hash"
    )
    return ts
