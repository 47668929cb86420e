"""quantize: load, plan, run llm-compressor's oneshot, save compressed, check, hand on.

One calibration pass through llm-compressor's sequential pipeline at the recipe's batch
size (`bare=True`: its own defaults instead -- independent pipeline, batch 1 -- for
benchmarks). The output folder is built with io.atomic.atomic_dir: complete, checked
(checks.py) and renamed, or absent.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..data.tokens import TokenSets
from ..errors import StageError, UsageError
from ..io.atomic import atomic_dir
from ..model.devices import DTYPES, compute_dtype, default_device
from ..model.files import CONFIG_FILES, TOKENIZER_FILES, hash_model_dir
from ..model.loading import load_model
from ..recipe import Recipe
from ..records.checkpoint import (
    CheckpointSummary,
    PostSaveChecks,
    QuantizedCheckpoint,
    QuantizeTimings,
)
from .checks import check_expert_tokens, check_saved, verify_reload
from .memory import PhasePeaks, release_llmcompressor_session
from .metrics import capture_metrics
from .modifiers import build_modifiers
from .patches import awq_lean_grid_search, cpu_pin_memory_fix, library_logs_to_stderr
from .plan import build_plan


def quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    *,
    tokens: TokenSets,
    device: str | None = None,
    bare: bool = False,
) -> QuantizedCheckpoint:
    """Quantize `model_dir` by `recipe` into `out_dir` (complete or absent)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise UsageError(
            f"output directory {out_dir} already exists",
            path=str(out_dir),
            hint="remove it or pick another --out",
        )
    device = device or default_device()
    peaks = PhasePeaks(device)
    with library_logs_to_stderr():
        return _quantize(model_dir, recipe, out_dir, tokens, device, bare, peaks)


def _oneshot_kwargs(recipe: Recipe, tokens: TokenSets, bare: bool) -> dict[str, Any]:
    from datasets import Dataset

    ids = tokens.calib_ids
    kwargs: dict[str, Any] = {
        "num_calibration_samples": int(ids.shape[0]),
        "max_seq_length": int(ids.shape[1]),
        "moe_calibrate_all_experts": recipe.calibration.all_experts,
    }
    if recipe.needs_calibration():
        mask = torch.ones_like(ids)
        kwargs["dataset"] = Dataset.from_dict(
            {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        )
        if not bare:
            kwargs.update(
                batch_size=recipe.calibration.batch_size,
                pipeline="sequential",
                shuffle_calibration_samples=False,
            )
    elif not bare:
        kwargs["pipeline"] = "datafree"
    return kwargs


def _quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    tokens: TokenSets,
    device: str,
    bare: bool,
    peaks: PhasePeaks,
) -> QuantizedCheckpoint:
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model = load_model(
        model_dir, device=device, dtype=compute_dtype(recipe.dtype, device), linear_experts=True
    )
    plan = build_plan(model, recipe)
    modifiers = build_modifiers(plan, recipe)
    kwargs = _oneshot_kwargs(recipe, tokens, bare)
    kwargs.update(model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), recipe=modifiers)
    t_load = time.perf_counter() - t0
    log.detail(
        f"{plan.architecture}: {len(plan.modules)} Linear modules, "
        f"{sum(1 for m in plan.modules if m.scheme)} quantized; modifiers: "
        + ", ".join(type(m).__name__ for m in modifiers)
        + f"; device {device}"
    )

    t1 = time.perf_counter()
    lean = contextlib.nullcontext() if bare else awq_lean_grid_search()
    with cpu_pin_memory_fix() as pin_patched, lean, capture_metrics(model, plan) as got:
        try:
            model = oneshot(**kwargs) or model
        except Exception as e:
            raise StageError(
                f"llm-compressor oneshot failed: {type(e).__name__}: {e}", path=str(model_dir)
            ) from e
    t_oneshot = time.perf_counter() - t1
    peaks.end_phase("oneshot")
    check_expert_tokens(got.expert_tokens, plan, recipe, model_dir)
    log.detail(f"oneshot done in {t_oneshot:.1f} s; saving compressed")

    with atomic_dir(out_dir) as tmp:
        t2 = time.perf_counter()
        model.to(DTYPES[recipe.dtype].torch())  # computed in float32 on the CPU (devices.py)
        model.save_pretrained(tmp, save_compressed=True)
        for f in (*TOKENIZER_FILES, *CONFIG_FILES[1:]):
            if (model_dir / f).is_file():
                shutil.copyfile(model_dir / f, tmp / f)
        # llm-compressor writes its own recipe.yaml; keep it under a name that cannot be
        # taken for qship's resolved recipe (package writes recipe.yaml)
        if (tmp / "recipe.yaml").is_file():
            (tmp / "recipe.yaml").rename(tmp / "llmcompressor_recipe.yaml")
        t_save = time.perf_counter() - t2
        peaks.end_phase("save")
        # the checks need only the saved files: drop every reference to the calibrated
        # model first (ours, oneshot's kwargs, llm-compressor's session), so that it is not
        # resident beside the reloaded one
        del model
        kwargs.clear()
        release_llmcompressor_session()
        peaks.free()
        insp = check_saved(tmp, plan)
        probe = tokens.heldout_ids[:1, : min(64, tokens.heldout_ids.shape[1])]
        probe_tokens = verify_reload(tmp, probe, device)
        peaks.end_phase("verify")
        _, mhash = hash_model_dir(tmp)
        q = [m for m in plan.modules if m.scheme]
        seconds = time.perf_counter() - t0
        record = QuantizedCheckpoint(
            path=Path("."),
            model_hash=mhash,
            recipe_name=recipe.name,
            recipe_hash=recipe.hash(),
            device=device,
            mode="bare llm-compressor defaults" if bare else "qship (sequential pipeline, batched)",
            calibration=tokens.info,
            batch_size=1 if bare else recipe.calibration.batch_size,
            plan=plan,
            modifiers=[type(m).__name__ for m in modifiers],
            gptq=got.gptq,
            awq=got.awq,
            layers=got.layers,
            expert_tokens=got.expert_tokens,
            checkpoint=CheckpointSummary(
                bytes=insp.bytes,
                expected_bytes=plan.expected_checkpoint_bytes,
                bits_per_weight_quantized=plan.bits_per_weight.quantized,
                bits_per_weight_linear=plan.bits_per_weight.linear,
                quantized_modules=len(q),
                kept_modules=len(plan.modules) - len(q),
            ),
            checks=PostSaveChecks(
                checked_modules=len(plan.modules),
                config_groups=insp.config_groups,
                format=insp.format,
                tensors=insp.tensors,
                reload_probe_tokens=probe_tokens,
            ),
            timings=QuantizeTimings(
                load_and_plan=t_load, oneshot=t_oneshot, save=t_save, total=seconds
            ),
            peak_memory=peaks.result(),
            cpu_pin_memory_patch=pin_patched,
        )
        record.write(tmp)
        tmp.chmod(0o755)
        for p in tmp.iterdir():
            p.chmod(0o644)
    log.detail(f"wrote {out_dir} ({insp.bytes / 1e6:.2f} MB) in {seconds:.1f} s")
    return record.model_copy(update={"path": out_dir})
