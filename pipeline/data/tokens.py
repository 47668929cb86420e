"""Calibration and held-out token sets: split a corpus by document, window it, cache it.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError, UsageError
from ..io.cache import StageCache, stage_key
from ..recipe import CalibrationConfig, EvaluationConfig
from ..records.tokens import TokenSetInfo, TokenStats
from .corpus import corpus_hash, load_corpus
from .overlap import ngrams

HELDOUT_SALT = "qship-heldout-v1"
SPLIT_VERSION = 2  # 2: calibration documents overlapping held-out ones are dropped
FILE = "tokens.safetensors"


@dataclass(frozen=True)
class TokenSets:
    calib_ids: torch.Tensor  # LongTensor [num_samples, seq_len]
    heldout_ids: torch.Tensor  # LongTensor [sequences, seq_len]
    info: TokenSetInfo

    @property
    def calib_hash(self) -> str:
        return self.info.calib_hash

    @property
    def heldout_hash(self) -> str:
        return self.info.heldout_hash


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
    # a document sharing a word 13-gram with a held-out one (the Lee corpus holds the same
    # news story twice, in lee.cor and lee_background.cor) would calibrate on the text the
    # KL is measured on: it is left out of calibration as well
    held_grams = set().union(*(ngrams(texts[i]) for i in held))
    calib_docs, dropped = [], 0
    for i in range(len(texts)):
        if i in held_set:
            continue
        if held_grams.isdisjoint(ngrams(texts[i])):
            calib_docs.append(i)
        else:
            dropped += 1
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
            f"{windows.shape[0]} windows of {calib.seq_len} (held-out documents excluded, and "
            f"{dropped} documents sharing a 13-word run with held-out text)",
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
        "calibration_documents_dropped": dropped,
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
        "split": SPLIT_VERSION,
    }

    def build(tmp: Path) -> dict:
        calib_ids, heldout, stats = _split_and_window(ds, tokenizer, calib, evaluation, source)
        save_file({"calib_ids": calib_ids, "heldout_ids": heldout}, str(tmp / FILE))
        info = TokenSetInfo(
            calib_shape=tuple(calib_ids.shape),
            heldout_shape=tuple(heldout.shape),
            calib_hash=tensor_hash(calib_ids),
            heldout_hash=tensor_hash(heldout),
            corpus_hash=c_hash,
            source=source,
            stats=TokenStats(**stats),
        )
        return {"file": FILE, "info": info.to_json()}

    if cache_dir is None:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            rec = build(Path(d))
            t = load_file(str(Path(d) / FILE))
    else:
        key = stage_key("tokens", inputs, versions=False)
        entry = StageCache(Path(cache_dir)).get_or_build("tokens", key, build)
        rec = entry.record
        t = load_file(str(entry.path / FILE))
    ts = TokenSets(t["calib_ids"].long(), t["heldout_ids"].long(), TokenSetInfo(**rec["info"]))
    if tensor_hash(ts.calib_ids) != ts.calib_hash or tensor_hash(ts.heldout_ids) != ts.heldout_hash:
        raise IntegrityError(
            "cached token sets do not match their recorded hashes",
            path=str(cache_dir),
            hint="delete the tokens/ folder of the stage cache and run again",
        )
    return ts
