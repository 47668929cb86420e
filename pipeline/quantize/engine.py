"""quantize: load, plan, run llm-compressor's oneshot, save compressed, check, hand on.

One calibration pass through llm-compressor's sequential pipeline at the recipe's batch
size, with qship's scoped library patches (pipeline/compat) and its own rounding (W4A8's
served values). The output folder is built with io.atomic.atomic_dir: complete, checked
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..compat.llmcompressor_0_14 import (
    awq_lean_grid_search,
    device_map_only_when_offloaded,
    hooked_attention_stays_hooked,
    library_logs_to_stderr,
    rank_local_device,
    without_accelerator,
)
from ..data.tokens import TokenSets
from ..errors import StageError, UsageError
from ..io.atomic import atomic_dir
from ..model.checkpoint import CheckpointInspection
from ..model.devices import DTYPES, compute_dtype, default_device
from ..model.files import CONFIG_FILES, TOKENIZER_FILES, hash_model_dir
from ..model.loading import load_model, weights_elsewhere, weights_in_place
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
from .memory import PhasePeaks, pinned_cache_released_per_module, release_llmcompressor_session
from .metrics import Captured, capture_metrics
from .modifiers import build_modifiers
from .plan import build_plan
from .resume import LayerStore, restoring
from .w4a8_gptq import gptq_rounds_to_served_w4a8
from .w4a8_rtn import rtn_rounds_to_served_w4a8

MODE = "qship (sequential pipeline, batched)"


def quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    *,
    tokens: TokenSets,
    device: str | None = None,
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
            job = _Job(model_dir, recipe, tokens, device, offload, spill, resume_dir, peaks)
            return _quantize(job, out_dir)
    finally:
        shutil.rmtree(spill, ignore_errors=True)


@dataclass
class _Job:
    """One quantize run: its inputs, and what each phase hands the next."""

    model_dir: Path
    recipe: Recipe
    tokens: TokenSets
    device: str
    offload: str
    spill: Path
    resume_dir: Path | None
    peaks: PhasePeaks
    t0: float = field(default_factory=time.perf_counter)
    model: Any = None  # _load sets it, _release_model drops it
    plan: Any = None  # the Plan, once _load built it
    modifiers: list[Any] = field(default_factory=list)
    oneshot_kwargs: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Calibrated:
    got: Captured
    store: LayerStore
    cpu_pin_memory_patch: bool
    served_rounded: int


@dataclass
class _Checked:
    saved: CheckpointInspection
    probe_tokens: int
    model_hash: str
    rank_peaks: Any


def _quantize(job: _Job, out_dir: Path) -> QuantizedCheckpoint | None:
    _load(job)
    cal = _calibrate(job)
    if not ranks.is_writer():  # compressing is collective; rank 0 alone writes the files
        _save(job, job.spill / "not-written")
        ranks.gather_peaks(job.peaks.result())
        return None
    with atomic_dir(out_dir) as tmp:
        _save(job, tmp)
        _copy_model_files(job.model_dir, tmp)
        _release_model(job)
        checked = _check(job, tmp)
        record = _record(job, cal, checked)
        record.write(tmp)  # (modes: atomic_dir and the writers follow the umask)
    cal.store.clear()  # the checkpoint is complete: its layers are not needed again
    log.detail(f"wrote {out_dir} ({checked.saved.bytes / 1e6:.2f} MB) in "
               f"{record.timings.total:.1f} s")  # fmt: skip
    return record.model_copy(update={"path": out_dir})


def _oneshot_kwargs(recipe: Recipe, tokens: TokenSets) -> dict[str, Any]:
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
        kwargs.update(
            batch_size=recipe.calibration.batch_size,
            pipeline="sequential",
            shuffle_calibration_samples=False,
        )
    else:
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


def _load(job: _Job) -> None:
    """The model loaded, its plan and modifiers built, oneshot's arguments ready."""
    from transformers import AutoTokenizer

    recipe = job.recipe
    # a disk-offloaded weight is read back in its file's dtype, so with --offload disk the
    # math runs in the recipe's dtype on the CPU too (slow there, but the weights and the
    # checkpoint agree); host memory is where a CPU run's weights are anyway
    dtype = recipe.dtype if job.offload == "disk" else compute_dtype(recipe.dtype, job.device)
    job.model = load_model(job.model_dir, device=job.device, dtype=dtype, linear_experts=True,
                           offload=job.offload, offload_dir=job.spill)  # fmt: skip
    with weights_in_place(job.model):  # shapes and identities, not an onload of every weight
        job.plan = build_plan(job.model, recipe)
    job.modifiers = build_modifiers(job.plan, recipe)
    job.oneshot_kwargs = _oneshot_kwargs(recipe, job.tokens)
    job.oneshot_kwargs.update(model=job.model, recipe=job.modifiers,
                              tokenizer=AutoTokenizer.from_pretrained(job.model_dir))  # fmt: skip
    job.seconds["load"] = time.perf_counter() - job.t0
    job.peaks.end_phase("load")
    log.detail(
        f"{job.plan.architecture}: {len(job.plan.modules)} Linear modules, "
        f"{sum(1 for m in job.plan.modules if m.scheme)} quantized; modifiers: "
        + ", ".join(type(m).__name__ for m in job.modifiers)
        + f"; device {job.device}"
    )


