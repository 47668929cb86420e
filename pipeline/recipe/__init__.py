"""Recipes: the schema (schema.py: one YAML file = one quantization plan, its calibration,
evaluation and gates; formats.py the number formats, serving.py the `serve:` section) and
reading one (loading.py: find, parse, and name the field and the fix when it is wrong)."""

from .formats import PRESETS, Activations, SmoothQuant, Target
from .loading import SHIPPED_RECIPES, find_recipe, load_recipe, parse_recipe
from .schema import (
    CALIBRATED_METHODS,
    GATE_FIGURES,
    GPU_METHODS,
    CalibrationConfig,
    CustomTask,
    DType,
    EvaluationConfig,
    GateOrigin,
    Gates,
    Group,
    KVCache,
    Method,
    Options,
    Recipe,
    Role,
    Scheme,
    TaskGate,
)
from .serving import DEFAULT_WORKLOADS, LongContext, ServeGate, SpeedGates, Workload

__all__ = [
    "CALIBRATED_METHODS", "GPU_METHODS", "PRESETS", "Activations", "SmoothQuant", "Target", "SHIPPED_RECIPES", "CalibrationConfig", "CustomTask",
    "DType", "EvaluationConfig", "GATE_FIGURES", "GateOrigin", "Gates", "Group", "KVCache", "LongContext", "Method", "Options", "Recipe",
    "DEFAULT_WORKLOADS", "Role", "Scheme", "ServeGate", "SpeedGates", "Workload", "TaskGate", "find_recipe", "load_recipe", "parse_recipe",
]  # fmt: skip
