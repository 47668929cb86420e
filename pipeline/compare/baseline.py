"""Baselines: comparison rows without a recipe -- what a team gets without qship.

A baseline is the reference model loaded with a transformers quantization config
(bitsandbytes NF4 or LLM.int8(): the one-liner qship replaces), saved once per model
in the stage cache (`baseline/<key>`), then measured by the same evaluate stage as every
recipe, on the same held-out tokens: KL, top-1, perplexity, benchmarks, size. It has no
gate (it is never recommended) and is marked as not servable by vLLM's fast kernels.
bitsandbytes is an optional extra (`pip install 'qship[bnb]'`); without it the row says so.
"""

from __future__ import annotations

import importlib.metadata
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.tokens import TokenSets
from ..errors import StageError, UsageError
from ..io.cache import stage_key
from ..model.devices import default_device, device_kind
from ..model.files import CONFIG_FILES, TOKENIZER_FILES, hash_model_dir
from ..recipe import Recipe
from ..records.checkpoint import QuantizeSummary
from ..records.evaluation import EvalFile, ModelRef
from ..records.snapshot import Snapshot
from ..runner.stages import Context, EvalData, evaluate_stage

STAGE = "baseline"
MODEL = "model"  # the saved baseline's folder inside its cache entry
PACKAGE = "bitsandbytes"
NOT_SERVABLE = (
    "not servable by vLLM's fast kernels (vLLM runs bitsandbytes weights through its own "
    "dequantizing path, not the Marlin/Machete int4 or FP8 kernels qship's recipes target)"
)


@dataclass(frozen=True)
class Baseline:
    name: str
    what: str  # the one line of transformers it stands for
    label: str  # its weight format, as a row's `formats`
    options: dict[str, Any]  # BitsAndBytesConfig's arguments (bnb_4bit_compute_dtype aside)

    def config(self) -> Any:
        import torch
        from transformers import BitsAndBytesConfig

        extra = (
            {"bnb_4bit_compute_dtype": torch.bfloat16} if self.options.get("load_in_4bit") else {}
        )
        return BitsAndBytesConfig(**self.options, **extra)

    def describe(self) -> str:
        return f"baseline without qship: {self.what}; {NOT_SERVABLE}"


BASELINES = {
    b.name: b
    for b in (
        Baseline(
            "bnb-nf4",
            "bitsandbytes NF4, blocks of 64, double quant, bf16 compute",
            "NF4 g64 (bitsandbytes)",
            {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
        ),  # fmt: skip
        Baseline(
            "bnb-int8",
            "bitsandbytes LLM.int8() (per-row int8, outliers in 16-bit)",
            "INT8 per-row (bitsandbytes)",
            {"load_in_8bit": True},
        ),  # fmt: skip
    )
}


def get(name: str) -> Baseline:
    if name not in BASELINES:
        raise UsageError(
            f"unknown baseline {name!r}",
            path="--baseline",
            hint=f"one of {', '.join(BASELINES)}",
        )
    return BASELINES[name]


def unavailable() -> str | None:
    """Why no baseline can run here (bitsandbytes missing), or None."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        return (f"not measured: {PACKAGE} is not installed ({type(e).__name__}: {e}); "
                "install it with `pip install 'qship[bnb]'`")  # fmt: skip
    return None


def _stored_bits(model: Any) -> float:
    """Stored bits per quantized weight: every tensor bitsandbytes saves for a quantized
    weight (packed codes, absmax, nested absmax, code book, quant state; int8's row scales)."""
    import bitsandbytes as bnb

    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    mods = [m for m in model.modules() if isinstance(m, kinds)]
    weights = sum(m.in_features * m.out_features for m in mods)
    stored = sum(
        t.numel() * t.element_size()
        for m in mods
        for k, t in m.state_dict().items()
        if k.startswith("weight") or k == "SCB"
    )
    if not weights:
        raise StageError("the bitsandbytes config quantized no Linear module",
                         path=STAGE, hint="check the bitsandbytes / transformers versions "
                         "against constraints.txt")  # fmt: skip
    return 8 * stored / weights


def _peak(device: str) -> tuple[int, Any]:
    import torch

    if device_kind(device) == "cuda":
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


def build(source: Path, baseline: Baseline, out: Path, *, device: str, key: str) -> QuantizeSummary:
    """Load `source` with the baseline's quantization config and save it to `out` (config,
    weights, tokenizer), as transformers loads it back. -> its row's quantize figures."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    on = {"device_map": device} if device_kind(device) != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(source), quantization_config=baseline.config(), dtype="auto", **on
    )
    bits = _stored_bits(model)
    model.save_pretrained(out)
    for f in (*TOKENIZER_FILES, *CONFIG_FILES[1:]):
        if (source / f).is_file():
            shutil.copyfile(source / f, out / f)
    peak, kind = _peak(device)
    return QuantizeSummary(
        name=baseline.name, recipe=None, recipe_hash=key, bits_per_weight=bits,
        size_bytes=sum(p.stat().st_size for p in out.glob("*.safetensors")),
        seconds=time.perf_counter() - t0, peak_mem_bytes=peak, peak_mem_kind=kind,
        formats=[baseline.label], baseline=baseline.describe(),
    )  # fmt: skip


def key(model_hash: str, baseline: Baseline, device: str) -> str:
    return stage_key(STAGE, {
        "model": model_hash, "baseline": baseline.name, "options": baseline.options,
        PACKAGE: importlib.metadata.version(PACKAGE), "device": device_kind(device),
    })  # fmt: skip


def measure(
    name: str, snap: Snapshot, recipe: Recipe, tokens: TokenSets, evdata: EvalData, ctx: Context
) -> EvalFile:
    """The baseline `name` built (or taken from the cache) and evaluated by the runner's
    evaluate stage with `recipe`'s evaluation settings: its eval.json, without a verdict."""
    b = get(name)
    device = ctx.device or default_device()
    k = key(snap.model_hash, b, device)

    def make(tmp: Path) -> dict[str, Any]:
        return build(snap.path, b, tmp / MODEL, device=device, key=k).to_json()

    with ctx.stage(STAGE, k) as line:
        entry = ctx.cache.get_or_build(STAGE, k, make)
        summary = QuantizeSummary.from_json(entry.record, where=str(entry.path))
        line.note = f"{name}: {summary.bits_per_weight:.3f} bits/weight, " \
                    f"{summary.size_bytes / 1e6:.0f} MB"  # fmt: skip
        line.cached = entry.hit
    folder = entry.path / MODEL
    cand = ModelRef(path=folder, model_hash=hash_model_dir(folder)[1])
    report = evaluate_stage(snap, cand, k, recipe, tokens, evdata, ctx)
    return EvalFile.of(report, quantize=summary)
