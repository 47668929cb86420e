"""gate: check an evaluation (eval.json dict) against the recipe's `gates`.

Accepts `recipe.gates` (pydantic) or a plain dict:
    {kl_mean_max, kl_p99_max, top1_min, ppl_ratio_max: float | None,
     tasks: {task_name: {score_drop_max: float}}}
Every configured limit becomes one check {name, value, limit, op, passed[, note]}.
A value that is missing or not finite fails its check (fail closed), and so does a task
gate whose task did not run (e.g. a hub task skipped offline): a configured gate never
passes silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import RecipeError

# gate name -> (path into eval.json, op)
METRIC_GATES = {
    "kl_mean_max": (("metrics", "kl", "mean"), "<="),
    "kl_p99_max": (("metrics", "kl", "p99"), "<="),
    "top1_min": (("metrics", "top1_agreement"), ">="),
    "ppl_ratio_max": (("metrics", "ppl_ratio"), "<="),
}


@dataclass
class Verdict:
    passed: bool
    checks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "checks": self.checks,
            "failed": [c["name"] for c in self.checks if not c["passed"]],
        }

    @classmethod
    def from_json(cls, d: dict) -> Verdict:
        return cls(bool(d["passed"]), list(d["checks"]))

    def summary(self) -> str:
        head = "gate PASSED" if self.passed else "gate FAILED"
        if not self.checks:
            head += " (no gates configured)"
        rows = [
            f"  {'ok  ' if c['passed'] else 'FAIL'} {c['name']}: {_fmt(c['value'])} "
            f"{c['op']} {_fmt(c['limit'])}" + (f"  ({c['note']})" if c.get("note") else "")
            for c in self.checks
        ]
        return "\n".join([head, *rows])


def _fmt(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _as_dict(gates: Any) -> dict:
    if gates is None:
        return {}
    if hasattr(gates, "model_dump"):
        return gates.model_dump()
    if isinstance(gates, dict):
        return gates
    raise RecipeError(f"gates must be a mapping, got {type(gates).__name__}", path="recipe: gates")


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ok(value: Any, op: str, limit: float) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value <= limit if op == "<=" else value >= limit


def check(eval_json: dict, gates: Any) -> Verdict:
    g = _as_dict(gates)
    unknown = set(g) - set(METRIC_GATES) - {"tasks"}
    if unknown:
        raise RecipeError(
            f"unknown gate(s) {sorted(unknown)}; known: {sorted(METRIC_GATES)} and tasks",
            path="recipe: gates",
        )
    checks: list[dict] = []
    for name, (path, op) in METRIC_GATES.items():
        limit = g.get(name)
        if limit is None:
            continue
        value = _get(eval_json, path)
        c = {
            "name": name,
            "value": value,
            "limit": float(limit),
            "op": op,
            "passed": _ok(value, op, limit),
        }
        if value is None:
            c["note"] = f"{'.'.join(path)} missing from the evaluation"
        checks.append(c)
    tasks = (eval_json.get("benchmarks") or {}).get("tasks") or {}
    for task, tg in sorted((g.get("tasks") or {}).items()):
        limit = tg["score_drop_max"] if isinstance(tg, dict) else tg.score_drop_max
        t = tasks.get(task)
        c = {
            "name": f"tasks.{task}.score_drop_max",
            "value": None,
            "limit": float(limit),
            "op": "<=",
            "passed": False,
        }
        if t is None:
            c["note"] = "task was not evaluated (list it in evaluation.tasks or hub_tasks)"
        elif t.get("status") != "ok":
            c["note"] = f"task did not run: {t.get('status')}: {t.get('reason', '')}"
        else:
            c["value"] = t.get("drop")
            c["passed"] = _ok(c["value"], "<=", limit)
            c["note"] = (
                f"{t.get('metric')}: {t['reference']['value']:.6g} -> {t['candidate']['value']:.6g}"
            )
        checks.append(c)
    return Verdict(all(c["passed"] for c in checks), checks)
