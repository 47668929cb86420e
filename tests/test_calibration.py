"""Calibration / held-out token sets: real English, disjoint by document, cached by hash."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.data.corpus import load_corpus
from pipeline.data.tokens import build_token_sets, tensor_hash
from pipeline.errors import UsageError
from pipeline.recipe import CalibrationConfig, EvaluationConfig


@pytest.fixture(scope="module")
def tok(tiny_gemma):
    return AutoTokenizer.from_pretrained(tiny_gemma)


CAL = CalibrationConfig(num_samples=16, seq_len=128, batch_size=16, seed=0)
EV = EvaluationConfig(sequences=8, seq_len=128)


def test_builtin_corpus_is_real_english():
    ds, source = load_corpus("builtin:english")
    assert source == "builtin:english"
    parts = set(ds["part"])
    assert {"news", "pydoc"} <= parts
    news = [t for t, p in zip(ds["text"], ds["part"], strict=True) if p == "news"]
    assert len(news) == 350  # lee_background (300) + lee (50)
    assert sum(len(t) for t in ds["text"]) > 800_000
    assert len(set(ds["doc_id"])) == len(ds)


def test_token_sets_disjoint_deterministic_cached(tok, tmp_path):
    a = build_token_sets(tok, CAL, EV, cache_dir=tmp_path)
    assert a.calib_ids.shape == (16, 128) and a.heldout_ids.shape == (8, 128)
    assert a.calib_ids.dtype == torch.long
    assert (a.calib_ids[:, 0] == tok.bos_token_id).all() and (
        a.heldout_ids[:, 0] == tok.bos_token_id
    ).all()
    # split by document: the held-out documents are news articles, none used for calibration
    held_docs = set(a.info.stats.heldout_documents)
    assert held_docs and all(d.startswith(("lee_background.cor:", "lee.cor:")) for d in held_docs)
    assert a.info.stats.calibration_documents + len(held_docs) == a.info.stats.documents
    # no held-out window appears in calibration, and no shared 32-token span either
    held_spans = {tuple(r[i : i + 32].tolist()) for r in a.heldout_ids for i in range(1, 97, 8)}
    for r in a.calib_ids:
        assert not any(tuple(r[i : i + 32].tolist()) in held_spans for i in range(1, 97))
    # hashes are of the content
    assert a.calib_hash == tensor_hash(a.calib_ids) and a.heldout_hash == tensor_hash(a.heldout_ids)
    # cached: one entry; a second call gives the same tensors
    entries = list((tmp_path / "tokens").iterdir())
    assert (
        len(entries) == 1
        and json.loads((entries[0] / "stage.json").read_text())["info"]["calib_hash"]
        == a.calib_hash
    )
    b = build_token_sets(tok, CAL, EV, cache_dir=tmp_path)
    assert torch.equal(a.calib_ids, b.calib_ids) and torch.equal(a.heldout_ids, b.heldout_ids)
    assert a.info == b.info
    # another calibration seed: other calibration windows, the same held-out set
    c = build_token_sets(tok, CAL.model_copy(update={"seed": 1}), EV, cache_dir=tmp_path)
    assert c.calib_hash != a.calib_hash and c.heldout_hash == a.heldout_hash
    assert len(list((tmp_path / "tokens").iterdir())) == 2


def test_not_enough_text_names_the_numbers(tok):
    with pytest.raises(UsageError) as ei:
        build_token_sets(tok, CAL.model_copy(update={"num_samples": 100_000}), EV)
    assert ei.value.exit_code == 2
    assert "100000 × 128" in ei.value.message and "windows" in ei.value.message
    with pytest.raises(UsageError) as ei:
        build_token_sets(tok, CAL, EV.model_copy(update={"sequences": 100_000}))
    assert "100000 × 128" in ei.value.message


def _distinct_docs(n: int, seed: int = 0) -> list[str]:
    import random

    words = "the quick brown fox jumps over lazy dog river stone cloud light tree".split()
    rng = random.Random(seed)
    return [f"Document {i}. " + " ".join(rng.choice(words) for _ in range(300)) for i in range(n)]


def test_local_jsonl_source(tok, tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in _distinct_docs(40)))
    ts = build_token_sets(
        tok,
        CalibrationConfig(source=str(p), num_samples=4, seq_len=64),
        EvaluationConfig(sequences=2, seq_len=64),
    )
    assert ts.info.source == str(p) and ts.calib_ids.shape == (4, 64)
    assert ts.info.stats.calibration_documents_dropped == 0


def test_calibration_drops_documents_repeating_heldout_text(tok, tmp_path):
    """A corpus holding the same story twice must not calibrate on the copy of a held-out
    document; with every document a copy, the error says why nothing is left."""
    docs = _distinct_docs(40)
    p = tmp_path / "twice.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in docs + docs))
    ts = build_token_sets(
        tok,
        CalibrationConfig(source=str(p), num_samples=4, seq_len=64),
        EvaluationConfig(sequences=2, seq_len=64),
    )
    held = len(ts.info.stats.heldout_documents)
    assert ts.info.stats.calibration_documents_dropped >= held
    same = tmp_path / "same.jsonl"
    same.write_text("\n".join(json.dumps({"text": docs[0]}) for _ in range(40)))
    with pytest.raises(UsageError, match="13-word run"):
        build_token_sets(
            tok,
            CalibrationConfig(source=str(same), num_samples=4, seq_len=64),
            EvaluationConfig(sequences=2, seq_len=64),
        )


def test_hub_source_falls_back_offline(tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ts = build_token_sets(
        tok, CAL.model_copy(update={"source": "hf:no-such-org/no-such-dataset"}), EV
    )
    assert ts.info.source.startswith(
        "builtin:english (fallback from hf:no-such-org/no-such-dataset"
    )
    assert ts.calib_ids.shape == (16, 128)


def test_missing_local_file_is_usage_error(tok, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        build_token_sets(tok, CAL.model_copy(update={"source": str(tmp_path / "nope.txt")}), EV)


def test_exported_jsonl_gives_the_builtin_token_sets(tok, tmp_path):
    """bench/device/export_corpus.py's JSONL (text + doc_id + part) builds the very same
    calibration and held-out tokens as builtin:english (how the GPU runs match the CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, str(root / "bench" / "device" / "export_corpus.py"), str(tmp_path)],
        check=True, capture_output=True,
    )  # fmt: skip
    jl = tmp_path / "english.jsonl"
    a = build_token_sets(tok, CAL, EV)
    b = build_token_sets(tok, CAL.model_copy(update={"source": str(jl)}), EV)
    assert (a.calib_hash, a.heldout_hash, a.info.corpus_hash) == (
        b.calib_hash,
        b.heldout_hash,
        b.info.corpus_hash,
    )
    assert torch.equal(a.heldout_ids, b.heldout_ids)
