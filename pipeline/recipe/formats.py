"""A group's number formats: the weight scheme, the input activations a serving kernel
quantizes too (W8A8, W4A8), compressed-tensors' preset names as shorthand, and the serving
target the plan checks them against.

    scheme: {bits: 4, symmetric: true, group_size: 128}                 # W4A16 (int, packed)
    scheme: {preset: FP8_DYNAMIC}                                       # FP8 W8A8, data-free
    scheme: {type: float, bits: 8, strategy: block, block: [128, 128],
             activations: {type: float, strategy: group, group_size: 128}}   # = FP8_BLOCK
    scheme: {preset: W8A8}                                              # INT8 W8A8
    scheme: {preset: W4AFP8}                                            # int4 g128 + FP8 act

A preset fills the fields it names; keys written beside it override them. The preset name
is not kept: a recipe written long-hand has the same hash.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Strict as _Strict

_FP8_TOKEN = {"type": "float", "bits": 8, "strategy": "token", "dynamic": True}
# compressed-tensors 0.19's presets (quantization/quant_scheme.py) in qship's fields;
# tests/test_formats.py holds each translation against the library's own preset
PRESETS: dict[str, dict[str, Any]] = {
    "W4A16": {"type": "int", "bits": 4, "symmetric": True, "strategy": "group",
              "group_size": 128},
    "W4A16_ASYM": {"type": "int", "bits": 4, "symmetric": False, "strategy": "group",
                   "group_size": 128},
    "W8A16": {"type": "int", "bits": 8, "symmetric": True, "strategy": "group",
              "group_size": 128},
    "W8A8": {"type": "int", "bits": 8, "symmetric": True, "strategy": "channel",
             "group_size": None, "activations": {"type": "int", "bits": 8,
                                                 "strategy": "token", "dynamic": True}},
    "W4AFP8": {"type": "int", "bits": 4, "symmetric": True, "strategy": "group",
               "group_size": 128, "activations": _FP8_TOKEN},
    "FP8": {"type": "float", "bits": 8, "symmetric": True, "strategy": "tensor",
            "group_size": None, "activations": {"type": "float", "bits": 8,
                                                "strategy": "tensor", "dynamic": False}},
    "FP8_DYNAMIC": {"type": "float", "bits": 8, "symmetric": True, "strategy": "channel",
                    "group_size": None, "activations": _FP8_TOKEN},
    "FP8_BLOCK": {"type": "float", "bits": 8, "symmetric": True, "strategy": "block",
                  "group_size": None, "block": [128, 128],
                  "activations": {"type": "float", "bits": 8, "strategy": "group",
                                  "group_size": 128, "dynamic": True}},
}  # fmt: skip
# presets qship does not write, and why (the recipe error says it)
REFUSED_PRESETS = {
    "NVFP4": "FP4 has no fast kernel on Hopper (sm90): vLLM serves NVFP4/MXFP4 there as "
    "weight-only Marlin or by emulation, slower than W4A16; use W4A16 (gptq-w4.yaml) or "
    "FP8_DYNAMIC there",
}
for _n in ("NVFP4A16", "MXFP4", "MXFP4A16", "MXFP8", "MXFP8A16"):
    REFUSED_PRESETS[_n] = REFUSED_PRESETS["NVFP4"]


def _refuse_contradiction(name: str, preset: dict[str, Any], given: dict[str, Any]) -> None:
    """Keys beside a preset refine it (group size, observer ...); one that changes what the
    preset is -- the weight type or bits, activations present or not, their type -- makes
    the preset's name a lie (`{preset: FP8_DYNAMIC, type: int}`): refused."""
    for k in ("type", "bits"):
        if k in given and given[k] != preset[k]:
            raise ValueError(f"preset {name!r} has {k} {preset[k]!r}, the scheme also writes "
                             f"{k}: {given[k]!r}; delete `{k}`, or the preset and write the "
                             "scheme long-hand")  # fmt: skip
    if "activations" not in given:
        return
    want, got = preset.get("activations"), given["activations"]
    if (want is None) != (got is None) or (
        # written activations replace the preset's whole: an unwritten type is the default
        isinstance(got, dict)
        and want is not None
        and got.get("type", Activations.model_fields["type"].default) != want["type"]
    ):
        has = f"{want['type']} activations" if want else "no activation quantization"
        raise ValueError(f"preset {name!r} has {has}, the scheme's `activations` contradicts "
                         "it; delete `activations`, or choose the preset that has them")  # fmt: skip


class Activations(_Strict):
    """Input activations quantized at inference, as the serving kernel does: dynamic scales
    are computed per token (or per group of a token) on the fly; static ones (strategy
    tensor) are calibrated and stored as input_scale."""

    type: Literal["float", "int"] = "float"
    bits: Literal[8] = 8
    strategy: Literal["token", "tensor", "group"] = "token"
    dynamic: bool = True
    group_size: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> Activations:
        if self.strategy == "group" and not self.group_size:
            raise ValueError("activations.strategy group needs activations.group_size (128)")
        if self.strategy != "group" and self.group_size:
            raise ValueError(f"activations.group_size applies to strategy group, not "
                             f"{self.strategy}; delete it")  # fmt: skip
        if self.strategy in ("token", "group") and not self.dynamic:
            raise ValueError(
                f"activations.strategy {self.strategy} with dynamic: false: a static scale "
                "per token cannot be stored; use dynamic: true, or strategy tensor"
            )
        return self


