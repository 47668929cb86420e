"""How quantize rounds each recipe method (the recipe's side of a method, its options and
facts, is recipe/methods.py): its llm-compressor modifier, its time model for the estimate,
and what the quantize key names of it. modifiers.py, estimate.py and the runner's quantize
key read this table, never a method's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..recipe import Recipe
from .autoround_modifier import autoround_modifier_class

# (config groups, the group's options, the recipe, the FP8 KV scheme or None) -> modifier
ModifierBuilder = Callable[[dict[str, Any], Any, Recipe, Any], Any]


@dataclass(frozen=True)
class Rounding:
    # seconds per parameter-token on "cpu" and "cuda": estimate.py's fit of quantize time
    cost: dict[str, float]
    # the method's own modifier, one per option set; None: the shared QuantizationModifier
    # rounds its modules (RTN's observers, after AWQ's scales where smoothed)
    modifier: ModifierBuilder | None = None
    # whether that modifier can carry the FP8 KV scheme (AutoRound's takes every scheme it
    # holds for a weight's)
    carries_kv: bool = False
    # whether it accumulates a Hessian per Linear (the estimate's GPU memory)
    hessians: bool = False
    # whether its grid search caches attention-sized activations (the estimate's GPU memory)
    attention_cache: bool = False
    # the quantize-key entry naming qship's own rounding of its W4A8 weights (w4a8_*.py)
    w4a8_key: str | None = None


def _gptq(groups: dict[str, Any], opts: Any, recipe: Recipe, kv: Any) -> Any:
    from llmcompressor.modifiers.gptq import GPTQModifier

    kw: dict[str, Any] = {"config_groups": groups}
    for key in ("dampening_frac", "actorder", "block_size"):
        if getattr(opts, key) is not None:
            kw[key] = getattr(opts, key)
    if kv is not None:
        kw["kv_cache_scheme"] = kv
    return GPTQModifier(**kw)


def _autoround(groups: dict[str, Any], opts: Any, recipe: Recipe, kv: Any) -> Any:
    # AutoRound's batch must be the pipeline's (a larger calibration batch makes auto-round
    # take the sequence for the batch axis and exit the process)
    kw: dict[str, Any] = {"config_groups": groups, "batch_size": recipe.calibration.batch_size}
    if opts.iters is not None:
        kw["iters"] = opts.iters
    # torch.compile of the tuning loop needs a compiler toolchain on the machine; the loop
    # is a small share of the time on models qship calibrates layer by layer
    return autoround_modifier_class()(enable_torch_compile=False, **kw)


# in the order their modifiers run (after SmoothQuant, AWQ's scales and the shared one)
ROUNDING: dict[str, Rounding] = {
    "rtn": Rounding(cost={"cpu": 0.19, "cuda": 0.1}, w4a8_key="rtn_rounding"),
    "awq": Rounding(cost={"cpu": 2.47, "cuda": 1.6}, attention_cache=True),
    "gptq": Rounding(
        cost={"cpu": 0.37, "cuda": 0.5},
        modifier=_gptq,
        carries_kv=True,
        hessians=True,
        w4a8_key="gptq_rounding",
    ),  # fmt: skip
    "autoround": Rounding(cost={"cpu": 9.2, "cuda": 12.5}, modifier=_autoround),
    "none": Rounding(cost={"cpu": 0.0, "cuda": 0.0}),
}
