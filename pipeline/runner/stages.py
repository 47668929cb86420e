"""The stages of a run, each with its stage line, its row of the run record and, for
quantize and evaluate, its stage-cache entry: the pieces `run()` (and `qship compare`,
`qship sensitivity`) chain. Each takes the previous stage's record and returns its own.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import gate, log
from ..data.tokens import TokenSets, build_token_sets
from ..errors import StageError
from ..io.cache import StageCache, stage_key
from ..io.pins import checksums_dir
from ..model.devices import device_kind
from ..recipe import Recipe, ServeGate
from ..records.benchmarks import Overlap
from ..records.checkpoint import QuantizedCheckpoint
from ..records.evaluation import EvalOptions, EvalReport, ModelRef
from ..records.perf import ServedPerf
from ..records.plan import Plan
from ..records.run import StageRow
from ..records.snapshot import Snapshot
from ..records.verdict import Verdict

QUANT_MODEL = "model"  # the checkpoint's folder inside a quantize cache entry
RESUME = "quantize-layers"  # <cache>/quantize-layers/<key>/: an unfinished run's layers
MEASURED = "measured.safetensors"  # the served check's measured log-probs, in an evaluate entry
# Recipe fields that change the quantized weights, the quantize cache key's; OPTIONAL ones
# enter it only when set, so entries made before they existed keep their keys. The others
# do not change the weights: names, evaluation, gates, serving, `others` (keep vs refuse an
# unclaimed Linear: a run that passes its plan writes the same weights), the target (a
# plan-time check). tests/test_runner_keys.py holds every Recipe field to one of the three.
_QUANT_FIELDS = ("dtype", "groups", "kv_cache", "calibration")
_QUANT_OPTIONAL = ("smoothquant",)
_NOT_QUANT_FIELDS = ("name", "description", "evaluation", "gates", "serve", "others", "target")


@dataclass(frozen=True)
class EvalData:
    data_dir: Path | None  # the pinned benchmark data (None: no local tasks)
    overlap: Overlap
    custom_dir: Path | None = None  # the custom tasks, checked (None: none)


@dataclass
class Context:
    cache_dir: Path
    device: str | None = None
    checksums_dir: Path = field(default_factory=checksums_dir)  # pins (io.pins)
    require_pin: bool = False  # an input no manifest pins is exit 3 (--require-pin)
    offload: str = "auto"  # where the weights live (--offload); check_recipe resolves auto
    gpus: int = 0  # >0: quantize under torchrun with this many processes (--gpus)
    torchrun_args: tuple[str, ...] = ()  # rendezvous flags for several nodes
    exact_kl: bool = False  # evaluate with the full-vocabulary KL (lockstep; no served check)
    gpu_memory: int | None = None  # --gpu-memory: the GPU bytes this run may use
    perf: bool = False  # served performance through vLLM's benchmark (--perf, compare --serve)
    perf_raw: Path | None = None  # where each benchmark pass's raw JSON is kept
    serve_engine: str | None = None  # served check + perf for recipes without `serve:`
    perf_ref: dict[str, Any] = field(default_factory=dict)  # the reference's served figures
    rows: list[StageRow] = field(default_factory=list)

    @property
    def cache(self) -> StageCache:
        # --require-pin: a cache entry that fails its digests is exit 3, not a rebuild
        return StageCache(self.cache_dir, strict=self.require_pin)

    @contextlib.contextmanager
    def stage(self, name: str, key: str | None = None) -> Iterator[log.StageLine]:
        """One stage line on the terminal and one row of the run record, also when the
        stage fails (its time and its error: run.json says where a run stopped)."""
        error: str | None = None
        with log.stage(name) as line:
            try:
                yield line
            except BaseException as e:
                error = _stage_error(e)
                raise
            finally:
                self.rows.append(StageRow(stage=name, seconds=round(line.seconds, 3),
                                          cache_hit=line.cached, key=key, note=line.note,
                                          error=error))  # fmt: skip


def _stage_error(e: BaseException) -> str:
    """A failed stage's row: the error's class, exit code and message, on one line."""
    from ..errors import QshipError, interrupt_exit_code

    if isinstance(e, QshipError):
        code, text = e.exit_code, e.message
    elif isinstance(e, KeyboardInterrupt):
        code, text = interrupt_exit_code(e), f"interrupted ({e})"
    else:
        code, text = 1, str(e)
    return f"{type(e).__name__} (exit {code}): {' '.join(text.split())}"[:500]


# ------------------------------------------------------------------ stages


def existing_parent(path: Path) -> Path:
    """The nearest folder of `path` that exists (an --out is created later)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_recipe(
    model: str,
    recipe: Recipe,
    ctx: Context,
    *,
    show_plan: bool = True,
    checkpoint_to: Path | None = None,
) -> Plan:
    """The recipe against the model's config, before any weight is fetched (exit 2).
    `checkpoint_to`: `qship quantize`'s --out: it writes that checkpoint and no cache entries,
    so only the checkpoint's size is held against the free space there."""
    from ..fetch import read_config
    from ..model.devices import apply_gpu_cap, default_device, free_cpu_bytes, usable_gpu_bytes
    from ..quantize import plan_for_config
    from ..quantize.estimate import choose, require_fit

    with ctx.stage("recipe") as line:
        config = read_config(model, cache_dir=ctx.cache_dir)
        plan = plan_for_config(config, recipe)
        free = usable_gpu_bytes(ctx.device, ctx.gpu_memory)
        est = choose(plan, config, recipe, ctx.device or default_device(), offload=ctx.offload,
                     free_gpu_bytes=free, free_cpu_bytes=free_cpu_bytes(),
                     ranks=max(1, ctx.gpus))  # fmt: skip
        ctx.cache_dir.mkdir(parents=True, exist_ok=True)
        disk_at = ctx.cache_dir if checkpoint_to is None else existing_parent(checkpoint_to)
        require_fit(est, free_gpu_bytes=free, recipe=recipe, free_cpu_bytes=free_cpu_bytes(),
                    free_disk_bytes=shutil.disk_usage(disk_at).free,
                    checkpoint_only=checkpoint_to is not None)  # fmt: skip
        ctx.offload = est.offload
        apply_gpu_cap(ctx.device, ctx.gpu_memory)  # quantize and evaluate run under the cap
        plan = plan.model_copy(update={"estimate": est})
        line.note = f"{recipe.name} fits {plan.architecture} ({recipe.path})"
    if show_plan:
        log.info(plan.summary(), style="dim")
    return plan


