"""QuantizedCheckpoint: what quantize hands on -- the compressed checkpoint and how it was made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from ..recipe import load_recipe
from .base import SCHEMA_VERSION, Record
from .plan import Plan
from .tokens import TokenSetInfo

REPORT_FILE = "quantize_report.json"  # the record, beside the checkpoint it describes


class AwqMappingResult(Record):
    smooth: str | None
    """The smoothed module of the mapping."""
    parent: str | None
    """The module whose output AWQ's grid search compared."""
    initial_error: float
    """Output error of plain rounding."""
    best_error: float
    """Output error with the best scales found."""
    loss_reduction: float
    """1 - best_error / initial_error: what AWQ's scale search won on this mapping."""


class LayerTime(Record):
    layer: str
    """A decoder layer (or another subgraph of llm-compressor's sequential pipeline)."""
    seconds: float
    """Wall time of the layer's calibration and compression."""
    cuda_max_allocated_bytes: int | None = None
    """The running CUDA peak after the layer (null on the CPU)."""


class CheckpointSummary(Record):
    bytes: int
    """Bytes of the saved *.safetensors."""
    expected_bytes: int
    """The plan's estimate."""
    bits_per_weight_quantized: float
    """The plan's bits per quantized weight."""
    bits_per_weight_linear: float
    """The plan's bits over all Linear weights."""
    quantized_modules: int
    """Linear modules stored packed."""
    kept_modules: int
    """Linear modules kept in 16-bit."""


class CudaPeak(Record):
    max_allocated_bytes: int
    """torch.cuda.max_memory_allocated over the phase."""
    max_reserved_bytes: int
    """torch.cuda.max_memory_reserved over the phase."""


class HostPeak(Record):
    resident_bytes: int
    """The process's resident high-water mark over the phase (VmHWM): file pages of a
    memory-mapped read included while they are mapped."""
    anonymous_bytes: int | None = None
    """The largest anonymous + shared resident size sampled (every 50 ms) over the phase:
    the memory the process itself holds (page-locked copies included)."""


class PeakMemory(Record):
    peak_rss_bytes: int
    """The process's peak resident memory (a high-water mark of the whole process)."""
    cuda_max_allocated_bytes: int | None = None
    """On a GPU: the largest peak of the phases below."""
    cuda_max_reserved_bytes: int | None = None
    """On a GPU: the largest reserved peak of the phases."""
    cuda_phases: dict[str, CudaPeak] = {}
    """load, oneshot (calibration + compression), save, verify (the reload check)."""
    cuda_allocated_at_start_bytes: int | None = None
    """Allocated before this quantize began (included in the peaks)."""
    host_phases: dict[str, HostPeak] = {}
    """Linux: the process's host memory peaks in each phase (load, oneshot, save, verify)."""

    def peak(self) -> tuple[int, Literal["cuda_max_allocated", "process_peak_rss"]]:
        if self.cuda_max_allocated_bytes is not None:
            return self.cuda_max_allocated_bytes, "cuda_max_allocated"
        return self.peak_rss_bytes, "process_peak_rss"


class QuantizeTimings(Record):
    load_and_plan: float
    """Seconds to load the model and build the plan and modifiers."""
    oneshot: float
    """Seconds in llm-compressor's oneshot (calibration + compression) and qship's W4A8 rounding."""
    save: float
    """Seconds to save the compressed checkpoint."""
    total: float
    """Seconds for the whole quantize, checks included."""


class PostSaveChecks(Record):
    checked_modules: int
    """Linear modules whose saved scheme was compared with the plan."""
    config_groups: int
    """quantization_config groups in the saved config."""
    format: str | None
    """quantization_config.format (pack-quantized)."""
    tensors: int
    """Tensors in the saved checkpoint."""
    reload_probe_tokens: int
    """Tokens of the reload check (transformers reloads the checkpoint; logits finite)."""


class QuantizeSummary(Record):
    """What a comparison row needs of the quantize stage (stored in eval.json)."""

    name: str
    """The recipe's name (the row's name in a comparison)."""
    recipe: str | None = None
    """The recipe file as given."""
    recipe_hash: str
    """Recipe.hash() of the resolved recipe."""
    bits_per_weight: float
    """Stored bits per quantized weight."""
    size_bytes: int
    """Bytes of the quantized checkpoint's weights."""
    seconds: float
    """Wall time of quantize."""
    peak_mem_bytes: int
    """Peak memory of quantize (see peak_mem_kind)."""
    peak_mem_kind: Literal["cuda_max_allocated", "process_peak_rss"]
    """cuda_max_allocated (GPU, per quantize) or process_peak_rss (CPU, a high-water mark of the process)."""
    formats: list[str] = []
    """The weight and activation formats of its quantized Linears (W4A16, W8A8-FP8 ...)."""
    served_rounding_modules: int = 0
    """W4A8 Linears whose int4 values were chosen for vLLM's CUTLASS W4A8 kernel
    (QuantizedCheckpoint.served_rounding_modules)."""
    baseline: str | None = None
    """A baseline row (no recipe: the reference loaded with a transformers quantization
    config, compare/baseline.py): what it is and why vLLM's fast kernels do not serve it."""


