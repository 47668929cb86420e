"""Roles resolved from the module tree: one recipe runs unchanged on every listed family,
from the config alone (meta device); bad recipes exit 2 naming the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_run import qship
from factories import DIMS

from pipeline.errors import RecipeError
from pipeline.model.loading import meta_model
from pipeline.model.roles import CHECKED, resolve
from pipeline.quantize import plan_for_config
from pipeline.recipe import load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parent.parent
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
           shared_expert_intermediate_size=128)  # fmt: skip
# model type -> (attention, mlp, experts, router) Linear-or-router counts for 2 layers
EXPECT = {
    "gemma2": (8, 6, 0, 0), "gemma3_text": (8, 6, 0, 0), "llama": (8, 6, 0, 0),
    "mistral": (8, 6, 0, 0), "qwen2": (8, 6, 0, 0), "qwen3": (8, 6, 0, 0),
    "phi3": (4, 4, 0, 0),  # fused qkv_proj / gate_up_proj
    "qwen3_moe": (8, 0, 24, 2), "mixtral": (8, 0, 24, 2), "olmoe": (8, 0, 24, 2),
    "qwen2_moe": (8, 6, 24, 4),  # a shared expert (mlp) and its gate (router)
}  # fmt: skip
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))


def config(model_type: str):
    from transformers import AutoConfig

    moe = "moe" in model_type or model_type in ("mixtral", "olmoe")
    return AutoConfig.for_model(model_type, **DIMS, **(MOE if moe else {}))


@pytest.mark.parametrize("model_type", sorted(EXPECT))
def test_roles_of_every_listed_family(model_type):
    st = resolve(meta_model(config(model_type)))
    got = tuple(len(st.roles[r]) for r in ("attention", "mlp", "experts", "router"))
    assert got == EXPECT[model_type]
    assert st.roles["lm_head"] == ["lm_head"] and len(st.roles["embeddings"]) == 1
    assert model_type in CHECKED and st.rule.startswith("structural rules, checked on")
    assert [lp.layer for lp in st.layers] == ["model.layers.0", "model.layers.1"]
    if EXPECT[model_type][2]:  # experts are linearized: per-expert Linear modules
        assert st.roles["experts"][0].endswith("mlp.experts.0.up_proj")


@pytest.mark.parametrize("model_type", sorted(EXPECT))
def test_every_shipped_recipe_plans_unchanged_on_every_family(model_type):
    cfg = config(model_type)
    if model_type == "mixtral":  # refused: the pinned transformers cannot load it back
        with pytest.raises(RecipeError, match="cannot load back the experts"):
            plan_for_config(cfg, load_recipe(SHIPPED[0]))
        return
    for p in SHIPPED:
        r = load_recipe(p)
        if any(g.scheme and g.scheme.activations and g.scheme.bits == 4 for g in r.groups):
            # vLLM's W4A8 kernel needs both widths of every Linear divisible by 128
            meta = plan_for_config(cfg, load_recipe(ROOT / "recipes" / "gptq-w4.yaml"))
            if any(m.in_features % 128 or m.out_features % 128 for m in meta.modules if m.scheme):
                with pytest.raises(RecipeError, match="divisible by 128"):
                    plan_for_config(cfg, r)
                continue
        skips = r.kv_cache.skip_layers if r.kv_cache else []
        if skips and max(skips) >= DIMS["num_hidden_layers"]:
            with pytest.raises(RecipeError, match="skip_layers lists layer"):
                plan_for_config(cfg, r)
            continue
        plan = plan_for_config(cfg, r)
        assert all(m.group != "(others)" for m in plan.modules), p.name  # every Linear claimed
        quantized = {m.role for m in plan.modules if m.scheme}
        assert quantized == {r for r in ("attention", "mlp", "experts") if plan.roles[r]}, p.name
        assert all(m.scheme is None for m in plan.modules if m.role == "lm_head")


def test_phi3_awq_mappings_follow_the_fused_projections():
    plan = plan_for_config(config("phi3"), load_recipe(ROOT / "recipes" / "awq-w4.yaml"))
    kinds = {(mp.kind, mp.smooth.rsplit(".", 1)[-1]) for mp in plan.mappings}
    assert ("norm->qkv", "input_layernorm") in kinds and (
        "norm->gate/up",
        "post_attention_layernorm",
    ) in kinds
    assert not any(mp.kind == "v->o" for mp in plan.mappings)  # no separate v_proj
    qkv = next(mp for mp in plan.mappings if mp.kind == "norm->qkv")
    assert qkv.applied and qkv.balance == ["model.layers.0.self_attn.qkv_proj"]


def test_moe_awq_mapping_balances_every_expert_and_the_router():
    plan = plan_for_config(config("qwen3_moe"), load_recipe(ROOT / "recipes" / "awq-w4.yaml"))
    mp = next(m for m in plan.mappings if m.kind == "norm->gate/up")
    assert mp.applied and "model.layers.0.mlp.gate" in mp.balance  # the kept router absorbs it
    assert sum(".experts." in b for b in mp.balance) == 8  # 4 experts x gate/up
    assert sum(m.kind == "up->down" for m in plan.mappings) == 2 * 4


def test_unknown_family_uses_the_generic_rules(tiny_llama, capsys):
    cfg = config("granite")
    st = resolve(meta_model(cfg))
    assert "granite" not in CHECKED and st.rule.startswith("generic structural rules")
    plan = plan_for_config(cfg, load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml"))
    assert plan.structure_rule == st.rule and plan.roles["attention"] == 8


def test_plan_cli_from_config_alone(tmp_path, capsys):
    """`qship plan` on a folder holding only config.json: roles -> modules, no weights."""
    d = tmp_path / "moe"
    d.mkdir()
    config("qwen3_moe").save_pretrained(d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]
    rc, plan = qship(capsys, "plan", "--model", str(d), "--recipe",
                     str(ROOT / "recipes" / "gemma-mixed-w4.yaml"))  # fmt: skip
    assert rc == 0, plan
    assert plan["roles"]["experts"] == 24 and plan["roles"]["router"] == 2
    groups = {m["name"]: (m["group"], m["role"]) for m in plan["modules"]}
    assert groups["model.layers.1.mlp.experts.3.down_proj"] == ("mlp", "experts")
    assert groups["lm_head"] == ("head", "lm_head")


def _recipe(**over) -> dict:
    d = yaml.safe_load((ROOT / "recipes" / "gemma-mixed-w4.yaml").read_text())
    d.update(over)
    return d


def test_moe_recipe_on_a_dense_model_is_exit_2(tmp_path, tiny_llama, capsys):
    d = _recipe()
    d["groups"].insert(2, {"name": "experts", "roles": ["experts"], "method": "rtn",
                           "scheme": {"bits": 4}})  # fmt: skip
    d["groups"][1]["roles"] = ["mlp"]
    p = tmp_path / "moe-recipe.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, err = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
    assert rc == 2 and err["error"] == "RecipeError" and err["path"] == str(p)
    assert "groups[2].roles" in err["message"] and "'experts'" in err["message"]
    assert "LlamaForCausalLM" in err["message"] and "Mixture-of-Experts" in err["hint"]


def test_unclaimed_linear_is_exit_2_unless_others_keep(tiny_llama):
    d = _recipe()
    d["groups"] = d["groups"][:2]  # no group claims lm_head
    with pytest.raises(RecipeError) as e:
        plan_for_config(config("llama"), parse_recipe(d, path="r.yaml"))
    assert "lm_head" in e.value.message and "others: keep" in e.value.hint
    plan = plan_for_config(config("llama"), parse_recipe({**d, "others": "keep"}, path="r.yaml"))
    head = plan.by_name()["lm_head"]
    assert head.group == "(others)" and head.scheme is None and "others: keep" in head.note


def test_indivisible_widths_fall_back_per_module():
    """hidden 96: group 128 divides nothing there; fallback gives 32 (the largest power of
    two >= 32 dividing 96), the plan says so, and the bits per weight count it."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", **{**DIMS, "hidden_size": 96, "head_dim": 24})
    d = _recipe()
    plan = plan_for_config(cfg, parse_recipe(d, path="r.yaml"))
    q = plan.by_name()["model.layers.0.self_attn.q_proj"]  # in 96
    down = plan.by_name()["model.layers.0.mlp.down_proj"]  # in 256: divisible
    assert q.scheme.group_size == 32 and "does not divide 96" in q.note
    assert down.scheme.group_size == 128 and not down.note
    assert q.bits_per_weight == pytest.approx(4 + 16 / 32 + 4 / 32 + 64 / (96 * 96))
    assert any("fallback group size" in n for n in plan.notes)
    for g in d["groups"]:
        if g.get("scheme"):
            g["scheme"]["on_indivisible"] = "error"
    with pytest.raises(RecipeError, match="does not divide the input width 96"):
        plan_for_config(cfg, parse_recipe(d, path="r.yaml"))


