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

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .. import gate, log
from ..data.tokens import TokenSets
from ..errors import QshipError, UsageError, interrupt_exit_code
from ..io.atomic import atomic_write_text
from ..io.pins import checksums_dir as pin_folder
from ..recipe import Recipe, load_recipe
from ..records.artifact import Provenance
from ..records.checkpoint import QuantizedCheckpoint
from ..records.evaluation import EvalFile, EvalReport, ModelRef
from ..records.run import ErrorInfo, RunRecord
from ..records.snapshot import Snapshot
from ..records.verdict import Verdict
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
    existing_parent,
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
    "fetch_stage", "gate_stage", "measure", "quantize_key", "quantize_stage", "report_dir_for",
    "run",
    "serve_stage", "tokens_stage", "write_report_dir",
]  # fmt: skip

REPORT_SUFFIX = ".report"
OUT_LOCK = ".out.lock"  # in the report folder: held by the run writing this --out


def report_dir_for(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + REPORT_SUFFIX)


def check_out(out: Path) -> Path:
    """--out before any compute: not below a regular file, in a folder this user may write
    (an existing --out is run()'s to judge: reused when built from the same inputs)."""
    out = Path(out)
    parent = existing_parent(out.absolute().parent)
    if not parent.is_dir():
        raise UsageError(f"--out is below {parent}, which is a file, not a folder",
                         path=str(out), hint="choose an --out inside a folder")  # fmt: skip
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write in {parent} (read-only or not yours)", path=str(out),
                         hint="choose an --out in a writable folder")  # fmt: skip
    return out


def _refuse_existing(out: Path, why: str) -> UsageError:
    return UsageError(
        f"the output folder already exists and {why}",
        path=str(out),
        hint="pass a new --out (artifacts are never overwritten) or delete the old one; the "
        "same command with the same model, recipe and qship reuses its own artifact",
    )


def existing_artifact(out: Path, recipe: Recipe) -> Provenance | None:
    """None when --out does not exist; its provenance when it is an artifact of this recipe
    and this qship (the model is compared after fetch); else exit 2."""
    from .. import __version__
    from ..artifact.provenance import PROVENANCE

    if not out.exists():
        return None
    try:
        data = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
        prov = Provenance.from_json(data, where=str(out / PROVENANCE))
    except (OSError, ValueError, QshipError):
        raise _refuse_existing(out, "is not a qship artifact") from None
    if prov.recipe.hash != recipe.hash():
        raise _refuse_existing(out, f"was built with another recipe ({prov.recipe.name} "
                               f"sha256:{prov.recipe.hash[:12]})")  # fmt: skip
    if prov.qship.version != __version__:
        raise _refuse_existing(out, f"was built by qship {prov.qship.version}")
    return prov


@contextlib.contextmanager
def out_lock(out: Path) -> Iterator[None]:
    """One run per --out at a time: a second exits 2 at once, before any compute, instead
    of racing the first to package. The lock is keyed on the resolved path (`o/art` and
    `o/x/../art`, or a symlinked folder, are one --out) and lives in its report folder, so
    runs with different --cache-dir meet at it too."""
    path = report_dir_for(Path(out).resolve()) / OUT_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError("another qship run is writing this --out", path=str(out),
                             hint="wait for it, or choose another --out") from None  # fmt: skip
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
    gpu_memory: int | None = None,
) -> RunRecord:
    """recipe → fetch → tokens → quantize → evaluate → gate → package (→ publish).
    Raises GateFailed (4) when the gate fails; every error carries the RunRecord."""
    out = check_out(out)
    recipe = load_recipe(recipe_path)
    if gpu_memory is not None and gpus:
        raise UsageError("--gpu-memory holds this process, not torchrun's ranks", path="--gpus",
                         hint="drop one of --gpu-memory and --gpus")  # fmt: skip
    with out_lock(out):
        return _locked_run(model, recipe_path, recipe, out, cache_dir=cache_dir,
                           publish_to=publish_to, sign_key=sign_key, device=device,
                           allow_pickle=allow_pickle, checksums_dir=checksums_dir,
                           require_pin=require_pin, offload=offload, gpus=gpus,
                           torchrun_args=torchrun_args, gpu_memory=gpu_memory)  # fmt: skip