@contextlib.contextmanager
def _calibrating(job: _Job, store: LayerStore) -> Iterator[tuple[bool, list[int], Captured]]:
    """What oneshot runs inside: the library patches it needs here (pipeline/compat),
    GPTQ's served W4A8 rounding, the capture of what it measures, resumed layers. Yields
    (whether the CPU patches applied, [modules GPTQ rounded to served values], captured)."""
    with contextlib.ExitStack() as stack:
        cpu_patched = stack.enter_context(without_accelerator())
        stack.enter_context(rank_local_device())
        stack.enter_context(hooked_attention_stays_hooked())
        stack.enter_context(awq_lean_grid_search())
        rounded = stack.enter_context(gptq_rounds_to_served_w4a8())
        got = stack.enter_context(capture_metrics(job.model, job.plan, on_layer=ranks.layer_done,
                                                  store=store))  # fmt: skip
        stack.enter_context(restoring(job.model, store))
        yield cpu_patched, rounded, got


def _calibrate(job: _Job) -> _Calibrated:
    """oneshot over the calibration set, then W4A8's served rounding of RTN's modules."""
    from llmcompressor import oneshot

    t1 = time.perf_counter()
    store = LayerStore(job.resume_dir, job.plan)
    with _calibrating(job, store) as (cpu_patched, rounded_count, got):
        try:
            job.model = oneshot(**job.oneshot_kwargs) or job.model
        except Exception as e:
            raise StageError(
                f"llm-compressor oneshot failed{_layer_at(job.plan, got.layers)}: "
                f"{type(e).__name__}: {e}",
                path=str(job.model_dir),
                hint="a CUDA out-of-memory error: pass --offload cpu (one decoder layer on "
                "the GPU at a time) or lower calibration.batch_size"
                if "out of memory" in str(e).lower()
                else None,
            ) from e
    # every rank holds every weight here and moves the same ones the same way
    moved = rtn_rounds_to_served_w4a8(job.model, _by_rtn(job.plan))
    job.seconds["oneshot"] = time.perf_counter() - t1
    job.peaks.end_phase("oneshot")
    got.expert_tokens = ranks.summed(got.expert_tokens)  # each rank saw its share
    served_rounded = ranks.summed({"n": rounded_count[0]})["n"]  # each rank its own modules
    if served_rounded:
        log.detail(f"GPTQ rounded {served_rounded} W4A8 Linears to the weights vLLM serves")
    if moved:
        log.detail(f"rounded {moved} W4A8 Linears without GPTQ to the weights vLLM serves")
    check_expert_tokens(got.expert_tokens, job.plan, job.recipe, job.model_dir)
    log.detail(f"oneshot done in {job.seconds['oneshot']:.1f} s; saving compressed")
    return _Calibrated(got, store, cpu_patched, served_rounded + moved)


