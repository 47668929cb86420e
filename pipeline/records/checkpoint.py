"""QuantizedCheckpoint: what quantize hands on -- the compressed checkpoint and how it was made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from .base import SCHEMA_VERSION, Record
from .plan import Plan
from .tokens import TokenSetInfo

REPORT_FILE = "quantize_report.json"  # the record, beside the checkpoint it describes


class AwqMappingResult(Record):
    smooth: str | None
    parent: str | None
    initial_error: float
    best_error: float
    loss_reduction: float
    """1 - best_error / initial_error: what AWQ's scale search won on this mapping."""


class LayerTime(Record):
    layer: str
    """A decoder layer (or another subgraph of llm-compressor's sequential pipeline)."""
    seconds: float
    cuda_max_allocated_bytes: int | None = None


class CheckpointSummary(Record):
    bytes: int
    """Bytes of the saved *.safetensors."""
    expected_bytes: int
    """The plan's estimate."""
    bits_per_weight_quantized: float
    bits_per_weight_linear: float
    quantized_modules: int
    kept_modules: int


class CudaPeak(Record):
    max_allocated_bytes: int
    max_reserved_bytes: int


class PeakMemory(Record):
    peak_rss_bytes: int
    """The process's peak resident memory (a high-water mark of the whole process)."""
    cuda_max_allocated_bytes: int | None = None
    """On a GPU: the largest peak of the phases below."""
    cuda_max_reserved_bytes: int | None = None
    cuda_phases: dict[str, CudaPeak] = {}
    """oneshot (calibration + compression), save, verify (the reload check)."""
    cuda_allocated_at_start_bytes: int | None = None
    """Allocated before this quantize began (included in the peaks)."""

    def peak(self) -> tuple[int, Literal["cuda_max_allocated", "process_peak_rss"]]:
        if self.cuda_max_allocated_bytes is not None:
            return self.cuda_max_allocated_bytes, "cuda_max_allocated"
        return self.peak_rss_bytes, "process_peak_rss"


class QuantizeTimings(Record):
    load_and_plan: float
    oneshot: float
    save: float
    total: float


class PostSaveChecks(Record):
    checked_modules: int
    """Linear modules whose saved scheme was compared with the plan."""
    config_groups: int
    format: str | None
    tensors: int
    reload_probe_tokens: int
    """Tokens of the reload check (transformers reloads the checkpoint; logits finite)."""


class QuantizeSummary(Record):
    """What a comparison row needs of the quantize stage (stored in eval.json)."""

    name: str
    recipe: str | None = None
    """The recipe file as given."""
    recipe_hash: str
    bits_per_weight: float
    size_bytes: int
    seconds: float
    peak_mem_bytes: int
    peak_mem_kind: Literal["cuda_max_allocated", "process_peak_rss"]


class QuantizedCheckpoint(Record):
    schema_version: int = SCHEMA_VERSION
    path: Path
    """The compressed-tensors checkpoint folder (config, weights, tokenizer)."""
    model_hash: str
    """Its identity (pipeline.model.files.model_hash)."""
    recipe_name: str
    recipe_hash: str
    """Hash of the resolved recipe (Recipe.hash)."""
    device: str
    mode: str
    """qship's defaults (sequential pipeline, batched) or bare llm-compressor defaults."""
    calibration: TokenSetInfo
    batch_size: int
    """Calibration batch size used."""
    plan: Plan
    modifiers: list[str]
    """The llm-compressor modifiers, in order."""
    gptq: dict[str, float] = {}
    """GPTQ's per-module reconstruction error."""
    awq: list[AwqMappingResult] = []
    layers: list[LayerTime] = []
    checkpoint: CheckpointSummary
    checks: PostSaveChecks
    timings: QuantizeTimings
    peak_memory: PeakMemory
    cpu_pin_memory_patch: bool = False
    """True when AWQ's activation pinning had to be disabled (no accelerator)."""

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