def fetch_stage(source: str, ctx: Context, *, allow_pickle: bool = False) -> Snapshot:
    from ..fetch import fetch

    with ctx.stage("fetch") as line:
        snap = fetch(source, cache_dir=ctx.cache_dir, checksums_dir=ctx.checksums_dir,
                     allow_pickle=allow_pickle, require_pin=ctx.require_pin)  # fmt: skip
        size = sum(d.size for d in snap.files.values())
        line.note = f"{snap.repo_id}@{snap.revision}: {snap.pin_status}, {size / 1e6:.0f} MB"
        line.cached = snap.cache_hit
    return snap


def tokens_stage(snapshot: Snapshot, recipe: Recipe, ctx: Context) -> TokenSets:
    from transformers import AutoTokenizer

    with ctx.stage("tokens") as line:
        tok = AutoTokenizer.from_pretrained(snapshot.path)
        sets = build_token_sets(tok, recipe.calibration, recipe.evaluation, cache_dir=ctx.cache_dir)
        line.note = sets.info.summary()
    return sets


def eval_data_stage(
    snapshot: Snapshot, recipe: Recipe, tokens: TokenSets, ctx: Context
) -> EvalData:
    """Benchmark data fetched and verified, and every evaluation set checked for overlap with
    the calibration text (exit 2 above evaluation.max_overlap) -- before any model work."""
    from transformers import AutoTokenizer

    from ..data.benchmarks import prepare
    from ..data.generative import CODE_TASKS
    from ..evaluate.sandbox import sandbox_for

    with ctx.stage("eval-data") as line:
        if any(t in CODE_TASKS for t in recipe.evaluation.tasks):  # opt-in, isolation: exit 2
            sandbox_for(recipe.evaluation.code_execution, where=recipe.path)
        tok = AutoTokenizer.from_pretrained(snapshot.path)
        data, ov, custom = prepare(recipe.evaluation, tok, tokens, cache_dir=ctx.cache_dir,
                                   checksums_dir=ctx.checksums_dir, where=recipe.path)  # fmt: skip
        worst = max(ov.sets.items(), key=lambda kv: kv[1].fraction)
        line.note = (f"{len(ov.sets) - 1} benchmark(s); {ov.n}-gram overlap with calibration "
                     f"at most {worst[1].fraction:.2%} ({worst[0]})")  # fmt: skip
    return EvalData(data, ov, custom)


