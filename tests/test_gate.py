"""gate.check: every configured limit is one check; missing values and unrun tasks fail."""

from __future__ import annotations

import math

import pytest

from pipeline import gate
from pipeline.errors import RecipeError


def _eval(**over) -> dict:
    ev = {
        "metrics": {"kl": {"mean": 0.2, "p99": 1.6}, "top1_agreement": 0.77, "ppl_ratio": 1.2},
        "benchmarks": {
            "tasks": {
                "qship_lastword": {
                    "status": "ok",
                    "metric": "acc",
                    "reference": {"value": 0.40},
                    "candidate": {"value": 0.37},
                    "drop": 0.03,
                },
                "arc_easy": {"status": "skipped", "reason": "offline", "hub": True},
            }
        },
    }
    ev["metrics"].update(over)
    return ev


def test_all_pass_lists_every_check():
    g = {
        "kl_mean_max": 0.25,
        "kl_p99_max": 2.0,
        "top1_min": 0.7,
        "ppl_ratio_max": 1.3,
        "tasks": {"qship_lastword": {"score_drop_max": 0.05}},
    }
    v = gate.check(_eval(), g)
    assert v.passed
    assert [c["name"] for c in v.checks] == [
        "kl_mean_max",
        "kl_p99_max",
        "top1_min",
        "ppl_ratio_max",
        "tasks.qship_lastword.score_drop_max",
    ]
    c = {c["name"]: c for c in v.checks}
    assert c["kl_mean_max"] == {
        "name": "kl_mean_max",
        "value": 0.2,
        "limit": 0.25,
        "op": "<=",
        "passed": True,
    }
    assert c["top1_min"]["op"] == ">="
    assert v.to_json()["failed"] == []
    assert "PASSED" in v.summary()


def test_failures_are_named():
    g = {
        "kl_mean_max": 0.1,
        "top1_min": 0.8,
        "ppl_ratio_max": 1.3,
        "tasks": {"qship_lastword": {"score_drop_max": 0.01}},
    }
    v = gate.check(_eval(), g)
    assert not v.passed
    assert v.to_json()["failed"] == [
        "kl_mean_max",
        "top1_min",
        "tasks.qship_lastword.score_drop_max",
    ]
    assert "FAIL kl_mean_max: 0.2 <= 0.1" in v.summary()


def test_limits_are_inclusive_and_none_is_unset():
    v = gate.check(_eval(), {"kl_mean_max": 0.2, "top1_min": 0.77, "kl_p99_max": None})
    assert v.passed and len(v.checks) == 2


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_missing_or_non_finite_value_fails_closed(bad):
    ev = _eval(ppl_ratio=bad)
    v = gate.check(ev, {"ppl_ratio_max": 10.0})
    assert not v.passed


def test_task_not_run_fails_with_reason():
    v = gate.check(
        _eval(),
        {"tasks": {"arc_easy": {"score_drop_max": 0.1}, "hellaswag": {"score_drop_max": 0.1}}},
    )
    assert not v.passed
    notes = {c["name"]: c["note"] for c in v.checks}
    assert "offline" in notes["tasks.arc_easy.score_drop_max"]
    assert "not evaluated" in notes["tasks.hellaswag.score_drop_max"]


def test_no_gates_passes_and_unknown_gate_is_recipe_error():
    assert gate.check(_eval(), None).passed
    assert gate.check(_eval(), {}).passed
    with pytest.raises(RecipeError):
        gate.check(_eval(), {"kl_mean_maxx": 0.1})


def test_accepts_the_recipe_pydantic_object():
    recipe = pytest.importorskip("pipeline.recipe")
    g = recipe.Gates(kl_mean_max=0.1, tasks={"qship_lastword": {"score_drop_max": 0.05}})
    v = gate.check(_eval(), g)
    assert [c["name"] for c in v.checks] == ["kl_mean_max", "tasks.qship_lastword.score_drop_max"]
    assert v.to_json()["failed"] == ["kl_mean_max"]
    assert gate.Verdict.from_json(v.to_json()).checks == v.checks