def _locked_run(
    model: str, recipe_path: Path, recipe: Recipe, out: Path, *, cache_dir: Path,
    publish_to: str | None, sign_key: Path | None, device: str | None, allow_pickle: bool,
    checksums_dir: Path | None, require_pin: bool, offload: str, gpus: int,
    torchrun_args: tuple[str, ...], gpu_memory: int | None,
) -> RunRecord:  # fmt: skip
    ctx = Context(Path(cache_dir), device=device, checksums_dir=pin_folder(checksums_dir),
                  require_pin=require_pin, offload=offload, gpus=gpus,
                  torchrun_args=torchrun_args, gpu_memory=gpu_memory)  # fmt: skip
    reports = report_dir_for(out)
    rec = RunRecord(model=model, recipe=str(recipe_path), recipe_name=recipe.name,
                    report_dir=reports)  # fmt: skip
    try:
        prior = existing_artifact(out, recipe)  # refused (exit 2): run.json says so too
        if prior is not None:
            rec = _reuse(model, recipe, out, prior, reports, ctx, rec, publish_to, allow_pickle)
        else:
            rec = _run(model, recipe, out, reports, ctx, rec, publish_to, sign_key, allow_pickle)
    except QshipError as e:
        rec = _finish(rec, ctx, reports, error=ErrorInfo(**e.to_json()))
        e.result = rec
        raise
    except Exception as e:
        info = ErrorInfo(error=type(e).__name__, exit_code=1, message=str(e)[:2000])
        _finish(rec, ctx, reports, error=info)
        raise
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM (errors.Interrupted): run.json says so
        code = interrupt_exit_code(e)
        _finish(rec, ctx, reports, error=ErrorInfo(
            error="Interrupted", exit_code=code, message=f"interrupted ({e or 'SIGINT'}): "
            "nothing was published; finished stages stay in the cache"))  # fmt: skip
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
        qc, qkey, report, verdict = measure(snap, recipe, tokens, evdata, ctx,
                                            layers=len(plan.decoder_layers))  # fmt: skip
    except NotOnRankZero:
        log.info("quantize done on this node; the node running rank 0 evaluates and packages")
        return _finish(rec, ctx, reports)
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
    return _publish(rec, out, publish_to, ctx, reports)


def measure(
    snap: Snapshot, recipe: Recipe, tokens: TokenSets, evdata: EvalData, ctx: Context,
    *, layers: int = 0,
) -> tuple[QuantizedCheckpoint, str, EvalReport, Verdict]:  # fmt: skip
    """quantize → evaluate → (serve) → gate: one recipe measured on a fetched model, the
    chain `qship run` and `qship compare` share."""
    qc, qkey = quantize_stage(snap, recipe, tokens, ctx, layers=layers)
    cand = ModelRef(path=qc.path, model_hash=qc.model_hash)
    report = evaluate_stage(snap, cand, qkey, recipe, tokens, evdata, ctx)
    report = serve_stage(qc, report, recipe, ctx, reference=snap.path)
    return qc, qkey, report, gate_stage(report, recipe, ctx)


def _reuse(
    model: str, recipe: Recipe, out: Path, prior: Provenance, reports: Path, ctx: Context,
    rec: RunRecord, publish_to: str | None, allow_pickle: bool,
) -> RunRecord:  # fmt: skip
    """The same command again (a CI retry after exit 5): the artifact built from the same
    model, recipe and qship is verified and published, nothing is recomputed."""
    from ..artifact.verify import read_eval, verify

    check_recipe(model, recipe, ctx, show_plan=False)
    snap = fetch_stage(model, ctx, allow_pickle=allow_pickle)
    if prior.source is None or prior.source.model_hash != snap.model_hash:
        raise _refuse_existing(out, "was built from another model")
    with ctx.stage("verify") as line:
        verify(out)  # exit 3 when it was altered since
        ev = read_eval(out)
        line.note = f"{out} was built by the same command: reused"
    rec = rec.model_copy(update={"passed": ev.verdict.passed if ev.verdict else None,
                                 "verdict": ev.verdict, "artifact": out})  # fmt: skip
    return _publish(rec, out, publish_to, ctx, reports)


def _publish(
    rec: RunRecord, out: Path, publish_to: str | None, ctx: Context, reports: Path
) -> RunRecord:
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
