"""Plan correctness on the tiny Gemma 3 (GQA) and Llama (MHA) models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.quantize.plan import plan_for_dir, weight_storage_bits
from pipeline.recipe import load_recipe
from pipeline.records import ModuleScheme, Plan

ROOT = Path(__file__).resolve().parent.parent
R = ROOT / "recipes"
LAYERS = 4


def _expect_group(name: str) -> str:
    if "self_attn" in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "head"


# an integer weight scheme with groups and 16-bit activations (W4A16)
INT_GROUP = {"type": "int", "strategy": "group", "block": None, "activations": None}


@pytest.mark.parametrize("model", ["tiny_gemma", "tiny_llama"])
def test_mixed_plan_assigns_every_linear(model, request):
    plan = plan_for_dir(request.getfixturevalue(model), load_recipe(R / "gemma-mixed-w4.yaml"))
    assert len(plan.modules) == LAYERS * 7 + 1
    for m in plan.modules:
        assert m.group == _expect_group(m.name), m.name
        if m.group == "attention":
            assert m.method == "awq" and m.scheme.to_json() == {
                "bits": 4,
                "symmetric": False,
                "group_size": 128,
                "observer": None,
                **INT_GROUP,
            }
        elif m.group == "mlp":
            assert m.method == "gptq" and m.scheme.to_json() == {
                "bits": 4,
                "symmetric": True,
                "group_size": 128,
                "observer": None,
                **INT_GROUP,
            }
        else:
            assert m.name == "lm_head" and m.method == "none" and m.scheme is None
    assert plan.kv_cache.model_dump() == {
        "scheme": "fp8_e4m3",
        "strategy": "tensor",
        "dynamic": False,
        "query": False,
        "skip_layers": [],
    }
    assert plan.attention_class is None  # no query scale: no attention config group
    assert plan.decoder_layers == [f"model.layers.{i}" for i in range(LAYERS)]
    # AWQ mappings only for the attention group: never touching the MLP
    assert plan.mappings and all(
        "mlp" not in mp.smooth and all("mlp" not in b for b in mp.balance) for mp in plan.mappings
    )
    # round trip
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).to_json() == plan.to_json()


def test_gemma_gqa_mappings(tiny_gemma):
    plan = plan_for_dir(tiny_gemma, load_recipe(R / "gemma-mixed-w4.yaml"))
    applied = [mp for mp in plan.mappings if mp.applied]
    skipped = [mp for mp in plan.mappings if not mp.applied]
    # input_layernorm -> q/k/v is given explicitly (the library's Gemma 3 default drops it)
    assert [mp.smooth for mp in applied] == [
        f"model.layers.{i}.input_layernorm" for i in range(LAYERS)
    ]
    assert all(mp.kind == "norm->qkv" and len(mp.balance) == 3 for mp in applied)
    # v -> o skipped for shapes under GQA (2 KV heads x 32 = 64 != 128), and said so
    assert [mp.kind for mp in skipped] == ["v->o"] * LAYERS
    assert all("64" in mp.reason and "128" in mp.reason and "GQA" in mp.reason for mp in skipped)
    assert any("o_proj" in n for n in plan.notes)


def test_llama_mha_keeps_v_to_o(tiny_llama):
    plan = plan_for_dir(tiny_llama, load_recipe(R / "gemma-mixed-w4.yaml"))
    kinds = [(mp.kind, mp.applied) for mp in plan.mappings]
    assert kinds == [("norm->qkv", True), ("v->o", True)] * LAYERS


def test_awq_everywhere_uses_the_right_mlp_norm(tiny_gemma, tiny_llama):
    r = load_recipe(R / "awq-w4.yaml")
    g = plan_for_dir(tiny_gemma, r)
    norm = [mp.smooth for mp in g.mappings if mp.kind == "norm->gate/up"]
    assert norm == [f"model.layers.{i}.pre_feedforward_layernorm" for i in range(LAYERS)]
    assert all(mp.applied for mp in g.mappings if mp.kind in ("norm->gate/up", "up->down"))
    ll = plan_for_dir(tiny_llama, r)
    norm = [mp.smooth for mp in ll.mappings if mp.kind == "norm->gate/up"]
    assert norm == [f"model.layers.{i}.post_attention_layernorm" for i in range(LAYERS)]
    assert all(mp.applied for mp in ll.mappings)


def test_non_awq_recipes_have_no_mappings(tiny_gemma):
    for name in ("gptq-w4", "rtn-w4", "w8-int8"):
        assert plan_for_dir(tiny_gemma, load_recipe(R / f"{name}.yaml")).mappings == []


def test_bits_per_weight_and_size(tiny_gemma, tiny_llama):
    # int4 sym g128: 4 + 16/128 bits per weight (+ the 64-bit weight_shape per module)
    assert weight_storage_bits(
        128, 1024, ModuleScheme(bits=4, symmetric=True, group_size=128), 16
    ) == (128 * 1024 * 4 + 128 * 8 * 16 + 64)
    # asym adds a packed 4-bit zero point per group
    assert weight_storage_bits(
        128, 1024, ModuleScheme(bits=4, symmetric=False, group_size=128), 16
    ) == (128 * 1024 * 4 + 128 * 8 * 20 + 64)
    gptq = plan_for_dir(tiny_gemma, load_recipe(R / "gptq-w4.yaml"))
    assert 4.125 < gptq.bits_per_weight.quantized < 4.13
    awq = plan_for_dir(tiny_gemma, load_recipe(R / "awq-w4.yaml"))
    assert 4.156 < awq.bits_per_weight.quantized < 4.162
    mixed = plan_for_dir(tiny_gemma, load_recipe(R / "gemma-mixed-w4.yaml"))
    assert (
        gptq.bits_per_weight.quantized
        < mixed.bits_per_weight.quantized
        < awq.bits_per_weight.quantized
    )
    w8 = plan_for_dir(tiny_gemma, load_recipe(R / "w8-int8.yaml"))
    assert 8.1 < w8.bits_per_weight.quantized < 8.2  # per-channel scale: 16/in bits
    # Gemma's lm_head is tied to the embedding: stored once, not counted as a Linear
    head = mixed.by_name()["lm_head"]
    assert head.tied and head.stored_bytes == 0
    assert mixed.bits_per_weight.linear == mixed.bits_per_weight.quantized
    # Llama's is not tied: it counts at 16 bits
    ll = plan_for_dir(tiny_llama, load_recipe(R / "gemma-mixed-w4.yaml"))
    assert not ll.by_name()["lm_head"].tied and ll.bits_per_weight.linear > 6
    # checkpoint: embeddings 2048x128 bf16 + norms + packed linears < dense
    assert 2048 * 128 * 2 < mixed.expected_checkpoint_bytes < mixed.params.dense_bytes


def test_plan_cli_json_and_table(tiny_gemma, capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                str(tiny_gemma),
                "--recipe",
                str(R / "gemma-mixed-w4.yaml"),
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["recipe_name"] == "gemma-mixed-w4" and d["architecture"] == "Gemma3ForCausalLM"
    assert {m["name"]: m["method"] for m in d["modules"]}["model.layers.2.mlp.down_proj"] == "gptq"
    assert d["expected_checkpoint_bytes"] > 0 and "quantized" in d["bits_per_weight"]
    plan = ["plan", "--model", str(tiny_gemma), "--recipe", str(R / "gemma-mixed-w4.yaml")]
    assert main(plan) == 0
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj" not in err and "skipped" in err  # the summary
    assert main([*plan, "--table"]) == 0
    assert "model.layers.0.self_attn.q_proj" in capsys.readouterr().err  # and every module


def test_plan_needs_a_checkpoint_dir(tmp_path, capsys):
    code = main(
        ["plan", "--model", str(tmp_path), "--recipe", str(R / "gemma-mixed-w4.yaml"), "--json"]
    )
    assert code == 2 and "config.json" in json.loads(capsys.readouterr().out)["message"]


def test_resource_estimate_and_the_fit_check(capsys, tiny_llama, tmp_path, monkeypatch, cuda_here):
    """`qship plan --device` predicts memory, disk and time from the config; `qship run`
    on a GPU whose free memory is below the predicted peak exits 2 before fetching."""
    import json as _json

    from pipeline.model import devices
    from tests.cli_run import qship

    recipe = str(ROOT / "recipes" / "gemma-mixed-w4.yaml")
    rc, plan = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", recipe,
                     "--device", "cuda")  # fmt: skip
    assert rc == 0, plan
    est = plan["estimate"]
    dense = plan["params"]["dense_bytes"]
    assert est["device"] == "cuda" and est["quantize_gpu_bytes"] > dense
    assert est["quantize_s"] > 0 and est["disk_bytes"] > dense
    rc, cpu = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", recipe,
                    "--device", "cpu")  # fmt: skip
    assert cpu["estimate"]["quantize_gpu_bytes"] is None
    assert cpu["estimate"]["quantize_cpu_bytes"] > est["quantize_cpu_bytes"]  # fp32 on the CPU

    monkeypatch.setattr(devices, "free_gpu_bytes", lambda device: 1_000_000)
    out = tmp_path / "art"
    rc, err = qship(capsys, "run", "--model", str(tiny_llama), "--recipe", recipe, "--out",
                    str(out), "--device", "cuda", "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert rc == 2 and "GPU memory" in err["message"] and "0.0 GB are free" in err["message"]
    assert "--device cpu" in err["hint"]
    run = _json.loads((tmp_path / "art.report" / "run.json").read_text())
    assert not {"fetch", "quantize"} & {s["stage"] for s in run["stages"]}


def test_lengths_beyond_the_model_are_refused_at_plan_time(tmp_path, tiny_llama, capsys):
    """A `serve.long_context` length beyond the model's context (tiny Llama: 512 tokens)
    used to be caught only after quantize and evaluate: now `qship plan` exits 2 naming the
    length's field; "max" and lengths within the context plan."""
    import yaml

    d = yaml.safe_load((R / "fp8-dynamic.yaml").read_text())
    d["serve"] = {"engine": "transformers", "long_context": {"lengths": [256, 4096, "max"]}}
    p = tmp_path / "lc.yaml"
    p.write_text(yaml.safe_dump(d))
    code = main(["plan", "--model", str(tiny_llama), "--recipe", str(p), "--json"])
    err = json.loads(capsys.readouterr().out)
    assert code == 2 and "`serve.long_context.lengths[1]`" in err["message"], err
    assert "4096" in err["message"] and "512" in err["message"], err
    d["serve"]["long_context"]["lengths"] = [256, "max"]
    p.write_text(yaml.safe_dump(d))
    assert main(["plan", "--model", str(tiny_llama), "--recipe", str(p), "--json"]) == 0
    capsys.readouterr()
    d["evaluation"]["seq_len"] = 1024  # held-out windows longer than the context, the same
    p.write_text(yaml.safe_dump(d))
    code = main(["plan", "--model", str(tiny_llama), "--recipe", str(p), "--json"])
    err = json.loads(capsys.readouterr().out)
    assert code == 2 and "`evaluation.seq_len`" in err["message"] and "512" in err["message"]


