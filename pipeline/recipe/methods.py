"""The recipe's methods, one group class each: its options (typed, bounded by what a real
run could need), its facts (calibrated, GPU only, integer only: GroupBase's class
variables) and its own checks. `Group` is their union, told apart by `method`.

Adding a method: its options and group class here (and in `Group` and `METHODS`), how
quantize rounds it in quantize/methods.py (`ROUNDING`: its modifier and its time model),
and a test that quantizes a tiny trained model with it (tests/test_methods.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .formats import Scheme
from .groups import GroupBase, MethodOptions

Method = Literal["awq", "gptq", "autoround", "rtn", "none"]


class GptqOptions(MethodOptions):
    """dampening_frac, actorder, block_size; awq_scales (true: AWQ's smoothing scales are
    searched and folded in first, then GPTQ rounds the smoothed weights)."""

    method: ClassVar[str] = "gptq"
    dampening_frac: float | None = Field(default=None, gt=0, lt=1)
    # llm-compressor 0.14's GPTQ orders columns by static or weight only ("group" fails there)
    actorder: Literal["static", "weight"] | None = None
    # GPTQ's default block is 128 (beyond the bound: exit 2)
    block_size: int | None = Field(default=None, gt=0, le=8192)
    awq_scales: bool | None = None

    @field_validator("actorder", mode="before")
    @classmethod
    def _no_group_order(cls, v: Any) -> Any:
        if v == "group":
            raise ValueError(
                "actorder 'group' is refused by llm-compressor 0.14's GPTQ (only static and "
                "weight); use static (measured the same as weight on Gemma 3 270M)"
            )
        return v


class AwqOptions(MethodOptions):
    """n_grid, duo_scaling, offload_cache (true: AWQ's cached layer inputs in CPU memory
    instead of on the GPU, 0.3 GB lower peak on an 8B for +24 % time; false: on the GPU;
    null: llm-compressor's default)."""

    method: ClassVar[str] = "awq"
    # AWQ's default grid is 20 points
    n_grid: int | None = Field(default=None, gt=0, le=200)
    duo_scaling: bool | Literal["both"] | None = None
    offload_cache: bool | None = None


class AutoRoundOptions(MethodOptions):
    """iters: sign-gradient steps per decoder layer (llm-compressor's default 200)."""

    method: ClassVar[str] = "autoround"
    iters: int | None = Field(default=None, gt=0, le=10_000)


class RtnOptions(MethodOptions):
    method: ClassVar[str] = "rtn"


class KeepOptions(MethodOptions):
    method: ClassVar[str] = "none"


class GptqGroup(GroupBase):
    method: Literal["gptq"]
    scheme: Scheme | None = None
    options: GptqOptions = Field(default_factory=GptqOptions)
    calibrated: ClassVar[bool] = True

    @property
    def smoothed(self) -> bool:
        return bool(self.options.awq_scales)


class AwqGroup(GroupBase):
    """AWQ: smoothing scales searched on calibration data, then RTN's rounding."""

    method: Literal["awq"]
    scheme: Scheme | None = None
    options: AwqOptions = Field(default_factory=AwqOptions)
    calibrated: ClassVar[bool] = True
    integer_only: ClassVar[bool] = True

    @property
    def smoothed(self) -> bool:
        return True


class AutoRoundGroup(GroupBase):
    method: Literal["autoround"]
    scheme: Scheme | None = None
    options: AutoRoundOptions = Field(default_factory=AutoRoundOptions)
    calibrated: ClassVar[bool] = True
    # ~25x GPTQ's calibration time (bench/RESULTS.md): a CPU runner cannot afford it
    gpu_only: ClassVar[bool] = True
    integer_only: ClassVar[bool] = True

    @model_validator(mode="after")
    def _asymmetric(self) -> AutoRoundGroup:
        if self.scheme is not None and self.scheme.symmetric:
            raise ValueError(
                "method 'autoround' with symmetric: true writes negative scales (auto-round "
                "signs each group's scale by its largest-magnitude weight), which qship's "
                "checkpoint check refuses; set `symmetric: false`"
            )
        return self


class RtnGroup(GroupBase):
    """Round to nearest with the scheme's observer: no calibration data."""

    method: Literal["rtn"]
    scheme: Scheme | None = None
    options: RtnOptions = Field(default_factory=RtnOptions)


class KeepGroup(GroupBase):
    """`none`: the modules keep the recipe's dtype."""

    method: Literal["none"]
    scheme: Scheme | None = None
    options: KeepOptions = Field(default_factory=KeepOptions)
    quantizes: ClassVar[bool] = False


Group = Annotated[
    GptqGroup | AwqGroup | AutoRoundGroup | RtnGroup | KeepGroup, Field(discriminator="method")
]
# the method table: name -> its group class (its facts and options)
METHODS: dict[str, type[GroupBase]] = {
    "awq": AwqGroup, "gptq": GptqGroup, "autoround": AutoRoundGroup, "rtn": RtnGroup,
    "none": KeepGroup,
}  # fmt: skip
MethodOptions.every_key = frozenset(
    k
    for g in METHODS.values()
    for k in g.model_fields["options"].annotation.model_fields  # type: ignore[union-attr]
)
# the methods whose rounding depends on calibration data (rtn and none do not)
CALIBRATED_METHODS = tuple(m for m, g in METHODS.items() if g.calibrated)
GPU_METHODS = tuple(m for m, g in METHODS.items() if g.gpu_only)