class Scheme(_Strict):
    """A weight scheme (+ optional input activations). Integer weights: bits 4 or 8, packed;
    float weights: FP8 e4m3. strategy null = group when group_size is set, else channel."""

    type: Literal["int", "float"] = "int"
    bits: Literal[4, 8] = 4
    symmetric: bool = True
    group_size: int | None = 128
    strategy: Literal["group", "channel", "tensor", "block"] | None = None
    # block strategy: [rows, columns] of the weight sharing one scale (FP8_BLOCK: 128x128)
    block: list[int] | None = None
    # how the weight scales are chosen: null = the library default (min-max of each group);
    # mse = llm-compressor's "mse" observer, a grid search over shrunken ranges that keeps
    # the one with the least rounding error (clipping a few outliers buys finer steps);
    # imatrix_mse = the same search weighted by each input channel's mean squared
    # activation on the calibration data (llama.cpp's importance matrix; calibrated)
    observer: Literal["mse", "imatrix_mse"] | None = None
    # a module whose input width the group size does not divide: error (exit 2), or
    # fallback to the largest group size >= 32 that divides it, else one scale per channel
    on_indivisible: Literal["error", "fallback"] = "error"
    activations: Activations | None = None

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        name = data.pop("preset", None)
        if name is not None:
            key = str(name).upper()
            if key in REFUSED_PRESETS:
                raise ValueError(f"preset {name!r}: {REFUSED_PRESETS[key]}")
            if key not in PRESETS:
                raise ValueError(f"preset {name!r} is not one of {', '.join(PRESETS)}")
            _refuse_contradiction(str(name), PRESETS[key], data)
            data = {**PRESETS[key], **data}
        # a strategy without groups takes no group size unless one is written
        if data.get("strategy") in ("channel", "tensor", "block") and "group_size" not in data:
            data["group_size"] = None
        return data

    @field_validator("group_size")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("group_size must be a positive integer or null (per channel)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Scheme:
        if self.strategy is None:
            self.strategy = "group" if self.group_size else "channel"
        if self.strategy == "group" and not self.group_size:
            raise ValueError("strategy group needs a group_size")
        if self.strategy != "group" and self.group_size:
            raise ValueError(f"group_size {self.group_size} applies to strategy group, not "
                             f"{self.strategy}; set group_size: null")  # fmt: skip
        if self.strategy == "block":
            if not self.block or len(self.block) != 2 or min(self.block) <= 0:
                raise ValueError("strategy block needs block: [rows, columns], e.g. [128, 128]")
        elif self.block is not None:
            raise ValueError("block applies to strategy block; delete it")
        if self.type == "float":
            if self.bits != 8:
                raise ValueError("float weights are FP8 (bits: 8); FP4 is not written by qship")
            if not self.symmetric:
                raise ValueError("FP8 weights are symmetric (no zero point); set symmetric: true")
            if self.strategy == "group":
                raise ValueError("FP8 weights take strategy channel, tensor or block")
        elif self.strategy == "block":
            raise ValueError("strategy block is for FP8 weights (type: float)")
        if self.observer == "imatrix_mse":
            # llm-compressor's IMatrixMSEObserver: weight-only, channel or group scales
            if self.activations is not None or self.type != "int":
                raise ValueError("observer imatrix_mse is for integer weight-only schemes (no "
                                 "activations); use mse or null here")  # fmt: skip
            if self.strategy not in ("group", "channel"):
                raise ValueError(f"observer imatrix_mse takes strategy group or channel, not "
                                 f"{self.strategy}")  # fmt: skip
        return self

    @property
    def w4a8(self) -> bool:
        """Symmetric int4 group weights with FP8 activations: what vLLM's CUTLASS W4A8
        kernel serves (its GPTQ rounds to the served weights: quantize/w4a8_gptq.py)."""
        act = self.activations
        return serves_as_w4a8(self.type, self.bits, self.symmetric, self.strategy,
                              act.type if act is not None else None)  # fmt: skip


def serves_as_w4a8(
    weight_type: str, bits: int, symmetric: bool, strategy: str | None, activation_type: str | None
) -> bool:
    """The one rule for W4A8 (a recipe's Scheme and a checkpoint's compressed-tensors scheme
    both ask it): symmetric int4 weights by group with FP8 input activations."""
    return (weight_type == "int" and bits == 4 and symmetric and strategy == "group"
            and activation_type == "float")  # fmt: skip


class Target(_Strict):
    """Where the checkpoint will be served; the plan refuses (or flags) what that engine
    cannot run fast there (pipeline/quantize/serving.py). gpu: compute capability, sm90 =
    Hopper (H100/H200), sm89 = Ada (L4, L40S), sm80 = Ampere (A100)."""

    engine: Literal["vllm"] = "vllm"
    gpu: Literal["sm80", "sm89", "sm90", "sm100"] = "sm90"


class SmoothQuant(_Strict):
    """SmoothQuant (llm-compressor's modifier) before the rounding: activation outliers are
    moved into the weights of the Linear layers that read a norm (q/k/v, gate/up), so that
    per-token INT8 activations lose less. strength: how much (0 none, 1 all; 0.8 in
    llm-compressor's W8A8 examples)."""

    strength: float = Field(default=0.8, ge=0.0, le=1.0)
