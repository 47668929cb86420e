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
from ..recipe.schema import CorpusShare
from ..records.tokens import TokenSetInfo, TokenStats
from .chat import in_chat_template
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


def _middle(text: str) -> int:
    """Where a document is split into a user turn and a reply: the line break nearest its
    middle, else the space, else the middle."""
    mid = len(text) // 2
    for sep in ("\n", " "):
        cuts = [i for i in (text.rfind(sep, 0, mid), text.find(sep, mid)) if 0 < i < len(text) - 1]
        if cuts:
            return min(cuts, key=lambda i: abs(i - mid))
    return mid


def in_chat(tokenizer: Any, text: str) -> str:
    """A calibration document as a conversation in the model's chat template: its first
    half the user's turn, the rest the assistant's reply (both real text, nothing added)."""
    cut = _middle(text)
    messages = [{"role": "user", "content": text[:cut]},
                {"role": "assistant", "content": text[cut + 1 :] or text[cut:]}]  # fmt: skip
    return in_chat_template(tokenizer, messages, generation_prompt=False,
                            where="calibration.chat_template")  # fmt: skip


def _encode(tokenizer: Any, texts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        texts = [in_chat(tokenizer, t) for t in texts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _heldout(ds: Any, enc: list[list[int]], evaluation: EvaluationConfig, bos: int | None,
             eos: int | None, source: str) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """Held-out documents ranked by a fixed hash of their text, from the news part when
    the corpus has one, until the evaluation windows are covered; and their windows."""
    texts, parts = list(ds["text"]), list(ds["part"])
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
    heldout = _windows([enc[i] for i in held], evaluation.seq_len, bos, eos)
    if heldout.shape[0] < evaluation.sequences:
        total = sum(len(enc[i]) for i in cands)
        raise UsageError(
            f"not enough held-out text in {source}: evaluation needs {evaluation.sequences} × "
            f"{evaluation.seq_len} tokens ({need} tokens) but the eligible documents hold {total}",
            hint="lower evaluation.sequences / evaluation.seq_len or use a larger corpus",
        )
    return held, heldout[: evaluation.sequences]


def _clean(texts: list[str], skip: set[int], held_grams: set) -> tuple[list[int], int]:
    """Documents that may calibrate: not held out and sharing no word 13-gram with a
    held-out one (the Lee corpus holds the same news story twice, in lee.cor and
    lee_background.cor). -> (their indices, how many were dropped for a shared 13-gram)."""
    keep, dropped = [], 0
    for i, text in enumerate(texts):
        if i in skip:
            continue
        if held_grams.isdisjoint(ngrams(text)):
            keep.append(i)
        else:
            dropped += 1
    return keep, dropped


def _pick(windows: torch.Tensor, n: int, seed: int, source: str, docs: int, dropped: int,
          seq_len: int) -> torch.Tensor:  # fmt: skip
    if windows.shape[0] < n:
        raise UsageError(
            f"not enough calibration text in {source}: calibration needs {n} × "
            f"{seq_len} tokens but the {docs} calibration documents give only "
            f"{windows.shape[0]} windows of {seq_len} (held-out documents excluded, and "
            f"{dropped} documents sharing a 13-word run with held-out text)",
            hint="lower calibration.num_samples / calibration.seq_len or use a larger corpus",
        )
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(windows.shape[0], generator=g)[:n]
    return windows[pick.sort().values]


def shares(n: int, weights: list[float]) -> list[int]:
    """`n` windows split by weight, largest remainders first (they add up to `n`)."""
    exact = [n * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _split_and_window(ds, tokenizer, calib: CalibrationConfig, evaluation: EvaluationConfig,
                      source: str, others: dict[str, Any] | None = None):  # fmt: skip
    """(calibration windows, held-out windows, stats): the held-out from `ds`, the
    calibration from its other documents or, with `calib.mix`, from each corpus of the mix
    (`others`: source -> corpus) by weight."""
    texts, doc_ids = list(ds["text"]), list(ds["doc_id"])
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    held, heldout = _heldout(ds, enc, evaluation, bos, eos, source)
    held_set = set(held)
    held_grams = set().union(*(ngrams(texts[i]) for i in held))
    mix = calib.mix or [CorpusShare(source=calib.source, weight=1.0)]
    parts, stats_mix, n_docs, n_dropped, available = [], {}, 0, 0, 0
    for share, n in zip(mix, shares(calib.num_samples, [m.weight for m in mix]), strict=True):
        own = share.source == calib.source
        src_texts = texts if own else list((others or {})[share.source]["text"])
        docs, dropped = _clean(src_texts, held_set if own else set(), held_grams)
        src_enc = ([enc[i] for i in docs] if own and not calib.chat_template
                   else _encode(tokenizer, [src_texts[i] for i in docs], calib.chat_template))  # fmt: skip
        windows = _windows(src_enc, calib.seq_len, bos, eos)
        parts.append(_pick(windows, n, calib.seed, share.source, len(docs), dropped,
                           calib.seq_len))  # fmt: skip
        stats_mix[share.source] = n
        n_docs, n_dropped, available = (n_docs + len(docs), n_dropped + dropped,
                                        available + int(windows.shape[0]))  # fmt: skip
    calib_ids = torch.cat(parts)

    # the held-out windows are in no calibration window
    held_rows = {r.numpy().tobytes() for r in heldout}
    assert not any(r.numpy().tobytes() in held_rows for r in calib_ids), (
        "a calibration window equals a held-out window"
    )
    stats = {
        "documents": len(texts),
        "heldout_documents": [doc_ids[i] for i in held],
        "calibration_documents": n_docs,
        "calibration_documents_dropped": n_dropped,
        "calibration_windows_available": available,
        "tokens_total": int(sum(len(e) for e in enc)),
        "calibration_mix": stats_mix if calib.mix else {},
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
    others = {m.source: load_corpus(m.source)[0] for m in calib.mix if m.source != calib.source}
    inputs = {
        "tokenizer": tokenizer_hash(tokenizer),
        "corpus": c_hash,
        # the newer fields only when set: entries made before them keep their keys
        "calibration": calib.key_fields(),
        **(
            {"mix_corpora": {s: corpus_hash(d) for s, d in sorted(others.items())}}
            if others
            else {}
        ),
        **(
            {"chat_template": getattr(tokenizer, "chat_template", None)}
            if calib.chat_template
            else {}
        ),
        "evaluation": {"sequences": evaluation.sequences, "seq_len": evaluation.seq_len},
        "salt": HELDOUT_SALT,
        "split": SPLIT_VERSION,
    }

    def build(tmp: Path) -> dict:
        calib_ids, heldout, stats = _split_and_window(ds, tokenizer, calib, evaluation, source,
                                                      others)  # fmt: skip
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
