"""gate.check: every configured limit is one check; non-finite values and unrun tasks fail."""

from __future__ import annotations

import math

import pytest
from factories import eval_report

from pipeline import gate
from pipeline.errors import GateFailed, RecipeError
from pipeline.evaluate.paired import paired
from pipeline.recipe import Gates, parse_recipe
from pipeline.records import Verdict

# 100 items: the reference gets 40 right, the candidate loses 5 of them and gains 2 others
REF = {str(i): float(i < 40) for i in range(100)}
CAND = {**REF, **{str(i): 0.0 for i in range(5)}, "50": 1.0, "51": 1.0}
TASKS = {
    "hellaswag": {"status": "ok", "metric": "acc_norm", "split": "validation", "n_total": 10042,
                  **paired(REF, CAND, where="hellaswag")},
    "arc_easy": {"status": "skipped", "reason": "Hub unreachable (offline)", "data": "hub"},
}  # fmt: skip


def _report(**over):
    return eval_report(tasks=TASKS, **over)


def test_all_pass_lists_every_check():
    r = _report()
    m = r.metrics
    g = Gates(
        kl_mean_max=m.kl.mean + 0.01, kl_p99_max=m.kl.p99 + 0.1, top1_min=m.top1_agreement - 0.05,
        ppl_ratio_max=m.ppl_ratio + 0.1, tasks={"hellaswag": {"max_drop": 5.0}},
    )  # fmt: skip
    v = gate.check(r, g)
    assert v.passed
    assert [c.name for c in v.checks] == [
        "kl_mean_max", "kl_p99_max", "top1_min", "ppl_ratio_max", "tasks.hellaswag.max_drop"
    ]  # fmt: skip
    c = {c.name: c for c in v.checks}
    assert c["kl_mean_max"].to_json() == {
        "name": "kl_mean_max", "value": m.kl.mean, "limit": m.kl.mean + 0.01, "op": "<=",
        "passed": True, "note": None,
    }  # fmt: skip
    assert c["top1_min"].op == ">=" and c["tasks.hellaswag.max_drop"].value == pytest.approx(3.0)
    assert v.to_json()["failed"] == [] and "PASSED" in v.summary()


def test_failures_are_named_and_raise_exit_4():
    r = _report()
    g = Gates(kl_mean_max=r.metrics.kl.mean / 2, top1_min=0.999, ppl_ratio_max=100.0,
              tasks={"hellaswag": {"max_drop": 1.0}})  # fmt: skip
    v = gate.check(r, g)
    assert not v.passed
    assert v.failed == ["kl_mean_max", "top1_min", "tasks.hellaswag.max_drop"]
    assert "FAIL kl_mean_max" in v.summary()
    with pytest.raises(GateFailed) as e:
        gate.require_pass(v, where="out/eval.json", result=v)
    assert e.value.exit_code == 4 and e.value.result is v and "3 of 4" in e.value.message
    gate.require_pass(gate.check(r, Gates()), where="x")  # passes: no exception


def test_limits_are_inclusive_and_none_is_unset():
    r = _report()
    v = gate.check(r, Gates(kl_mean_max=r.metrics.kl.mean, top1_min=r.metrics.top1_agreement))
    assert v.passed and len(v.checks) == 2


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_value_fails_closed(bad):
    v = gate.check(_report(ppl_ratio=bad), Gates(ppl_ratio_max=10.0))
    assert not v.passed and v.checks[0].value is None and "metrics.ppl_ratio" in v.checks[0].note


def test_task_not_run_fails_with_reason():
    g = Gates(tasks={"arc_easy": {"max_drop": 1.0}, "piqa": {"max_drop": 1.0}})
    v = gate.check(_report(), g)
    assert not v.passed
    notes = {c.name: c.note for c in v.checks}
    assert "offline" in notes["tasks.arc_easy.max_drop"]
    assert "not evaluated" in notes["tasks.piqa.max_drop"]


def test_task_gate_says_whether_the_drop_is_beyond_noise():
    v = gate.check(_report(), Gates(tasks={"hellaswag": {"max_drop": 1.0}}))
    c = v.checks[0]
    # 5 lost, 2 gained of 100: +3 pp, but the paired interval reaches below 0
    assert not c.passed and c.value == pytest.approx(3.0)
    assert "within noise" in c.note and "40.0% -> 37.0%" in c.note
    assert "100 of 10042 validation items" in c.note


def test_gate_on_a_task_not_evaluated_is_a_recipe_error():
    data = {"name": "x", "groups": [{"name": "a", "targets": ["Linear"], "method": "none"}],
            "evaluation": {"tasks": ["arc_easy"]}, "gates": {"tasks": {"piqa": {"max_drop": 1}}}}  # fmt: skip
    with pytest.raises(RecipeError, match="gates.tasks.piqa"):
        parse_recipe(data)
    old = {**data, "gates": {"tasks": {"arc_easy": {"score_drop_max": 1}}}}
    with pytest.raises(RecipeError, match="score_drop_max"):
        parse_recipe(old)


def test_no_gates_passes_and_unknown_gate_is_recipe_error():
    assert gate.check(_report(), Gates()).passed
    data = {"name": "x", "groups": [{"name": "a", "targets": ["Linear"], "method": "none"}],
            "gates": {"kl_mean_maxx": 0.1}}  # fmt: skip
    with pytest.raises(RecipeError, match="kl_mean_maxx"):
        parse_recipe(data)


def test_verdict_round_trips_through_json():
    v = gate.check(_report(), Gates(kl_mean_max=0.01, tasks={"hellaswag": {"max_drop": 5.0}}))
    back = Verdict.from_json(v.to_json())
    assert back == v and back.failed == ["kl_mean_max"]
