"""Stage order, the report folder and the run record: `qship run` end to end (the stages
themselves, with their cache keys, are in stages.py).

    recipe ─► fetch ─► tokens ─► eval-data ─► quantize ─► evaluate ─► gate ─► package ─► (publish)

`recipe` checks the recipe against the model's config alone (meta device) before anything
is downloaded or loaded: an invalid recipe exits 2 in seconds. Each later stage takes the
previous stage's record and returns its own. quantize and evaluate are cached under
<cache>/<stage>/<key>/, keyed by the hash of their inputs, so a CI retry, a run resumed
after a kill, or a recipe sweep (`qship compare`) re-uses fetch, the token sets, the
reference log-probs and finished quantizations (fetch and tokens cache themselves by
content). The gate is computed once, here, and carried to package and run.json.

A run that fails its gate leaves no artifact: `<out>.report/` holds eval.json, eval.md,
plan.json, quantize_report.json and run.json, and the run exits 4. Any failure writes
run.json with the error before it propagates.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import gate, log
from ..errors import QshipError, UsageError
from ..io.atomic import atomic_write_text
from ..io.pins import checksums_dir as pin_folder
from ..recipe import Recipe, load_recipe
from ..records.checkpoint import QuantizedCheckpoint
from ..records.evaluation import EvalFile
from ..records.run import ErrorInfo, RunRecord
from .stages import (
    MEASURED,
    QUANT_MODEL,
    RESUME,
    Context,
    EvalData,
    NotOnRankZero,
    check_recipe,
    eval_data_stage,
    evaluate_stage,
    fetch_stage,
    gate_stage,
    quantize_key,
    quantize_stage,
    serve_stage,
    tokens_stage,
)

__all__ = [
    "MEASURED", "QUANT_MODEL", "RESUME", "REPORT_SUFFIX", "Context", "EvalData",
    "NotOnRankZero", "check_out", "check_recipe", "eval_data_stage", "evaluate_stage",
    "fetch_stage", "gate_stage", "quantize_key", "quantize_stage", "report_dir_for", "run",
    "serve_stage", "tokens_stage", "write_report_dir",
]  # fmt: skip

REPORT_SUFFIX = ".report"


def report_dir_for(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + REPORT_SUFFIX)


def check_out(out: Path) -> Path:
    """An artifact is never overwritten: a run's --out must not exist yet."""
    if Path(out).exists():
        raise UsageError(
            "the output folder already exists",
            path=str(out),
            hint="pass a new --out (artifacts are never overwritten) or delete the old one",
        )
    return Path(out)


def write_report_dir(reports: Path, ev: EvalFile, qc: QuantizedCheckpoint | None = None) -> None:
    """eval.json, eval.md, plan.json and quantize_report.json in the report folder: readable
    also when the gate fails and no artifact exists (`qship compare --collect` takes them)."""
    from ..evaluate import write_outputs

    write_outputs(ev, reports)
    if qc is not None:
        atomic_write_text(reports / "plan.json", json.dumps(qc.plan.to_json(), indent=2) + "\n")
        qc.write(reports)


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
    checksums_dir: Path | None = None,
    require_pin: bool = False,
    offload: str = "auto",
    gpus: int = 0,
    torchrun_args: tuple[str, ...] = (),
) -> RunRecord:
    """recipe → fetch → tokens → quantize → evaluate → gate → package (→ publish).
    Raises GateFailed (4) when the gate fails; every error carries the RunRecord."""
    out = check_out(out)
    recipe = load_recipe(recipe_path)
    ctx = Context(Path(cache_dir), device=device, checksums_dir=pin_folder(checksums_dir),
                  require_pin=require_pin, offload=offload, gpus=gpus,
                  torchrun_args=torchrun_args)  # fmt: skip
    reports = report_dir_for(out)
    rec = RunRecord(model=model, recipe=str(recipe_path), recipe_name=recipe.name,
                    report_dir=reports)  # fmt: skip
    try:
        rec = _run(model, recipe, out, reports, ctx, rec, publish_to, sign_key, allow_pickle)
    except QshipError as e:
        rec = _finish(rec, ctx, reports, error=ErrorInfo(**e.to_json()))
        e.result = rec
        raise
    except Exception as e:
        info = ErrorInfo(error=type(e).__name__, exit_code=1, message=str(e)[:2000])
        _finish(rec, ctx, reports, error=info)
        raise
    return rec


def _run(
    model: str, recipe: Recipe, out: Path, reports: Path, ctx: Context, rec: RunRecord,
    publish_to: str | None, sign_key: Path | None, allow_pickle: bool,
) -> RunRecord:  # fmt: skip
    plan = check_recipe(model, recipe, ctx)
    snap = fetch_stage(model, ctx, allow_pickle=allow_pickle)
    tokens = tokens_stage(snap, recipe, ctx)
    evdata = eval_data_stage(snap, recipe, tokens, ctx)
    try:
        qc, qkey = quantize_stage(snap, recipe, tokens, ctx, layers=len(plan.decoder_layers))
    except NotOnRankZero:
        log.info("quantize done on this node; the node running rank 0 evaluates and packages")
        return _finish(rec, ctx, reports)
    report = evaluate_stage(snap, qc, qkey, recipe, tokens, evdata, ctx)
    report = serve_stage(qc, report, recipe, ctx)
    verdict = gate_stage(report, recipe, ctx)
    write_report_dir(reports, EvalFile.of(report, verdict=verdict, quantize=qc.brief()), qc)
    rec = rec.model_copy(update={"passed": verdict.passed, "verdict": verdict})
    gate.require_pass(verdict, where=str(reports / "eval.json"))

    from ..artifact.package import package

    with ctx.stage("package") as line:
        art = package(
            checkpoint=qc, recipe=recipe, evaluation=report, verdict=verdict, out=out,
            source=snap, quantize_key=qkey, sign_key=sign_key,
            timings={f"{r.stage}_s": r.seconds for r in ctx.rows},
        )  # fmt: skip
        line.note = f"{out} ({len(art.files)} files{', signed' if art.signed else ''})"
    rec = rec.model_copy(update={"artifact": out})
    if publish_to:
        from ..artifact.publish import publish

        with ctx.stage("publish") as line:
            pub = publish(out, publish_to)
            line.note = pub.summary()
        rec = rec.model_copy(update={"published": pub})
    return _finish(rec, ctx, reports)


def _finish(
    rec: RunRecord, ctx: Context, reports: Path, error: ErrorInfo | None = None
) -> RunRecord:
    rec = rec.model_copy(update={"stages": list(ctx.rows), "error": error})
    atomic_write_text(reports / "run.json", json.dumps(rec.to_json(), indent=2) + "\n")
    return rec