def _smollm2_dims(folder: Path) -> Path:
    """A config-only Llama as wide as SmolLM2-135M (576; KV 192; MLP 1536), two layers."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=512,
                max_position_embeddings=2048, tie_word_embeddings=True).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.mark.parametrize("on_indivisible", ["error", "fallback"])
def test_w4a8_on_a_width_128_does_not_divide_names_what_can_serve(tmp_path, capsys,
                                                                  on_indivisible):  # fmt: skip
    """Issue 57 item 3: the general group-size check ran first and advised a group size
    that divides 576 (or `on_indivisible: fallback`), then the W4A8 check refused either
    with "use preset W4AFP8", the preset already used. Now both say W4A8 cannot serve the
    model and name W4A16 at group 64 and FP8_DYNAMIC; following that advice plans."""
    import yaml

    from tests.cli_run import qship

    model = _smollm2_dims(tmp_path / "smollm2-dims")
    d = yaml.safe_load((R / "w4a8-fp8.yaml").read_text())
    d["groups"][0]["scheme"]["on_indivisible"] = on_indivisible
    p = tmp_path / "w4a8.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, err = qship(capsys, "plan", "--model", str(model), "--recipe", str(p))
    assert rc == 2 and "W4A8-FP8 cannot serve this model" in err["message"], err
    assert "{preset: W4A16, group_size: 64}" in err["hint"] and "FP8_DYNAMIC" in err["hint"]
    assert "on_indivisible" not in err["hint"] and "use preset W4AFP8" not in err["hint"]
    d["groups"][0]["scheme"] = {"preset": "W4A16", "group_size": 64}  # the advice, taken
    p.write_text(yaml.safe_dump(d))
    assert qship(capsys, "plan", "--model", str(model), "--recipe", str(p))[0] == 0
    rc, _ = qship(capsys, "plan", "--model", str(model), "--recipe", str(R / "fp8-dynamic.yaml"))
    assert rc == 0
