"""quantize: load, plan, run llm-compressor's oneshot, save compressed, check, hand on.

One calibration pass through llm-compressor's sequential pipeline at the recipe's batch
size (`bare=True`: its own defaults instead -- independent pipeline, batch 1 -- for
benchmarks). The output folder is built with io.atomic.atomic_dir: complete, checked
(checks.py) and renamed, or absent.

`offload` cpu / disk: the weights stay in host memory / on disk and the sequential pipeline
onloads one decoder layer at a time (model/loading.py). Under torch.distributed (one
process per GPU, distributed.py) every rank calibrates on its share of the samples and
llm-compressor reduces the statistics across ranks; rank 0 alone writes and checks.
"""

from __future__ import annotations

import contextlib
import os
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
from ..model.loading import load_model, weights_in_place
from ..recipe import Recipe
from ..records.checkpoint import (
    CheckpointSummary,
    LayerTime,
    PostSaveChecks,
    QuantizedCheckpoint,
    QuantizeTimings,
)
from ..records.plan import Plan
from . import ranks
from .checks import check_expert_tokens, check_saved, verify_reload
from .memory import PhasePeaks, release_llmcompressor_session
from .metrics import capture_metrics
from .modifiers import build_modifiers
from .patches import (
    awq_lean_grid_search,
    device_map_only_when_offloaded,
    hooked_attention_stays_hooked,
    library_logs_to_stderr,
    pinned_cache_released_per_module,
    rank_local_device,
    without_accelerator,
)
from .plan import build_plan
from .resume import LayerStore, restoring
from .w4a8_gptq import gptq_rounds_to_served_w4a8
from .w4a8_rtn import rtn_rounds_to_served_w4a8


def quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    *,
    tokens: TokenSets,
    device: str | None = None,
    bare: bool = False,
    offload: str = "none",
    resume_dir: Path | None = None,
) -> QuantizedCheckpoint | None:
    """Quantize `model_dir` by `recipe` into `out_dir` (complete or absent). Under
    torch.distributed only rank 0 returns the record (the other ranks None). `resume_dir`:
    where finished decoder layers are kept for a rerun after a kill (resume.py)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise UsageError(
            f"output directory {out_dir} already exists",
            path=str(out_dir),
            hint="remove it or pick another --out",
        )
    device = device or default_device()
    peaks = PhasePeaks(device)
    # disk offload: the weights' files beside the output, gone with it on any exit
    spill = out_dir.with_name(f".{out_dir.name}.offload-{os.getpid()}")
    try:
        with library_logs_to_stderr():
            return _quantize(model_dir, recipe, out_dir, tokens, device, bare, peaks,
                             offload, spill, resume_dir)  # fmt: skip
    finally:
        shutil.rmtree(spill, ignore_errors=True)


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


def _by_rtn(plan: Plan) -> list[str]:
    """The quantized modules whose values RTN chose (the recipe schema allows W4A8 with RTN
    and GPTQ only)."""
    return [m.name for m in plan.modules if m.scheme is not None and m.method == "rtn"]


def _layer_at(plan: Plan, done: list[LayerTime]) -> str:
    finished = {d.layer for d in done}
    todo = [d for d in plan.decoder_layers if d not in finished]
    where = f" in {todo[0]}" if todo else ""
    return where + (f" (rank {ranks.rank()})" if ranks.world_size() > 1 else "")


def _quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    tokens: TokenSets,
    device: str,
    bare: bool,
    peaks: PhasePeaks,
    offload: str,
    spill: Path,
    resume_dir: Path | None,
) -> QuantizedCheckpoint | None:
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    # a disk-offloaded weight is read back in its file's dtype, so with --offload disk the
    # math runs in the recipe's dtype on the CPU too (slow there, but the weights and the
    # checkpoint agree); host memory is where a CPU run's weights are anyway
    dtype = recipe.dtype if offload == "disk" else compute_dtype(recipe.dtype, device)
    model = load_model(model_dir, device=device, dtype=dtype, linear_experts=True,
                       offload=offload, offload_dir=spill)  # fmt: skip
    with weights_in_place(model):  # shapes and identities, not an onload of every weight
        plan = build_plan(model, recipe)
    modifiers = build_modifiers(plan, recipe)
    kwargs = _oneshot_kwargs(recipe, tokens, bare)
    kwargs.update(model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), recipe=modifiers)
    t_load = time.perf_counter() - t0
    peaks.end_phase("load")
    log.detail(
        f"{plan.architecture}: {len(plan.modules)} Linear modules, "
        f"{sum(1 for m in plan.modules if m.scheme)} quantized; modifiers: "
        + ", ".join(type(m).__name__ for m in modifiers)
        + f"; device {device}"
    )

    t1 = time.perf_counter()
    lean = contextlib.nullcontext() if bare else awq_lean_grid_search()
    # bare: the library's own rounding too
    w4a8 = contextlib.nullcontext([0]) if bare else gptq_rounds_to_served_w4a8()
    store = LayerStore(resume_dir, plan)
    with (
        without_accelerator() as pin_patched,
        rank_local_device(),
        hooked_attention_stays_hooked(),
        lean,
        w4a8 as rounded_count,
        capture_metrics(model, plan, on_layer=ranks.layer_done, store=store) as got,
        restoring(model, store),
    ):
        try:
            model = oneshot(**kwargs) or model
        except Exception as e:
            at = _layer_at(plan, got.layers)
            raise StageError(
                f"llm-compressor oneshot failed{at}: {type(e).__name__}: {e}",
                path=str(model_dir),
                hint="a CUDA out-of-memory error: pass --offload cpu (one decoder layer on "
                "the GPU at a time) or lower calibration.batch_size"
                if "out of memory" in str(e).lower()
                else None,
            ) from e
    # every rank holds every weight here and moves the same ones the same way
    moved = 0 if bare else rtn_rounds_to_served_w4a8(model, _by_rtn(plan))
    t_oneshot = time.perf_counter() - t1
    peaks.end_phase("oneshot")
    got.expert_tokens = ranks.summed(got.expert_tokens)  # each rank saw its share
    served_rounded = ranks.summed({"n": rounded_count[0]})["n"]  # each rank its own modules
    if served_rounded:
        log.detail(f"GPTQ rounded {served_rounded} W4A8 Linears to the weights vLLM serves")
    if moved:
        log.detail(f"rounded {moved} W4A8 Linears without GPTQ to the weights vLLM serves")
    served_rounded += moved
    check_expert_tokens(got.expert_tokens, plan, recipe, model_dir)
    log.detail(f"oneshot done in {t_oneshot:.1f} s; saving compressed")

    t2 = time.perf_counter()
    model.to(DTYPES[recipe.dtype].torch())  # computed in float32 on the CPU (devices.py)
    released = pinned_cache_released_per_module if offload == "cpu" else contextlib.nullcontext
    if not ranks.is_writer():  # compressing is collective; rank 0 alone writes the files
        with released(), device_map_only_when_offloaded():
            model.save_pretrained(spill / "not-written", save_compressed=True)
        ranks.gather_peaks(peaks.result())
        return None
    with atomic_dir(out_dir) as tmp:
        with released(), device_map_only_when_offloaded():
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
        rank_peaks = ranks.gather_peaks(peaks.result())
        insp = check_saved(tmp, plan)
        probe = tokens.heldout_ids[:1, : min(64, tokens.heldout_ids.shape[1])]
        with ranks.alone():
            probe_tokens = verify_reload(tmp, probe, device, offload=offload)
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
            offload=offload,
            resumed_layers=len(store.restored),
            processes=ranks.world_size(),
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
            rank_peak_memory=rank_peaks,
            cpu_pin_memory_patch=pin_patched,
            served_rounding_modules=served_rounded,
        )
        record.write(tmp)  # (modes: atomic_dir and the writers follow the umask)
    store.clear()  # the checkpoint is complete: its layers are not needed again
    log.detail(f"wrote {out_dir} ({insp.bytes / 1e6:.2f} MB) in {seconds:.1f} s")
    return record.model_copy(update={"path": out_dir})