def quantize_key(
    snapshot: Snapshot, recipe: Recipe, tokens: TokenSets, device: str | None, processes: int = 1
) -> str:
    resolved = recipe.resolved()
    inputs: dict[str, Any] = {
        "model": snapshot.model_hash,
        # calibration as keys hold it: its newer fields only when set
        "recipe": {k: resolved[k] for k in _QUANT_FIELDS}
        | {"calibration": recipe.calibration.key_fields()}
        | {k: resolved[k] for k in _QUANT_OPTIONAL if resolved.get(k) is not None},
        "calib": tokens.calib_hash,
        # GPU and CPU kernels round differently: their checkpoints are different inputs
        "device": device_kind(device),
    }
    if processes > 1:  # statistics reduced across ranks sum in another order
        inputs["processes"] = processes
    # qship's own rounding of W4A8 weights, not a library's: entries from before it are other
    # checkpoints (quantize/w4a8_gptq.py, quantize/w4a8_rtn.py)
    from ..quantize.methods import ROUNDING

    for g in recipe.groups:
        if g.scheme is not None and g.scheme.w4a8 and ROUNDING[g.method].w4a8_key:
            inputs[str(ROUNDING[g.method].w4a8_key)] = "served-w4a8"
    return stage_key("quantize", inputs)


class NotOnRankZero(Exception):
    """Multi-node: this node's ranks finished quantize; the node with rank 0 carries on."""


def quantize_stage(
    snapshot: Snapshot, recipe: Recipe, tokens: TokenSets, ctx: Context, *, layers: int = 0
) -> tuple[QuantizedCheckpoint, str]:
    from ..model.devices import default_device
    from ..quantize import quantize
    from ..quantize.distributed import launch

    key = quantize_key(snapshot, recipe, tokens, ctx.device, ctx.gpus)

    # finished decoder layers survive a kill here (resume.py), until the entry is complete
    resume_dir = ctx.cache_dir / RESUME / key

    def build(tmp: Path) -> dict[str, Any]:
        out = tmp / QUANT_MODEL
        if ctx.gpus:
            qc = launch(snapshot.path, recipe, out, cache_dir=ctx.cache_dir, gpus=ctx.gpus,
                        device=ctx.device or default_device(), offload=ctx.offload,
                        torchrun_args=ctx.torchrun_args, layers=layers,
                        resume_dir=resume_dir)  # fmt: skip
            if qc is None:
                raise NotOnRankZero()
        else:
            qc = quantize(snapshot.path, recipe, out, tokens=tokens, device=ctx.device,
                          offload=ctx.offload, resume_dir=resume_dir)  # fmt: skip
        assert qc is not None
        return qc.model_copy(update={"path": Path(QUANT_MODEL)}).to_json()

    with ctx.stage("quantize", key) as line:
        entry = ctx.cache.get_or_build("quantize", key, build)
        rec = QuantizedCheckpoint.from_json(entry.record, where=str(entry.path), error=StageError)
        # the entry is shared by every recipe with these quantization fields: name it after
        # the recipe of this run, not the one that happened to build it
        qc = rec.model_copy(update={"path": entry.path / QUANT_MODEL, "recipe_name": recipe.name,
                                    "recipe_hash": recipe.hash()})  # fmt: skip
        c = qc.checkpoint
        line.note = f"{c.bits_per_weight_quantized:.3f} bits/weight, {c.bytes / 1e6:.0f} MB"
        line.cached = entry.hit
    return qc, key


def evaluate_key(snapshot: Snapshot, qkey: str, recipe: Recipe, tokens: TokenSets,
                 ctx: Context) -> str:  # fmt: skip
    from ..evaluate.numerics import SERVED_NUMERICS

    return stage_key(
        "evaluate",
        {
            "reference": snapshot.model_hash,
            "candidate": qkey,
            "heldout": tokens.heldout_hash,
            # code_execution only when on: the keys of earlier entries stay as they were
            "evaluation": recipe.evaluation.model_dump(
                mode="json",
                exclude={"code_execution"} if recipe.evaluation.code_execution == "off" else None,
            ),
            "device": device_kind(ctx.device),
            # only when set: the keys of the cached-mode entries stay as they were
            **({"exact": True} if ctx.exact_kl else {}),
            # a candidate computed as served is another figure when that arithmetic changes
            **(
                {"served_numerics": SERVED_NUMERICS}
                if recipe.quantizes_activations() or recipe.kv_cache
                else {}
            ),  # fmt: skip
        },
    )


