"""The quantize stage: a Snapshot's checkpoint + a recipe -> a QuantizedCheckpoint.

validate.py   the recipe against the model's module tree (exit 2 before any compute)
plan.py       every Linear -> group, method, scheme; AWQ mappings; expected size
methods.py    each recipe method's rounding: its modifier, time model, key entries
modifiers.py  the plan as llm-compressor modifiers
engine.py     load, calibrate (oneshot), save compressed, check (complete or absent)
metrics.py    GPTQ error, AWQ loss, time per layer (and the progress bar)
memory.py     peak memory per phase
checks.py     the post-save checks (shared validator + plan + reload)
"""

from .engine import quantize
from .plan import build_plan, plan_for_config, plan_for_dir

__all__ = ["build_plan", "plan_for_config", "plan_for_dir", "quantize"]
