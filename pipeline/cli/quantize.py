"""qship plan, qship quantize"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .. import log
from ..errors import UsageError
from ..records.checkpoint import QuantizedCheckpoint
from ..records.plan import Plan
from .common import (
    STATE,
    CacheOpt,
    DeviceOpt,
    GpuMemoryOpt,
    JsonOpt,
    OffloadOpt,
    PaperDeviceOpt,
    VerboseOpt,
    cache_root,
    check_offload,
    gpu_cap,
    parse_size,
)


def plan_cmd(
    model: Annotated[
        str, typer.Option("--model", help="A folder, hf://org/name[@rev], a .gguf or gguf-pkg://.")
    ],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    device: PaperDeviceOpt = None,
    offload: OffloadOpt = "none",
    gpu_memory: GpuMemoryOpt = None,
    gpus: Annotated[
        int,
        typer.Option("--gpus", min=1, help="Plan for N GPUs under torchrun (GPU figures per GPU)."),
    ] = 1,
    host_memory: Annotated[
        str | None,
        typer.Option(
            "--host-memory",
            help="Plan with this much free host memory (e.g. 128GiB) instead of this "
            "machine's: --offload auto then chooses by it. With --gpu-memory, a plan on paper "
            "for a machine not at hand.",
        ),
    ] = None,
    table: Annotated[
        bool, typer.Option("--table", help="Also list every Linear module (as -v does).")
    ] = False,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> Shown:
    """The recipe on the model, from its config alone (no weights read): each group's method,
    scheme and module count, the KV cache, the size, the resource estimate, the fused sets
    and warnings; --table (or -v) adds every Linear module's line."""
    from ..fetch import read_config
    from ..model.devices import default_device, free_cpu_bytes, usable_gpu_bytes
    from ..quantize import plan_for_config
    from ..quantize.estimate import choose
    from ..recipe import load_recipe

    cap = gpu_cap(gpu_memory, device)
    r = load_recipe(recipe)
    config = read_config(model, cache_dir=cache_root(cache_dir))
    plan = plan_for_config(config, r)
    host = parse_size(host_memory, option="--host-memory")
    est = choose(plan, config, r, device or default_device(), offload=check_offload(offload),
                 free_gpu_bytes=usable_gpu_bytes(device, cap),
                 free_cpu_bytes=free_cpu_bytes() if host is None else host, ranks=gpus)  # fmt: skip
    plan = plan.model_copy(update={"estimate": est})
    full = table or STATE.verbose
    gates = "".join(f"\n  {line}" for line in r.gates.origin_lines())  # whose limits these are
    return Shown(plan, (module_table(plan) + "\n" if full else "") + plan_summary(plan, table=full)
                 + gates)  # fmt: skip


class Shown:
    """A record printed with a fuller text than its own summary (the CLI prints `summary()`
    or, with --json, the record)."""

    def __init__(self, record: Any, text: str) -> None:
        self.record, self.text = record, text

    def to_json(self) -> dict:
        return self.record.to_json()

    def summary(self) -> str:
        return self.text


def plan_summary(plan: Plan, *, table: bool = False) -> str:
    """The plan's summary, the fused sets (one scheme each, checked) and its warnings."""
    from ..model.roles import fused_sets

    sets = [s for s in fused_sets(m.name for m in plan.modules) if len(s) > 1]
    lines = [plan.summary()]
    if sets:
        lines.append(f"  fused sets: {len(sets)} (e.g. {', '.join(n.rsplit('.', 1)[-1] for n in sets[0])}"
                     "), each stored one way as vLLM loads them")  # fmt: skip
    lines += [f"  ! {n}" for n in plan.notes]
    if not table:
        lines.append("  (every module: qship plan --table)")
    return "\n".join(lines)


def module_table(plan: Plan) -> str:
    """One plain line per Linear module, columns as wide as their widest cell: nothing is
    cut, in a terminal or a pipe."""
    head = ("module", "group", "method", "scheme", "in→out", "bits/w")
    rows = [head] + [
        (m.name, m.group, m.method,
         (m.scheme.label() if m.scheme else f"{plan.dtype} (kept)") + (" (tied)" if m.tied else ""),
         f"{m.in_features}→{m.out_features}", f"{m.bits_per_weight:.3f}")
        for m in plan.modules
    ]  # fmt: skip
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def quantize_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local checkpoint directory.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (must not exist).")],
    device: DeviceOpt = None,
    offload: OffloadOpt = "none",
    gpu_memory: GpuMemoryOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> QuantizedCheckpoint:
    """Calibrate, quantize and save a compressed-tensors checkpoint, checked against the plan."""
    from transformers import AutoTokenizer

    from ..data.tokens import build_token_sets
    from ..quantize import quantize
    from ..recipe import load_recipe
    from ..runner.stages import Context, check_recipe

    if not model.is_dir():  # a Path: "gguf-pkg://x" has already become "gguf-pkg:/x"
        raise UsageError(f"{model}: not a checkpoint directory", path="--model",
                         hint="quantize takes a local folder; `qship fetch SRC` writes one from "
                         "hf://, a .gguf or gguf-pkg://, and `qship run` takes those directly")  # fmt: skip
    r = load_recipe(recipe)
    # as `qship run` does: the plan and the estimate before any weight is read (exit 2), auto
    # offload resolved by it, the process held to --gpu-memory
    ctx = Context(cache_dir=cache_root(cache_dir), device=device, offload=check_offload(offload),
                  gpu_memory=gpu_cap(gpu_memory, device))  # fmt: skip
    check_recipe(str(model), r, ctx, show_plan=False, checkpoint_to=out)
    with log.stage("tokens") as line:
        tokens = build_token_sets(AutoTokenizer.from_pretrained(model), r.calibration,
                                  r.evaluation, cache_dir=ctx.cache_dir)  # fmt: skip
        line.note = tokens.info.summary()
    with log.stage("quantize") as line:
        qc = quantize(model, r, out, tokens=tokens, device=device, offload=ctx.offload)
        assert qc is not None  # one process: always the writer
        line.note = f"{qc.checkpoint.bits_per_weight_quantized:.3f} bits/weight → {out}"
    return qc
