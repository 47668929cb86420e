"""qship evaluate"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import log
from ..records.evaluation import EvalFile
from .common import (
    CacheOpt,
    ChecksumsOpt,
    DeviceOpt,
    JsonOpt,
    OffloadOpt,
    VerboseOpt,
    cache_root,
    check_dtype,
    check_offload,
)


def evaluate_cmd(
    reference: Annotated[Path, typer.Option("--reference", help="Unquantized checkpoint dir.")],
    candidate: Annotated[Path, typer.Option("--candidate", help="Quantized checkpoint dir.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML (evaluation + gates).")],
    out: Annotated[Path | None, typer.Option("--out", help="Where eval.json / eval.md go.")] = None,
    exact: Annotated[
        bool,
        typer.Option("--exact", help="Full-vocabulary KL, reference and candidate in lockstep."),
    ] = False,
    topk: Annotated[
        int | None,
        typer.Option("--topk", min=1, help="Reference tokens stored per position (cached mode)."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Compute dtype of both models: bfloat16 / float16 / float32 "
            "(default: the checkpoint's on a GPU, float32 on the CPU).",
        ),
    ] = None,
    device: DeviceOpt = None,
    offload: OffloadOpt = "none",
    checksums: ChecksumsOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> EvalFile:
    """KL / top-1 / ppl vs the reference on held-out tokens, lm-eval scores, gate (exit 4)."""
    from transformers import AutoTokenizer

    from .. import gate
    from ..data.benchmarks import prepare
    from ..data.tokens import build_token_sets
    from ..evaluate import DEFAULT_TOPK, evaluate, model_ref, write_outputs
    from ..io.pins import checksums_dir as pin_folder
    from ..recipe import load_recipe
    from ..records.checkpoint import QuantizedCheckpoint
    from ..records.evaluation import EvalOptions

    check_dtype(dtype)
    check_offload(offload, auto=False)
    r = load_recipe(recipe)
    root = cache_root(cache_dir)
    ev = r.evaluation
    with log.stage("tokens") as line:
        tok = AutoTokenizer.from_pretrained(reference)
        ts = build_token_sets(tok, r.calibration, ev, cache_dir=root)
        line.note = ts.info.summary()
    with log.stage("eval-data") as line:
        data, ov, custom = prepare(ev, tok, ts, cache_dir=root,
                                   checksums_dir=pin_folder(checksums), where=str(recipe))  # fmt: skip
    with log.stage("evaluate") as line:
        # the recipe's 16-bit KV layers when it lists some, else the candidate's own
        skip = tuple(r.kv_cache.skip_layers) if r.kv_cache and r.kv_cache.skip_layers else None
        opts = EvalOptions.of(ev, exact=exact, topk=topk or DEFAULT_TOPK, device=device,
                              dtype=dtype, offload=offload, kv_skip_layers=skip)  # fmt: skip
        report = evaluate(model_ref(reference), model_ref(candidate), heldout_ids=ts.heldout_ids,
                          cache_dir=root, options=opts, data_dir=data, overlap=ov,
                          corpus=ts.info, custom_dir=custom)  # fmt: skip
        line.note = report.summary()
    for text in report.skipped_lines():
        log.info(text, style="yellow")
    verdict = gate.check(report, r.gates, r.serve.gates if r.serve else None)
    qc = QuantizedCheckpoint.read(candidate)  # present when `qship quantize` wrote it
    result = EvalFile.of(report, verdict=verdict, quantize=qc.brief() if qc else None)
    out = out or Path("out") / "eval" / candidate.name
    write_outputs(result, out)
    log.info(verdict.summary(), style=None if verdict.passed else "red")
    gate.require_pass(verdict, where=str(out / "eval.json"), result=result)
    return result
