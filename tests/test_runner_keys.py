"""The quantize stage's cache key: every recipe field that changes the weights is in it, so a
changed recipe can never be served a checkpoint made for another (a SmoothQuant strength was
not: 0.5 and 0.8 shared one entry until 2026-12-06)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pipeline.recipe import Recipe, load_recipe
from pipeline.runner import stages

ROOT = Path(__file__).resolve().parent.parent
SNAP, TOKENS = SimpleNamespace(model_hash="m" * 64), SimpleNamespace(calib_hash="c" * 64)


def _key(r: Recipe) -> str:
    return stages.quantize_key(SNAP, r, TOKENS, "cpu")  # type: ignore[arg-type]


def test_every_recipe_field_is_declared_in_or_out_of_the_key():
    declared = stages._QUANT_FIELDS + stages._QUANT_OPTIONAL + stages._NOT_QUANT_FIELDS
    assert sorted(declared) == sorted(Recipe.model_fields), "decide where a new field goes"


def test_smoothquant_strength_is_part_of_the_key():
    r = load_recipe(ROOT / "recipes" / "w8a8-int8-sq.yaml")
    assert r.smoothquant is not None
    half = r.model_copy(update={"smoothquant": r.smoothquant.model_copy(update={"strength": 0.5})})
    none = r.model_copy(update={"smoothquant": None})
    assert len({_key(r), _key(half), _key(none)}) == 3
    # fields outside the weights do not move it
    assert _key(r.model_copy(update={"name": "other", "gates": r.gates.model_copy()})) == _key(r)


def test_a_recipe_without_the_optional_fields_keeps_its_key():
    """Entries made before smoothquant existed stay valid for recipes without it."""
    r = load_recipe(ROOT / "recipes" / "gptq-w4.yaml")
    resolved = r.resolved()
    old = {"model": SNAP.model_hash, "calib": TOKENS.calib_hash, "device": "cpu",
           "recipe": {k: resolved[k] for k in ("dtype", "groups", "kv_cache", "calibration")}}  # fmt: skip
    assert _key(r) == stages.stage_key("quantize", old)