def evaluate_stage(
    snapshot: Snapshot, candidate: ModelRef, qkey: str, recipe: Recipe,
    tokens: TokenSets, evdata: EvalData, ctx: Context,
) -> EvalReport:  # fmt: skip
    from ..evaluate import evaluate

    ev = recipe.evaluation
    key = evaluate_key(snapshot, qkey, recipe, tokens, ctx)

    def build(tmp: Path) -> dict[str, Any]:
        rep = evaluate(
            ModelRef(path=snapshot.path, model_hash=snapshot.model_hash),
            candidate,
            heldout_ids=tokens.heldout_ids, cache_dir=ctx.cache_dir,
            options=EvalOptions.of(ev, device=ctx.device, offload=ctx.offload,
                                   exact=ctx.exact_kl),
            data_dir=evdata.data_dir, overlap=evdata.overlap, corpus=tokens.info,
            measured_path=tmp / MEASURED, custom_dir=evdata.custom_dir,
        )  # fmt: skip
        if rep.measured is not None:  # relative in the entry; the entry moves when complete
            rep = rep.model_copy(
                update={"measured": rep.measured.model_copy(update={"file": MEASURED})}
            )
        return rep.to_json()

    with ctx.stage("evaluate", key) as line:
        entry = ctx.cache.get_or_build("evaluate", key, build)
        report = EvalReport.from_json(entry.record, where=str(entry.path), error=StageError)
        if entry.hit and report.benchmarks.skipped(ev.tasks):
            # a local benchmark that did not run (its lm-eval child ran out of memory, was
            # killed) is measured again, not read back from the cache as skipped for good
            entry = ctx.cache.get_or_build("evaluate", key, build, force=True)
            report = EvalReport.from_json(entry.record, where=str(entry.path), error=StageError)
        if report.measured is not None:
            m = report.measured.model_copy(update={"file": str(entry.path / report.measured.file)})
            report = report.model_copy(update={"measured": m})
        line.note, line.cached = report.summary(), entry.hit
    for text in report.skipped_lines():
        log.info(text, style="yellow")
    return report


def serve_stage(
    qc: QuantizedCheckpoint, report: EvalReport, recipe: Recipe, ctx: Context,
    reference: Path | None = None,
) -> EvalReport:  # fmt: skip
    """The recipe's served check on the quantized checkpoint, when its engine is here; with
    --perf (or speed gates in the recipe), its served speed beside the reference's."""
    from ..evaluate.engines import unavailable
    from ..evaluate.served import run_check

    sg = recipe.serve or (ServeGate(engine=ctx.serve_engine) if ctx.serve_engine else None)
    if sg is None:
        return report
    with ctx.stage("serve") as line:
        reason = unavailable(sg.engine) or (
            None if report.measured else "no measured log-probs (evaluation.measured_topk: 0)"
        )
        if reason is not None:
            line.note = f"not run: {reason}"
            report = report.model_copy(update={"served_skipped": reason})
        else:
            assert report.measured is not None
            chk = run_check(qc.path, Path(report.measured.file), sg, device=ctx.device,
                            sha256=report.measured.sha256, kv_share=report.kv_cache_share)  # fmt: skip
            line.note = chk.summary().splitlines()[0]
            report = report.model_copy(update={"served": chk})
    if sg.long_context is not None and reference is not None:
        with ctx.stage("long-context") as line:
            reason = unavailable(sg.engine)
            if reason is not None:
                line.note = f"not run: {reason}"
            else:
                from ..evaluate.long_context import check_artifact

                attention = report.measured.attention if report.measured else "kv-only"
                lc = check_artifact(qc.path, reference, sg, recipe.calibration.source,
                                    device=ctx.device, attention=attention)  # fmt: skip
                line.note = lc.summary().splitlines()[0]
                report = report.model_copy(update={"long_context": lc})
    wanted = ctx.perf or sg.gates.any()
    if reference is not None and wanted and unavailable(sg.engine) is None:
        from ..evaluate import perf

        with ctx.stage("perf") as line:
            runner = perf.runner_for(sg.engine)()
            refs = perf.ReferenceCache(ctx.cache, mem=ctx.perf_ref)
            res = perf.measure(qc.path, reference, sg, runner, raw_dir=ctx.perf_raw,
                               ref_cache=refs, reference_hash=report.reference.model_hash,
                               kernel_counts=report.served.kernel_counts() if report.served
                               else None)  # fmt: skip
            line.note = perf_summary(res)
        report = report.model_copy(update={"served_perf": res})
    return report


def perf_summary(p: ServedPerf) -> str:
    return ", ".join(f"{w.name} {w.speedup:.2f}x ({w.candidate.output_tok_s:.0f} tok/s)"
                     for w in p.workloads) + f" on {p.gpu}"  # fmt: skip


def gate_stage(report: EvalReport, recipe: Recipe, ctx: Context) -> Verdict:
    with ctx.stage("gate") as line:
        verdict = gate.check(report, recipe.gates, recipe.serve.gates if recipe.serve else None)
        n = len(verdict.checks)
        line.note = f"{'PASSED' if verdict.passed else 'FAILED'} ({n} check{'s' * (n != 1)})"
    for row in verdict.summary().splitlines()[1:]:
        log.info(row, style=None if verdict.passed else "red")
    return verdict