def test_roles_and_targets_combine_and_overlap_is_refused():
    d = _recipe()
    d["groups"][0]["targets"] = ["re:.*mlp\\.down_proj$"]  # attention group also takes down
    with pytest.raises(RecipeError, match="overlap"):
        plan_for_config(config("llama"), parse_recipe(d, path="r.yaml"))
    d["groups"][1]["roles"] = []
    d["groups"][1]["targets"] = ["re:.*mlp\\.(gate|up)_proj$"]
    plan = plan_for_config(config("llama"), parse_recipe(d, path="r.yaml"))
    assert plan.by_name()["model.layers.0.mlp.down_proj"].group == "attention"
    with pytest.raises(RecipeError, match="`roles` or `targets`"):
        parse_recipe({**d, "groups": [{"name": "x", "method": "none"}]}, path="r.yaml")


def test_plan_json_round_trips(tmp_path, capsys):
    from pipeline.records import Plan

    plan = plan_for_config(config("qwen2_moe"), load_recipe(ROOT / "recipes" / "gptq-w4.yaml"))
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


@pytest.mark.parametrize(
    ("model_type", "split", "whole"),
    [
        ("llama", ["model.layers.0.self_attn.v_proj"],
         [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]),
        ("qwen2", ["model.layers.1.mlp.up_proj"], ["model.layers.1.mlp.gate_proj",
                                                    "model.layers.1.mlp.up_proj"]),
        ("qwen3_moe", ["model.layers.0.mlp.experts.1.down_proj"],
         [f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(4) for p in ("gate", "up", "down")]),
    ],
)  # fmt: skip
def test_modules_served_as_one_fused_layer_share_one_scheme(model_type, split, whole):
    """vLLM loads q/k/v, gate/up and an MoE block's experts as one layer with one scheme: a
    recipe that moves part of such a set to int8 is refused before compute, naming a module
    on each side; moving the whole set plans, every member at int8."""
    base = yaml.safe_load((ROOT / "recipes" / "gptq-w4.yaml").read_text())

    def moved(names: list[str]) -> dict:
        data = json.loads(json.dumps(base))
        data["groups"][0]["exclude"] = names
        data["groups"].insert(1, {**data["groups"][0], "name": "w8", "targets": names,
                                  "scheme": {**data["groups"][0]["scheme"], "bits": 8}})  # fmt: skip
        del data["groups"][1]["roles"], data["groups"][1]["exclude"]
        return data

    cfg = config(model_type)
    with pytest.raises(RecipeError, match="one fused layer with one scheme") as e:
        plan_for_config(cfg, parse_recipe(moved(split), path="split.yaml"))
    assert split[0] in str(e.value) and "int8" in str(e.value) and "int4" in str(e.value)
    plan = plan_for_config(cfg, parse_recipe(moved(whole), path="whole.yaml"))
    assert sorted(m.name for m in plan.modules if m.scheme and m.scheme.bits == 8) == sorted(whole)
