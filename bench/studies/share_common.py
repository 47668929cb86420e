"""What bench/studies/kv_layer_share.py, act_share.py, w4a8_table_ab.py and served_noise.py share:
their arguments, the text
(the last 60 documents of the exported corpus, the same Lee news text qship calibrates on,
cut into rows of 512 tokens) and the reference's logits on it, full vocabulary, on the CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from pipeline.evaluate import kl_stats
from pipeline.evaluate.scoring import forward_logits
from pipeline.model.loading import load_model


def arguments(doc: str, extra: Any = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("candidate", type=Path)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--corpus", type=Path, default=Path(".qship-gpu/english.jsonl"))
    ap.add_argument("--out", type=Path, required=True)
    if extra:
        extra(ap)
    return ap.parse_args()


def reference_and_candidate(
    a: argparse.Namespace, dtype: str | None = None
) -> tuple[Any, Any, Any, Any]:
    """(token rows, the reference's logits, next tokens, the loaded candidate: float32 on
    the CPU, or `dtype`)."""
    tok = AutoTokenizer.from_pretrained(a.reference)
    docs = [json.loads(line)["text"] for line in a.corpus.open(encoding="utf-8")]
    ids = tok("\n\n".join(docs[-60:]), return_tensors="pt")["input_ids"][0]
    ids = ids[: a.sequences * a.seq_len].view(a.sequences, a.seq_len)
    ref = load_model(a.reference, device="cpu")
    ref_logits, nxt = forward_logits(ref, ids)
    del ref
    return ids, ref_logits, nxt, load_model(a.candidate, device="cpu", dtype=dtype)


def mean_kl(ref_logits: Any, cand: Any, ids: Any, nxt: Any) -> float:
    """The candidate's mean exact full-vocabulary KL to the reference on the rows."""
    logits, _ = forward_logits(cand, ids)
    return float(kl_stats.exact_token_stats_fast(ref_logits, logits.float(), nxt)["kl"].mean())
