"""Recipes: the schema (schema.py: one YAML file = one quantization plan, its calibration,
evaluation and gates; methods.py each method's group and options, groups.py what they share; formats.py the number formats, serving.py the `serve:` section) and
reading one (loading.py: find, parse, and name the field and the fix when it is wrong)."""

from .formats import PRESETS, Activations, Scheme, SmoothQuant, Target
from .groups import GroupBase, MethodOptions, Role
from .loading import SHIPPED_RECIPES, find_recipe, load_recipe, parse_recipe
from .methods import CALIBRATED_METHODS, GPU_METHODS, METHODS, Group, Method
from .schema import (
    GATE_FIGURES,
    CalibrationConfig,
    CustomTask,
    DType,
    EvaluationConfig,
    GateOrigin,
    Gates,
    KVCache,
    Recipe,
    TaskGate,
)
from .serving import DEFAULT_WORKLOADS, LongContext, ServeGate, SpeedGates, Workload

__all__ = [
    "CALIBRATED_METHODS", "GPU_METHODS", "PRESETS", "Activations", "SmoothQuant", "Target", "SHIPPED_RECIPES", "CalibrationConfig", "CustomTask",
    "DType", "EvaluationConfig", "GATE_FIGURES", "GateOrigin", "Gates", "Group", "GroupBase", "KVCache", "LongContext", "METHODS", "Method", "MethodOptions", "Recipe",
    "DEFAULT_WORKLOADS", "Role", "Scheme", "ServeGate", "SpeedGates", "Workload", "TaskGate", "find_recipe", "load_recipe", "parse_recipe",
]  # fmt: skip
