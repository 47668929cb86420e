"""Report rows (report.py's schema) from eval.json records.

Every eval.json qship writes (`qship run`'s report folder and artifact, `qship compare`,
`qship evaluate` on a quantize output) is an EvalFile holding the quantize figures a row
needs, so a row comes from that one file: `--collect` of CI jobs' results and the
in-process comparison give the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..records.evaluation import EvalFile

EVAL_FILE = "eval.json"


def row(ev: EvalFile, *, name: str | None = None, recipe: str | None = None) -> dict[str, Any]:
    q, m = ev.quantize, ev.metrics
    ok_tasks = {t: r for t, r in sorted(ev.benchmarks.tasks.items()) if r.status == "ok"}
    out: dict[str, Any] = {
        "name": name or (q.name if q else None) or "recipe",
        "recipe": recipe or (q.recipe if q else None),
        "recipe_hash": q.recipe_hash if q else None,
        "passed": ev.verdict.passed if ev.verdict else None,
        "checks": [c.to_json() for c in ev.verdict.checks] if ev.verdict else [],
        "bits_per_weight": q.bits_per_weight if q else None,
        "size_bytes": q.size_bytes if q else None,
        "quantize_s": q.seconds if q else None,
        "peak_mem_bytes": q.peak_mem_bytes if q else None,
        "peak_mem_kind": q.peak_mem_kind if q else None,
        "tokens": m.tokens,
        **{f"kl_{k}": v for k, v in m.kl.to_json().items()},
        "kl_mean_kv_off": ev.metrics_weights_only.kl.mean if ev.metrics_weights_only else None,
        "top1": m.top1_agreement,
        "ppl_reference": m.ppl_reference,
        "ppl_candidate": m.ppl_candidate,
        "ppl_ratio": m.ppl_ratio,
        "greedy_identical": ev.greedy.identical if ev.greedy else None,
        "greedy_first_diff": ev.greedy.mean_first_difference if ev.greedy else None,
        "tasks": {t: r.drop_pp for t, r in ok_tasks.items()},
        "task_ci": {t: list(r.ci95_pp) for t, r in ok_tasks.items() if r.ci95_pp},
        "kl_hist": m.kl_hist.to_json(),
        "formats": ", ".join(q.formats) if q and q.formats else None,
        **speed_fields(ev),
        "source": None,
        "refused": None,
        "baseline": q.baseline if q else None,
    }
    return out


def unavailable_row(name: str, why: str) -> dict[str, Any]:
    """A baseline's row where it could not run (bitsandbytes absent): no figures, the reason."""
    return {"name": name, "recipe": None, "passed": None, "checks": [], "tasks": {},
            "task_ci": {}, "kernels": {}, "serve_warnings": [], "refused": None,
            "baseline": why}  # fmt: skip


def speed_fields(ev: EvalFile) -> dict[str, Any]:
    """The served-performance figures of a row (None without `--serve vllm`)."""
    p = ev.served_perf
    if p is None:
        return {"speed": None, "gpu": None, "weights_gib": None, "kv_cache_tokens": None,
                "kernels": {}, "serve_warnings": []}  # fmt: skip
    speed = {w.name: {"speedup": w.speedup, "output_tok_s": w.candidate.output_tok_s,
                      "speedup_range": w.speedup_range, "ttft_p99_ms": w.candidate.ttft_p99_ms,
                      "tpot_p50_ms": w.candidate.tpot_p50_ms} for w in p.workloads}  # fmt: skip
    return {"speed": speed, "gpu": f"{p.gpu}, {p.engine}",
            "weights_gib": p.candidate.weights_gib,
            "kv_cache_tokens": p.candidate.kv_cache_tokens,
            "kernels": {s: p.candidate.kernel_text(s) for s in sorted(p.candidate.kernels)},
            "serve_warnings": list(p.candidate.warnings)}  # fmt: skip


def read_eval_file(path: Path) -> EvalFile:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(
            f"{path} is not a readable JSON file ({type(e).__name__})",
            path=str(path),
            hint="pass eval.json files or the folders holding them",
        ) from e
    return EvalFile.from_json(data, where=str(path))


def row_from_file(path: Path) -> dict[str, Any]:
    """A row from one eval.json; a recipe without quantize figures is named by its folder."""
    path = Path(path)
    ev = read_eval_file(path)
    folder = path.parent.name.removesuffix(".report")
    out = row(ev, name=None if ev.quantize else folder)
    out["refused"] = refused_by_plan(path.parent / "plan.json")
    return out


def refused_by_plan(plan_file: Path) -> str | None:
    """Why today's rules refuse the recipe whose plan.json this is (a fused set stored two
    ways: vLLM cannot load it), or None (also when there is no plan.json to judge)."""
    from ..model.roles import split_fused
    from ..records.plan import Plan

    if not plan_file.is_file():
        return None
    plan = Plan.from_json(json.loads(plan_file.read_text(encoding="utf-8")), where=str(plan_file))
    split = split_fused({m.name: m.scheme for m in plan.modules})
    return f"its plan splits {len(split)} fused set(s) vLLM loads as one layer" if split else None
