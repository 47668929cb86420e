"""Stage order, the stage cache and the run record: `qship run` end to end.

    fetch ─► tokens ─► quantize ─► evaluate ─► gate ─► package ─► (publish)

Each stage function takes the previous stage's output and returns its own; the cached
ones (quantize, evaluate) live under <cache>/<stage>/<key>/ keyed by the hash of their
inputs, so a CI retry, a run resumed after a kill, or a recipe sweep (`qship compare`)
re-uses fetch, calibration tokens, the reference log-probs and finished quantizations.
fetch and the token sets cache themselves by content (fetch.py, calibration.py).

A run that fails its gate leaves no artifact: the evaluation is written to the report
folder `<out>.report/` (eval.json, eval.md, run.json) and the run exits 4.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gate as gate_mod
from .cache import StageCache, stage_key
from .errors import UsageError
from .fsutil import atomic_write_text
from .recipe import Recipe, load_recipe

QUANT_MODEL = "model"  # the checkpoint's folder inside a quantize cache entry
# Recipe fields that change the quantized weights (gates and evaluation settings do not).
_QUANT_FIELDS = ("dtype", "groups", "kv_cache", "calibration")


def _log(msg: str) -> None:
    print(f"qship run: {msg}", file=sys.stderr, flush=True)


@dataclass
class Context:
    cache_dir: Path
    device: str | None = None
    progress: bool = True
    stages: list[dict] = field(default_factory=list)  # the run record, one row per stage

    @property
    def cache(self) -> StageCache:
        return StageCache(self.cache_dir)

    def record(self, stage: str, t0: float, **facts: Any) -> None:
        row = {"stage": stage, "seconds": round(time.perf_counter() - t0, 3), **facts}
        self.stages.append(row)
        hit = " (cached)" if facts.get("cache_hit") else ""
        _log(f"{stage} done in {row['seconds']:.1f} s{hit}")


@dataclass
class Quantized:
    path: Path  # the compressed checkpoint
    key: str
    record: dict  # QuantizeResult.to_json() with the path relative to the entry


@dataclass
class Evaluated:
    eval_json: dict  # EvalResult.to_json()
    verdict: gate_mod.Verdict
    key: str


# ------------------------------------------------------------------ stages


def fetch_stage(source: str, ctx: Context, *, allow_pickle: bool = False):
    from .fetch import fetch

    t0 = time.perf_counter()
    snap = fetch(source, cache_dir=ctx.cache_dir, allow_pickle=allow_pickle)
    ctx.record("fetch", t0, source=source, revision=snap.revision, model_hash=snap.model_hash)
    return snap


def tokens_stage(snapshot, recipe: Recipe, ctx: Context):
    from transformers import AutoTokenizer

    from .calibration import build_token_sets

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(snapshot.path)
    sets = build_token_sets(tok, recipe.calibration, recipe.evaluation, cache_dir=ctx.cache_dir)
    ctx.record("tokens", t0, calib_hash=sets.calib_hash, heldout_hash=sets.heldout_hash)
    return sets


def quantize_key(snapshot, recipe: Recipe, tokens, device: str | None) -> str:
    resolved = recipe.resolved()
    return stage_key(
        "quantize",
        {
            "model": snapshot.model_hash,
            "recipe": {k: resolved[k] for k in _QUANT_FIELDS},
            "calib": tokens.calib_hash,
            # GPU and CPU kernels round differently: their checkpoints are different inputs
            "device": _device_kind(device),
        },
    )


def quantize_stage(snapshot, recipe: Recipe, tokens, ctx: Context) -> Quantized:
    from .quantize import quantize

    t0 = time.perf_counter()
    key = quantize_key(snapshot, recipe, tokens, ctx.device)

    def build(tmp: Path) -> dict:
        res = quantize(
            Path(snapshot.path),
            recipe,
            tmp / QUANT_MODEL,
            token_sets=tokens,
            device=ctx.device,
            progress=ctx.progress,
        )
        return {**res.to_json(), "path": QUANT_MODEL}

    entry = ctx.cache.get_or_build("quantize", key, build)
    ctx.record("quantize", t0, key=key, cache_hit=entry.hit, recipe=recipe.name)
    return Quantized(entry.path / QUANT_MODEL, key, entry.record)


def evaluate_stage(snapshot, quantized: Quantized, recipe: Recipe, tokens, ctx: Context):
    from .evaluate import evaluate

    t0 = time.perf_counter()
    ev = recipe.evaluation
    key = stage_key(
        "evaluate",
        {
            "reference": snapshot.model_hash,
            "candidate": quantized.key,
            "heldout": tokens.heldout_hash,
            "evaluation": ev.model_dump(mode="json"),
            "device": _device_kind(ctx.device),
        },
    )

    def build(_tmp: Path) -> dict:
        result = evaluate(
            Path(snapshot.path),
            quantized.path,
            heldout_ids=tokens.heldout_ids,
            heldout_hash=tokens.heldout_hash,
            cache_dir=ctx.cache_dir,
            tasks=ev.tasks,
            hub_tasks=ev.hub_tasks,
            limit=ev.limit,
            batch_size=ev.batch_size,
            device=ctx.device,
            corpus=tokens.to_json(),
        )
        return result.to_json()

    entry = ctx.cache.get_or_build("evaluate", key, build)
    eval_json = dict(entry.record)
    # the gate is cheap and its limits may change without touching the evaluation
    verdict = gate_mod.check(eval_json, recipe.gates)
    ctx.record("evaluate", t0, key=key, cache_hit=entry.hit, passed=verdict.passed)
    return Evaluated(eval_json, verdict, key)


def provenance(snapshot, recipe: Recipe, tokens, quantized: Quantized, ctx: Context) -> dict:
    return {
        "source": {
            "spec": snapshot.source,
            "repo_id": snapshot.repo_id,
            "revision": snapshot.revision,
            "model_hash": snapshot.model_hash,
            "manifest": str(snapshot.manifest) if snapshot.manifest else None,
            "files": {k: v.to_json() for k, v in sorted(snapshot.files.items())},
            "license": getattr(snapshot, "license", None),
        },
        "recipe_sha256_resolved": recipe.hash(),
        "calibration": tokens.to_json(),
        "quantize": {
            "key": quantized.key,
            "seconds": quantized.record.get("seconds"),
            "peak_memory": quantized.record.get("peak_memory"),
            "device": _device_kind(ctx.device),
        },
        "timings": {f"{s['stage']}_s": s["seconds"] for s in ctx.stages},
    }


# ------------------------------------------------------------------ the whole run


@dataclass
class RunResult:
    out: Path | None  # the artifact (None when the gate failed)
    report_dir: Path
    passed: bool
    verdict: dict
    stages: list[dict]
    published: dict | None = None

    def to_json(self) -> dict:
        return {
            "artifact": str(self.out) if self.out else None,
            "report_dir": str(self.report_dir),
            "passed": self.passed,
            "verdict": self.verdict,
            "stages": self.stages,
            "published": self.published,
        }

    def summary(self) -> str:
        lines = [f"{'stage':<10} {'seconds':>9}  cache"]
        for s in self.stages:
            lines.append(
                f"{s['stage']:<10} {s['seconds']:>9.1f}  {'hit' if s.get('cache_hit') else ''}"
            )
        lines.append(gate_mod.Verdict.from_json(self.verdict).summary())
        lines.append(
            f"artifact: {self.out}"
            if self.out
            else f"no artifact (gate failed); see {self.report_dir}"
        )
        if self.published:
            lines.append(f"published: {self.published}")
        return "\n".join(lines)


def report_dir_for(out: Path) -> Path:
    return out.with_name(out.name + ".report")


def run(
    model: str,
    recipe_path: Path,
    out: Path,
    *,
    cache_dir: Path,
    publish_to: str | None = None,
    sign_key: Path | None = None,
    device: str | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
) -> RunResult:
    """fetch → quantize → evaluate → gate → package (→ publish). Raises GateFailed (4)."""
    from .evaluate import require_pass, write_outputs
    from .package import package

    out = Path(out)
    if out.exists():
        raise UsageError(
            "the output folder already exists",
            path=str(out),
            hint="pass a new --out (artifacts are never overwritten) or delete the old one",
        )
    recipe = load_recipe(recipe_path)
    ctx = Context(Path(cache_dir), device=device, progress=progress)
    reports = report_dir_for(out)

    snap = fetch_stage(model, ctx, allow_pickle=allow_pickle)
    tokens = tokens_stage(snap, recipe, ctx)
    quantized = quantize_stage(snap, recipe, tokens, ctx)
    evaluated = evaluate_stage(snap, quantized, recipe, tokens, ctx)

    write_outputs(evaluated.eval_json, evaluated.verdict, reports)
    atomic_write_text(reports / "plan.json", json.dumps(quantized.record["plan"], indent=2) + "\n")
    # the quantize figures (size, time, peak memory) stay readable when the gate fails and
    # no artifact is written: `qship compare --collect` of a failed CI job takes them here
    if isinstance(quantized.record.get("report"), dict):
        atomic_write_text(
            reports / "quantize_report.json",
            json.dumps(quantized.record["report"], indent=2, sort_keys=True, default=str) + "\n",
        )
    result = RunResult(
        None, reports, evaluated.verdict.passed, evaluated.verdict.to_json(), ctx.stages
    )
    _write_record(result, reports)
    require_pass(evaluated.verdict, out_dir=reports, candidate_dir=quantized.path)

    t0 = time.perf_counter()
    package(
        model_dir=quantized.path,
        out=out,
        recipe_path_or_text=recipe.to_yaml(),  # the resolved recipe, defaults filled in
        eval_json=evaluated.eval_json,
        verdict=evaluated.verdict.to_json(),
        provenance=provenance(snap, recipe, tokens, quantized, ctx),
        sign_key=sign_key,
    )
    ctx.record("package", t0, artifact=str(out))
    result.out = out

    if publish_to:
        from .publish import publish

        t0 = time.perf_counter()
        pub = publish(out, publish_to)
        ctx.record("publish", t0, target=publish_to)
        result.published = pub.to_json()
    _write_record(result, reports)
    return result


def _write_record(result: RunResult, reports: Path) -> None:
    atomic_write_text(
        reports / "run.json", json.dumps(result.to_json(), indent=2, default=str) + "\n"
    )


def _device_kind(device: str | None) -> str:
    from .devices import default_device

    return (device or default_device()).split(":")[0]
