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


# --- code and chat calibration (calibration.mix, calibration.chat_template) ---------------

CHAT = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # fmt: skip


def test_builtin_python_is_real_code_without_test_suites():
    import ast

    ds, source = load_corpus("builtin:python")
    assert source == "builtin:python" and set(ds["part"]) == {"code"}
    assert sum(len(t) for t in ds["text"]) >= 2_000_000 and len(set(ds["doc_id"])) == len(ds)
    assert not any("/test/" in d or "/tests/" in d for d in ds["doc_id"])
    for text in ds["text"][:20]:
        ast.parse(text)  # Python source, as written
    again, _ = load_corpus("builtin:python")
    assert again["doc_id"] == ds["doc_id"]  # a fixed order, not the file system's


def test_corpora_mixed_by_weight(tok, tmp_path):
    from pipeline.data.tokens import shares

    assert shares(16, [0.75, 0.25]) == [12, 4] and shares(5, [1, 1, 1]) == [2, 2, 1]
    plain = build_token_sets(tok, CAL, EV, cache_dir=tmp_path)
    mix = [{"source": "builtin:english", "weight": 3}, {"source": "builtin:python", "weight": 1}]
    mixed = build_token_sets(tok, CAL.model_copy(update={"mix": CalibrationConfig(mix=mix).mix}),
                             EV, cache_dir=tmp_path)  # fmt: skip
    assert mixed.info.stats.calibration_mix == {"builtin:english": 12, "builtin:python": 4}
    assert mixed.calib_ids.shape == (16, 128)
    # the held-out tokens are the prose ones either way; calibration differs, and so the key
    assert (
        torch.equal(mixed.heldout_ids, plain.heldout_ids) and mixed.calib_hash != plain.calib_hash
    )
    code = tok.batch_decode(mixed.calib_ids[12:])
    assert all("\n    " in t for t in code)  # indented source lines
    # the prose share: windows the prose-only calibration draws too (the same seeded order)
    prose = {r.numpy().tobytes() for r in plain.calib_ids}
    assert all(r.numpy().tobytes() in prose for r in mixed.calib_ids[:12])
    assert len(list((tmp_path / "tokens").iterdir())) == 2
    with pytest.raises(ValueError, match="twice"):
        CalibrationConfig(mix=[mix[0], mix[0]])
    with pytest.raises(ValueError, match="builtin corpora"):
        CalibrationConfig(mix=[{"source": "builtin:rust", "weight": 1}])


def test_chat_template_wraps_calibration_but_not_the_heldout_text(tok, tmp_path):
    from pipeline.data.tokens import in_chat

    with pytest.raises(UsageError, match="no chat template"):
        build_token_sets(tok, CAL.model_copy(update={"chat_template": True}), EV,
                         cache_dir=tmp_path)  # fmt: skip
    chat_tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    chat_tok.chat_template = "{{ bos_token }}" + CHAT
    text = "First line of a document.\nSecond line.\nThird line here."
    # split at the line break nearest the middle; the template's BOS left to the windows
    assert in_chat(chat_tok, text) == ("<start_of_turn>user\nFirst line of a document."
                                       "<end_of_turn>\n<start_of_turn>assistant\nSecond line.\n"
                                       "Third line here.<end_of_turn>\n")  # fmt: skip
    plain = build_token_sets(chat_tok, CAL, EV, cache_dir=tmp_path)
    chat = build_token_sets(chat_tok, CAL.model_copy(update={"chat_template": True}), EV,
                            cache_dir=tmp_path)  # fmt: skip
    assert torch.equal(chat.heldout_ids, plain.heldout_ids) and chat.calib_hash != plain.calib_hash
    decoded = chat_tok.batch_decode(chat.calib_ids)
    assert sum(t.count("<start_of_turn>assistant") for t in decoded) > 0
    assert not any("<start_of_turn>" in t for t in chat_tok.batch_decode(chat.heldout_ids))
    assert len(list((tmp_path / "tokens").iterdir())) == 2


def test_keys_of_recipes_without_the_new_fields_stay_as_they_were():
    old = {
        k: v for k, v in CAL.model_dump(mode="json").items() if k not in ("chat_template", "mix")
    }
    assert CAL.key_fields() == old
    assert CAL.model_copy(update={"chat_template": True}).key_fields() == {
        **old,
        "chat_template": True,
    }
