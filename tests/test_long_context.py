"""The long-context retrieval check (pipeline/evaluate/long_context.py, recipe
`serve.long_context`): the trials it builds, the lengths it accepts, the engines' tail
top-1 against full logits, the check's figures and its gate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline import gate
from pipeline.errors import UsageError
from pipeline.evaluate import long_context as lc
from pipeline.evaluate.engines import TransformersEngine
from pipeline.recipe import LongContext, ServeGate

TEXT = ["The river rose in the night and the town woke to water in the streets. " * 40,
        "A committee met on Tuesday to discuss the budget for the coming year. " * 40]  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def filler(tok):
    return lc.filler_ids(tok, TEXT)


def test_trials_are_exact_length_with_the_passkey_last_and_in_the_needle(tok, filler):
    t = lc.build(tok, filler, 300, trials=4, seed=1)
    assert t.ids.shape == (4, 300) and len(set(t.keys)) == 4
    for row, key in zip(t.ids.tolist(), t.keys, strict=True):
        assert tok.decode(row[-t.answer_len :]).strip() == key
        text = tok.decode(row)
        assert text.count(f"The pass key is {key}.") == 1
        assert text.rstrip().endswith(f"What is the pass key? The pass key is {key}")
    # the needle moves through the text: deeper for each trial
    at = [tok.decode(r).index("The pass key is") for r in t.ids.tolist()]
    assert at == sorted(at) and at[0] < at[-1]
    # the same seed gives the same trials; another seed other keys
    assert torch.equal(lc.build(tok, filler, 300, trials=4, seed=1).ids, t.ids)
    assert lc.build(tok, filler, 300, trials=4, seed=2).keys != t.keys


def test_lengths_beyond_the_context_or_too_short_for_the_needle_exit_2(tok, filler):
    assert lc.resolve_lengths(LongContext(lengths=[256, "max"]), 512) == [256, 512]
    with pytest.raises(UsageError) as e:
        lc.resolve_lengths(LongContext(lengths=[1024]), 512)
    assert e.value.exit_code == 2 and e.value.path == "serve.long_context.lengths"
    assert "512" in e.value.hint
    with pytest.raises(UsageError) as e:
        lc.resolve_lengths(LongContext(lengths=["max"]), None)
    assert e.value.path == "serve.long_context.lengths"
    with pytest.raises(UsageError) as e:  # header + needle + question alone are ~60 tokens
        lc.build(tok, filler, 70, trials=2)
    assert e.value.path == "serve.long_context.lengths" and "at least" in e.value.hint
    with pytest.raises(ValueError, match="no room"):
        ServeGate(long_context={"lengths": [32]})


def test_transformers_tail_top1_is_the_full_forward_argmax(tiny_llama, tok, filler):
    t = lc.build(tok, filler, 200, trials=2)
    eng = TransformersEngine(tiny_llama, device="cpu")
    got = eng.tail_top1(t.ids, t.answer_len)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        full = model(input_ids=t.ids).logits
    want = full[:, -t.answer_len - 1 : -1].argmax(-1)
    assert got.shape == (2, t.answer_len) and torch.equal(got, want)


class _Copier:
    """Returns the passkey for the first `ok` trials of each call, wrong digits after."""

    def __init__(self, ok: int, name: str = "fake"):
        self.ok, self.name, self.facts = ok, name, {}

    def tail_top1_sets(self, sets: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        outs = []
        for ids, n in sets:
            out = ids[:, -n:].clone()
            out[self.ok :] = (out[self.ok :] + 1) % 100
            outs.append(out)
        return outs


def _run(tok, ok: dict[tuple[str, str], int], has_kv: bool):
    made = []

    def make(folder, kv):
        made.append((folder.name, kv))
        return _Copier(ok[(folder.name, kv)])

    from pathlib import Path

    res = lc.run(make, Path("art"), Path("ref"), LongContext(lengths=[200, "max"], trials=4,
                 max_drop=0.25), kv_cache_dtype="auto", has_kv_scheme=has_kv, tokenizer=tok,
                 texts=TEXT, max_positions=256)  # fmt: skip
    return res, made


def test_check_figures_and_gate(tok):
    ok = {("ref", "bfloat16"): 4, ("art", "auto"): 2, ("art", "bfloat16"): 4}
    res, made = _run(tok, ok, has_kv=True)
    # reference once, the artifact as served and with a 16-bit KV cache
    assert made == [("ref", "bfloat16"), ("art", "auto"), ("art", "bfloat16")]
    assert [r.length for r in res.rows] == [200, 256]
    r = res.rows[0]
    assert (r.reference, r.served, r.served_16bit, r.drop) == (1.0, 0.5, 1.0, 0.5)
    assert not res.passed and len(res.failures) == 2 and "16-bit KV cache 100%" in res.failures[0]
    # the gate: one check per length, failed beyond max_drop
    checks = gate.long_context_checks(res)
    assert [c.name for c in checks] == ["serve.long_context.200", "serve.long_context.256"]
    assert not any(c.passed for c in checks) and checks[0].value == 0.5
    assert res.kv_cache_at_fault()  # the 16-bit KV cache retrieves all of them
    ok[("art", "bfloat16")] = 2  # the weights lose it too: not the KV cache's fault
    res, _ = _run(tok, ok, has_kv=True)
    assert not res.passed and not res.kv_cache_at_fault()
    ok[("art", "bfloat16")] = 4

    # within the limit: passes; no quantized KV cache: the 16-bit run is not repeated
    ok[("art", "auto")] = 3
    res, made = _run(tok, ok, has_kv=False)
    assert len(made) == 2 and res.passed and res.rows[0].served_16bit is None
    assert all(c.passed for c in gate.long_context_checks(res))