class QuantizedCheckpoint(Record):
    schema_version: int = SCHEMA_VERSION
    """Version of this record's layout."""
    path: Path
    """The compressed-tensors checkpoint folder (config, weights, tokenizer)."""
    model_hash: str
    """Its identity (pipeline.model.files.model_hash)."""
    recipe_name: str
    """The recipe's name."""
    recipe_hash: str
    """Hash of the resolved recipe (Recipe.hash)."""
    device: str
    """Where it was quantized (cuda / cpu)."""
    mode: str
    """qship's defaults (sequential pipeline, batched) or bare llm-compressor defaults."""
    calibration: TokenSetInfo
    """The calibration and held-out token sets it was made with."""
    batch_size: int
    """Calibration batch size used."""
    offload: str = "none"
    """Where the weights lived during calibration: none (on the device), cpu, disk."""
    processes: int = 1
    """torch.distributed ranks that calibrated it (qship run --gpus N); 1: one process."""
    resumed_layers: int = 0
    """Decoder layers loaded from an interrupted run of the same inputs, not calibrated again."""
    plan: Plan
    """The plan the saved checkpoint was checked against."""
    modifiers: list[str]
    """The llm-compressor modifiers, in order."""
    gptq: dict[str, float] = {}
    """GPTQ's per-module reconstruction error."""
    awq: list[AwqMappingResult] = []
    """AWQ's result per smoothing mapping."""
    layers: list[LayerTime] = []
    """Time (and CUDA peak) per decoder layer."""
    expert_tokens: dict[str, int] = {}
    """MoE: calibration tokens each expert received (its module path -> tokens)."""
    checkpoint: CheckpointSummary
    """Size and bits of the saved checkpoint."""
    checks: PostSaveChecks
    """What the post-save checks checked."""
    timings: QuantizeTimings
    """Seconds per phase."""
    peak_memory: PeakMemory
    """Peak memory per phase (rank 0's)."""
    rank_peak_memory: list[PeakMemory] = []
    """Under torch.distributed: each rank's peak through calibration and save, by rank."""
    cpu_pin_memory_patch: bool = False
    """True when AWQ's activation pinning had to be disabled (no accelerator)."""
    served_rounding_modules: int = 0
    """W4A8 Linears rounded to the weights vLLM's CUTLASS W4A8 kernel serves instead of
    q * s: by GPTQ (quantize/w4a8_gptq.py) or, under RTN, to the nearest (w4a8_rtn.py)."""

    @property
    def seconds(self) -> float:
        return self.timings.total

    def brief(self, recipe: str | None = None) -> QuantizeSummary:
        peak, kind = self.peak_memory.peak()
        return QuantizeSummary(
            name=self.recipe_name,
            recipe=recipe,
            recipe_hash=self.recipe_hash,
            bits_per_weight=self.checkpoint.bits_per_weight_quantized,
            size_bytes=self.checkpoint.bytes,
            seconds=self.timings.total,
            peak_mem_bytes=peak,
            peak_mem_kind=kind,
            formats=sorted({m.scheme.format_label() for m in self.plan.modules if m.scheme}),
            served_rounding_modules=self.served_rounding_modules,
        )

    def write(self, folder: Path) -> None:
        """quantize_report.json in `folder`, its path relative ("." = that folder)."""
        data = self.model_copy(update={"path": Path(".")}).to_json()
        (Path(folder) / REPORT_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, folder: Path) -> QuantizedCheckpoint | None:
        """The record beside a checkpoint written by `qship quantize`, or None."""
        p = Path(folder) / REPORT_FILE
        if not p.is_file():
            return None
        rec = cls.from_json(json.loads(p.read_text(encoding="utf-8")), where=str(p))
        return rec.model_copy(update={"path": Path(folder)})

    def summary(self) -> str:
        c = self.checkpoint
        return (
            f"quantized {self.recipe_name} → {self.path} in {self.seconds:.1f} s; "
            f"{c.bits_per_weight_quantized:.3f} bits/weight, checkpoint {c.bytes / 1e6:.2f} MB "
            f"(expected {c.expected_bytes / 1e6:.2f} MB); config, tensor and reload checks passed"
        )


def kv_skip_layers(folder: Path) -> tuple[int, ...]:
    """The decoder layers whose KV cache the checkpoint or artifact in `folder` serves in
    16 bits (its recipe's kv_cache.skip_layers): from the quantize record beside a
    checkpoint, else from an artifact's recipe.yaml (an artifact has provenance.json; a bare
    checkpoint's recipe.yaml is llm-compressor's own); () when neither says."""
    folder = Path(folder)
    rec = QuantizedCheckpoint.read(folder)
    if rec is not None:
        kv = rec.plan.kv_cache
    elif (folder / "recipe.yaml").is_file() and (folder / "provenance.json").is_file():
        kv = load_recipe(folder / "recipe.yaml").kv_cache
    else:
        kv = None
    return tuple(kv.skip_layers) if kv else ()
