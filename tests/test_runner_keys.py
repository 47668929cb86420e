"""The quantize and evaluate stages' cache keys. Every recipe field that changes the weights
is in the quantize key, so a changed recipe can never be served a checkpoint made for another
(a SmoothQuant strength was not: 0.5 and 0.8 shared one entry until 2026-12-06); qship's own
rounding and its simulation of the serving engine are in them where they apply."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pipeline.recipe import Recipe, load_recipe
from pipeline.runner import stages

ROOT = Path(__file__).resolve().parent.parent
SNAP, TOKENS = SimpleNamespace(model_hash="m" * 64), SimpleNamespace(calib_hash="c" * 64)


def _key(r: Recipe) -> str:
    return stages.quantize_key(SNAP, r, TOKENS, "cpu")  # type: ignore[arg-type]


def _bare_inputs(r: Recipe) -> dict:
    """The quantize key's inputs for `r` as they were before any optional field or qship
    rounding was added to them."""
    resolved = r.resolved()
    calibration = {
        k: v for k, v in resolved["calibration"].items() if k not in ("chat_template", "mix")
    }  # fields added after 2026-12-07
    return {"model": SNAP.model_hash, "calib": TOKENS.calib_hash, "device": "cpu",
            "recipe": {k: resolved[k] for k in ("dtype", "groups", "kv_cache")}
            | {"calibration": calibration}}  # fmt: skip


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
    assert _key(r) == stages.stage_key("quantize", _bare_inputs(r))


def test_w4a8_gptq_keys_qships_own_rounding():
    """GPTQ rounds W4A8 weights to the served values (quantize/w4a8_gptq.py): its cache
    entries from before are other checkpoints; W4A16 with the same weights keeps its key."""
    r = load_recipe(ROOT / "recipes" / "w4a8-fp8.yaml")
    old = _bare_inputs(r)
    assert _key(r) != stages.stage_key("quantize", old)
    assert _key(r) == stages.stage_key("quantize", {**old, "gptq_rounding": "served-w4a8"})
    g = r.groups[0]
    assert g.scheme is not None and g.scheme.w4a8
    w4a16 = g.model_copy(update={"scheme": g.scheme.model_copy(update={"activations": None})})
    assert not w4a16.scheme.w4a8


def test_w4a8_without_gptq_keys_its_own_rounding():
    """RTN's W4A8 weights moved to the served values (quantize/w4a8_rtn.py) key
    that rounding; a recipe with GPTQ and RTN W4A8 groups keys both."""
    r = load_recipe(ROOT / "recipes" / "w4a8-fp8.yaml")
    rtn = r.model_copy(update={"groups": [g.model_copy(update={"method": "rtn"})
                                          if g.method == "gptq" else g for g in r.groups]})  # fmt: skip
    assert _key(rtn) == stages.stage_key(
        "quantize", {**_bare_inputs(rtn), "rtn_rounding": "served-w4a8"}
    )
    both = r.model_copy(update={"groups": [*r.groups, rtn.groups[0].model_copy(
        update={"name": "other"})]})  # fmt: skip
    assert _key(both) == stages.stage_key(
        "quantize",
        {**_bare_inputs(both), "gptq_rounding": "served-w4a8", "rtn_rounding": "served-w4a8"},
    )


def test_an_evaluation_computed_as_served_is_keyed_by_the_simulations_revision(monkeypatch):
    """An evaluation whose candidate qship computes as vLLM would (activations rounded, an
    FP8 KV cache) is recomputed when that simulation changes; a weight-only one is not."""
    from pipeline.evaluate import numerics

    ctx = SimpleNamespace(device="cpu", exact_kl=True)
    toks = SimpleNamespace(heldout_hash="h" * 64)

    def keys(name: str) -> tuple[str, str]:
        r = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        before = stages.evaluate_key(SNAP, "q", r, toks, ctx)  # type: ignore[arg-type]
        monkeypatch.setattr(numerics, "SERVED_NUMERICS", "next-revision")
        after = stages.evaluate_key(SNAP, "q", r, toks, ctx)  # type: ignore[arg-type]
        monkeypatch.undo()
        return before, after

    for served in ("w4a8-fp8", "fp8-dynamic", "gptq-w4"):  # activations, FP8 KV cache
        before, after = keys(served)
        assert before != after, served
    before, after = keys("mixed-w4-nokv")  # 16-bit activations and KV cache
    assert before == after
