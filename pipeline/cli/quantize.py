"""qship plan, qship quantize"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .. import log
from ..records.checkpoint import QuantizedCheckpoint
from ..records.plan import Plan
from .common import CacheOpt, DeviceOpt, JsonOpt, OffloadOpt, VerboseOpt, cache_root, check_offload


def plan_cmd(
    model: Annotated[
        str, typer.Option("--model", help="A folder, hf://org/name[@rev], a .gguf or gguf-pkg://.")
    ],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    device: DeviceOpt = None,
    offload: OffloadOpt = "none",
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> Plan:
    """Every Linear module's group, method and scheme, the AWQ mappings and the size, from
    the model's config alone (no weights read)."""
    from ..fetch import read_config
    from ..model.devices import default_device, free_cpu_bytes, free_gpu_bytes
    from ..quantize import plan_for_config
    from ..quantize.estimate import choose
    from ..recipe import load_recipe

    r = load_recipe(recipe)
    config = read_config(model, cache_dir=cache_root(cache_dir))
    plan = plan_for_config(config, r)
    est = choose(plan, config, r, device or default_device(), offload=check_offload(offload),
                 free_gpu_bytes=free_gpu_bytes(device), free_cpu_bytes=free_cpu_bytes())  # fmt: skip
    plan = plan.model_copy(update={"estimate": est})
    if not as_json:
        log.console().print(module_table(plan))
    return plan


def module_table(plan: Plan) -> Any:
    from rich.table import Table

    t = Table(title=f"plan: {plan.recipe_name} on {plan.architecture}", show_lines=False)
    t.add_column("module", no_wrap=True)
    for col in ("group", "method", "scheme", "in→out", "bits/w"):
        t.add_column(col)
    for m in plan.modules:
        sch = m.scheme.label() if m.scheme else f"{plan.dtype} (kept)"
        t.add_row(m.name, m.group, m.method, sch + (" (tied)" if m.tied else ""),
                  f"{m.in_features}→{m.out_features}", f"{m.bits_per_weight:.3f}")  # fmt: skip
    return t


def quantize_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local checkpoint directory.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (must not exist).")],
    device: DeviceOpt = None,
    offload: OffloadOpt = "none",
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> QuantizedCheckpoint:
    """Calibrate, quantize and save a compressed-tensors checkpoint, checked against the plan."""
    from transformers import AutoTokenizer

    from ..data.tokens import build_token_sets
    from ..model.loading import load_meta_model
    from ..quantize import build_plan, quantize
    from ..recipe import load_recipe

    check_offload(offload, auto=False)
    r = load_recipe(recipe)
    build_plan(load_meta_model(model), r)  # an invalid recipe: exit 2 before any compute
    with log.stage("tokens") as line:
        tokens = build_token_sets(AutoTokenizer.from_pretrained(model), r.calibration,
                                  r.evaluation, cache_dir=cache_root(cache_dir))  # fmt: skip
        line.note = tokens.info.summary()
    with log.stage("quantize") as line:
        qc = quantize(model, r, out, tokens=tokens, device=device, offload=offload)
        assert qc is not None  # one process: always the writer
        line.note = f"{qc.checkpoint.bits_per_weight_quantized:.3f} bits/weight → {out}"
    return qc