def _save(job: _Job, folder: Path) -> None:
    """The calibrated model saved compressed into `folder`, in the recipe's dtype."""
    t2 = time.perf_counter()
    job.model.to(DTYPES[job.recipe.dtype].torch())  # computed in float32 on the CPU (devices.py)
    cpu = job.offload == "cpu"
    released = pinned_cache_released_per_module() if cpu else contextlib.nullcontext()
    with released, device_map_only_when_offloaded(weights_elsewhere):
        job.model.save_pretrained(folder, save_compressed=True)
    job.seconds["save"] = time.perf_counter() - t2


def _copy_model_files(model_dir: Path, tmp: Path) -> None:
    for f in (*TOKENIZER_FILES, *CONFIG_FILES[1:]):
        if (model_dir / f).is_file():
            shutil.copyfile(model_dir / f, tmp / f)
    # llm-compressor writes its own recipe.yaml; keep it under a name that cannot be
    # taken for qship's resolved recipe (package writes recipe.yaml)
    if (tmp / "recipe.yaml").is_file():
        (tmp / "recipe.yaml").rename(tmp / "llmcompressor_recipe.yaml")


def _release_model(job: _Job) -> None:
    """The checks need only the saved files: every reference to the calibrated model
    dropped first (ours, oneshot's arguments, llm-compressor's session), so that it is not
    resident beside the reloaded one."""
    job.peaks.end_phase("save")
    job.model = None
    job.oneshot_kwargs.clear()
    release_llmcompressor_session()
    job.peaks.free()


def _check(job: _Job, tmp: Path) -> _Checked:
    """The saved checkpoint held to the plan and reloaded (checks.py)."""
    rank_peaks = ranks.gather_peaks(job.peaks.result())
    insp = check_saved(tmp, job.plan)
    held = job.tokens.heldout_ids
    probe = held[:1, : min(64, held.shape[1])]
    with ranks.alone():
        probe_tokens = verify_reload(tmp, probe, job.device, offload=job.offload)
    job.peaks.end_phase("verify")
    _, mhash = hash_model_dir(tmp)
    return _Checked(insp, probe_tokens, mhash, rank_peaks)


def _record(job: _Job, cal: _Calibrated, checked: _Checked) -> QuantizedCheckpoint:
    plan, recipe, got = job.plan, job.recipe, cal.got
    q = [m for m in plan.modules if m.scheme]
    return QuantizedCheckpoint(
        path=Path("."),
        model_hash=checked.model_hash,
        recipe_name=recipe.name,
        recipe_hash=recipe.hash(),
        device=job.device,
        mode=MODE,
        offload=job.offload,
        resumed_layers=len(cal.store.restored),
        processes=ranks.world_size(),
        calibration=job.tokens.info,
        batch_size=recipe.calibration.batch_size,
        plan=plan,
        modifiers=[type(m).__name__ for m in job.modifiers],
        gptq=got.gptq,
        awq=got.awq,
        layers=got.layers,
        expert_tokens=got.expert_tokens,
        checkpoint=CheckpointSummary(
            bytes=checked.saved.bytes,
            expected_bytes=plan.expected_checkpoint_bytes,
            bits_per_weight_quantized=plan.bits_per_weight.quantized,
            bits_per_weight_linear=plan.bits_per_weight.linear,
            quantized_modules=len(q),
            kept_modules=len(plan.modules) - len(q),
        ),
        checks=PostSaveChecks(
            checked_modules=len(plan.modules),
            config_groups=checked.saved.config_groups,
            format=checked.saved.format,
            tensors=checked.saved.tensors,
            reload_probe_tokens=checked.probe_tokens,
        ),
        timings=QuantizeTimings(
            load_and_plan=job.seconds["load"],
            oneshot=job.seconds["oneshot"],
            save=job.seconds["save"],
            total=time.perf_counter() - job.t0,
        ),
        peak_memory=job.peaks.result(),
        rank_peak_memory=checked.rank_peaks,
        cpu_pin_memory_patch=cal.cpu_pin_memory_patch,
        served_rounding_modules=cal.served_rounded,
    )
