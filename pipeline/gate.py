"""The gate stage: an EvalReport against the recipe's `gates:` -> a Verdict.

Every configured limit becomes one Check. A value that is missing or not finite fails its
check (fail closed), and so does a task gate whose task did not run (e.g. a hub task
skipped offline): a configured gate never passes silently. The served check (recipe
`serve:`) adds its three checks when it ran; when its engine is absent it is reported as
not run and adds none; so does the long-context check (`serve.long_context`), one check
per length. `require_pass` turns a failed verdict into GateFailed (exit 4).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from .errors import GateFailed
from .recipe import Gates, SpeedGates
from .records.evaluation import EvalReport
from .records.perf import ServedPerf
from .records.served import LongContextCheck
from .records.verdict import Check, Verdict

Op = Literal["<=", ">="]
# gate name -> (what it reads, op, where it is in eval.json)
METRIC_GATES: dict[str, tuple[Callable[[EvalReport], float], Op, str]] = {
    "kl_mean_max": (lambda r: r.metrics.kl.mean, "<=", "metrics.kl.mean"),
    "kl_p99_max": (lambda r: r.metrics.kl.p99, "<=", "metrics.kl.p99"),
    "top1_min": (lambda r: r.metrics.top1_agreement, ">=", "metrics.top1_agreement"),
    "ppl_ratio_max": (lambda r: r.metrics.ppl_ratio, "<=", "metrics.ppl_ratio"),
    "greedy_agreement_min": (lambda r: r.greedy.identical if r.greedy else math.nan, ">=",
                             "greedy.identical (not measured: evaluation.greedy_prompts 0?)"),
}  # fmt: skip


def _ok(value: Any, op: Op, limit: float) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value <= limit if op == "<=" else value >= limit


def check(report: EvalReport, gates: Gates, speed: SpeedGates | None = None) -> Verdict:
    checks: list[Check] = []
    for name, (read, op, where) in METRIC_GATES.items():
        limit = getattr(gates, name)
        if limit is None:
            continue
        value = read(report)
        finite = math.isfinite(value)
        checks.append(
            Check(
                name=name,
                value=value if finite else None,
                limit=float(limit),
                op=op,
                passed=_ok(value, op, limit),
                note=None if finite else f"{where} is {value}",
            )
        )
    tasks = report.benchmarks.tasks
    for task, tg in sorted(gates.tasks.items()):
        t = tasks.get(task)
        name, limit = f"tasks.{task}.max_drop", float(tg.max_drop)
        if t is None or t.status != "ok" or t.drop_pp is None:
            note = "task was not evaluated" if t is None else f"task did not run: {t.describe()}"
            checks.append(
                Check(name=name, value=None, limit=limit, op="<=", passed=False, note=note)
            )
        else:
            checks.append(
                Check(
                    name=name,
                    value=t.drop_pp,
                    limit=limit,
                    op="<=",
                    passed=_ok(t.drop_pp, "<=", limit),
                    note=t.describe(),
                )  # fmt: skip
            )
    if report.served is not None:
        checks += served_checks(report)
    if report.long_context is not None:
        checks += long_context_checks(report.long_context)
    if speed is not None and speed.any():
        checks += speed_checks(report.served_perf, speed)
    return Verdict(passed=all(c.passed for c in checks), checks=checks)


def served_checks(report: EvalReport) -> list[Check]:
    s = report.served
    assert s is not None
    lim = s.thresholds
    rows: list[tuple[str, float, Op, float | None]] = [
        ("serve.max_kl", s.served_vs_measured.kl_mean, "<=", lim.get("max_kl")),
        ("serve.min_top1", s.served_vs_measured.top1, ">=", lim.get("min_top1")),
        ("serve.max_kl_increase", s.served_kl_increase, "<=", lim.get("max_kl_increase")),
    ]
    note = f"{s.engine}, kv {s.kv_cache_dtype}"
    return [
        Check(
            name=n, value=v, limit=float(limit), op=op, passed=_ok(v, op, float(limit)), note=note
        )
        for n, v, op, limit in rows
        if limit is not None
    ]


def long_context_checks(lc: LongContextCheck) -> list[Check]:
    """serve.long_context.max_drop, per length: the reference's retrieval rate minus the
    artifact's as served."""
    return [
        Check(
            name=f"serve.long_context.{r.length}",
            value=r.drop,
            limit=lc.max_drop,
            op="<=",
            passed=_ok(r.drop, "<=", lc.max_drop),
            note=f"retrieved {r.served:.0%} vs the reference's {r.reference:.0%}"
            + (f", 16-bit KV {r.served_16bit:.0%}" if r.served_16bit is not None else "")
            + f" ({lc.engine}, kv {lc.kv_cache_dtype})",
        )  # fmt: skip
        for r in lc.rows
    ]


def speed_checks(perf: ServedPerf | None, speed: SpeedGates) -> list[Check]:
    """serve.gates: the candidate's speed-up over the reference of the same run, and its
    p99 time to first token, per workload. Not measured = failed (fail closed)."""
    rows = perf.by_name() if perf is not None else {}
    out = []
    for field, op in (("min_speedup", ">="), ("max_ttft_ms", "<=")):
        for wl, limit in sorted(getattr(speed, field).items()):
            w = rows.get(wl)
            value = None if w is None else (
                w.speedup if field == "min_speedup" else w.candidate.ttft_p99_ms)  # fmt: skip
            note = ("served performance was not measured (--perf, vLLM)" if w is None else
                    f"{perf.gpu}, {perf.engine}" if perf else None)  # fmt: skip
            out.append(Check(name=f"serve.{field}.{wl}", value=value, limit=float(limit),
                             op=op, passed=_ok(value, op, float(limit)), note=note))  # type: ignore[arg-type]  # fmt: skip
    return out


def require_pass(verdict: Verdict, *, where: str, result: Any = None) -> None:
    """GateFailed (exit 4) naming the failed checks, when the verdict did not pass."""
    if verdict.passed:
        return
    failed = [c for c in verdict.checks if not c.passed]
    raise GateFailed(
        f"{len(failed)} of {len(verdict.checks)} quality checks failed: "
        + "; ".join(f"{c.name} = {_fmt(c.value)} (limit {c.op} {_fmt(c.limit)})" for c in failed),
        path=where,
        hint="see eval.md; use a stronger recipe (more bits, GPTQ/AWQ) or relax the recipe's gates",
        result=result,
    )


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"
