"""Greedy agreement: both models continue the same held-out prompts greedily; the share
identical and where the first token differs, the reference's continuations cached, in
eval.json / eval.md / the card / the compare row, and gateable."""

from __future__ import annotations

import pytest
import torch
from factories import eval_report

from pipeline import gate
from pipeline.evaluate import evaluate, greedy
from pipeline.recipe import Gates
from pipeline.records import ModelRef
from pipeline.records.evaluation import EvalOptions


def test_agreement_counts_identical_rows_and_the_first_difference():
    ref = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]])
    cand = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8], [5, 6, 7, 0]])
    a = greedy.agreement(ref, cand)
    assert a.prompts == 4 and a.tokens == 4 and a.identical == 0.25
    assert a.mean_first_difference == (4 + 1 + 0 + 3) / 4  # none differs: counted as 4
    assert a.token_agreement == 13 / 16


def test_prompts_are_the_start_of_each_window_at_most_half_of_it():
    ids = torch.arange(2 * 300).view(2, 300)
    assert greedy.prompts(ids, 1).tolist() == [list(range(64))]
    assert greedy.prompts(ids[:, :40], 2).shape == (2, 20)


@pytest.fixture(scope="module")
def measured(tiny_quantized, tmp_path_factory):
    """evaluate() with greedy agreement twice (the second reads the reference's
    continuations back), and the reference against itself."""
    snap, tokens, qc = tiny_quantized
    ref = ModelRef(path=snap.path, model_hash=snap.model_hash)
    cand = ModelRef(path=qc.path, model_hash=qc.model_hash)
    cache = tmp_path_factory.mktemp("greedy-cache")
    opts = EvalOptions(device="cpu", greedy_prompts=4, greedy_tokens=24)
    ids = tokens.heldout_ids[:4]
    run = lambda c: evaluate(ref, c, heldout_ids=ids, cache_dir=cache, options=opts)  # noqa: E731
    return run(cand), run(cand), run(ref)


def test_the_reference_against_itself_agrees_fully_and_is_cached(measured):
    first, again, itself = measured
    assert itself.greedy is not None and itself.greedy.identical == 1.0
    assert itself.greedy.mean_first_difference == 24 and itself.greedy.token_agreement == 1.0
    g = first.greedy
    assert g is not None and g.prompts == 4 and g.tokens == 24 and not g.reference_cached
    assert 0.0 <= g.identical <= 1.0 and 0 <= g.mean_first_difference <= 24
    assert again.greedy is not None and again.greedy.reference_cached
    assert again.greedy.model_dump(exclude={"reference_cached"}) == g.model_dump(
        exclude={"reference_cached"})  # fmt: skip
    print(g.describe(), first.timings.get("candidate_greedy_s"))


def test_greedy_agreement_is_in_eval_md_the_card_and_the_compare_row(measured, tmp_path):
    from pipeline.artifact.model_card import _results
    from pipeline.compare.rows import row as row_from_eval
    from pipeline.evaluate.markdown import render_markdown
    from pipeline.records import EvalFile

    ev = EvalFile.of(measured[0])
    g = ev.greedy
    assert g is not None
    assert f"Greedy agreement: {g.describe()}" in render_markdown(ev)
    assert any("greedy agreement (4 prompts × 24 tokens)" in line for line in _results(ev))
    row = row_from_eval(ev)
    assert row["greedy_identical"] == g.identical
    assert row["greedy_first_diff"] == g.mean_first_difference
    assert EvalFile.from_json(ev.to_json()).greedy == g


def test_the_gate_bounds_it_and_fails_closed_when_not_measured(measured):
    report = measured[2]  # identical: 1.0
    ok = gate.check(report, Gates(greedy_agreement_min=0.9))
    assert ok.passed and ok.checks[0].name == "greedy_agreement_min"
    low = report.model_copy(update={"greedy": report.greedy.model_copy(update={"identical": 0.5})})
    assert not gate.check(low, Gates(greedy_agreement_min=0.9)).passed
    missing = gate.check(eval_report(), Gates(greedy_agreement_min=0.0))
    assert not missing.passed and "greedy.identical" in (missing.checks[0].note or "")
