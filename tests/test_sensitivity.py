"""qship sensitivity on the tiny trained Gemma 3: RTN rounding equals llm-compressor's,
the per-module ranking, and the int8-upgraded recipe it writes (within its bit budget,
and measurably better than its base when both are quantized and evaluated)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from cli_run import qship
from small_recipes import small_recipe

from pipeline.compare.sensitivity import rtn_weight
from pipeline.model.roles import fused_sets
from pipeline.quantize.plan import plan_for_dir
from pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("two_threads")


@pytest.fixture(scope="module")
def small_rtn(tmp_path_factory) -> Path:
    return small_recipe(tmp_path_factory.mktemp("recipes"), "rtn-w4")


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_weight_equals_llm_compressor_rounding(tiny_gemma, symmetric):
    """Same values as llm-compressor's QuantizationModifier (min-max observer) computes."""
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_gemma), dtype=torch.float32)
    orig = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("proj")}
    from pipeline.quantize.modifiers import qargs
    from pipeline.records import ModuleScheme

    scheme = ModuleScheme(bits=4, symmetric=symmetric, group_size=128)

    qm = QuantizationModifier(
        config_groups={"g": {"targets": ["Linear"], "weights": qargs(scheme)}}, ignore=["lm_head"]
    )
    oneshot(model=model, recipe=qm)
    n_checked = 0
    for name, m in model.named_modules():
        if name not in orig:
            continue
        lib = fake_quantize(
            orig[name], m.weight_scale, m.weight_zero_point, m.quantization_scheme.weights
        )
        ours = rtn_weight(orig[name], scheme)
        assert torch.equal(ours, lib), name
        assert not torch.equal(ours, orig[name]), name  # it did round
        n_checked += 1
    assert n_checked == 4 * 7


def test_sensitivity_ranks_modules_and_writes_upgraded_recipe(
    tiny_gemma, small_rtn, tmp_path, capsys
):
    out_json = tmp_path / "sens.json"
    new = tmp_path / "rtn-sens.yaml"
    base_plan = plan_for_dir(tiny_gemma, load_recipe(small_rtn))
    base_bpw = base_plan.bits_per_weight.quantized
    budget = round(base_bpw + 0.5, 3)
    rc, res = qship(
        capsys,
        "sensitivity",
        "--model", str(tiny_gemma),
        "--recipe", str(small_rtn),
        "--cache-dir", str(tmp_path / "cache"),
        "--device", "cpu",
        "--out", str(out_json),
        "--max-bits", str(budget),
        "--write-recipe", str(new),
    )  # fmt: skip
    assert rc == 0, res
    rows = res["modules"]
    assert len(rows) == 4 * 7  # every quantized Linear, lm_head (none) excluded
    kls = [r["kl_mean"] for r in rows]
    assert kls == sorted(kls, reverse=True)
    assert abs(res["baseline_kl_mean"]) < 1e-6  # the unmodified model against itself
    assert min(kls) > 0 and kls[0] > 5 * kls[-1]  # rounding one module costs; unevenly
    assert abs(sum(res["by_layer"].values()) - sum(kls)) < 1e-9
    assert out_json.is_file()

    w = res["written_recipe"]
    assert base_bpw < w["bits_per_weight"] <= budget
    up = load_recipe(new)
    plan = plan_for_dir(tiny_gemma, up)
    by = plan.by_name()
    assert sorted(w["upgraded"]) == sorted(
        n for n, m in by.items() if m.scheme and m.scheme.bits == 8
    )
    ups = set(w["upgraded"])  # what vLLM serves as one layer (q/k/v, gate/up) moves as one
    sets = fused_sets(by)
    assert all(set(s) <= ups or not set(s) & ups for s in sets)
    assert any(len(s) > 1 and set(s) <= ups for s in sets), ups
    for name, m in base_plan.by_name().items():  # everything else as in the base recipe
        if name not in w["upgraded"]:
            assert by[name].scheme == m.scheme and by[name].method == m.method, name

    # measured: the upgraded recipe beats its base on the same held-out tokens
    kl = {}
    for r in (small_rtn, new):
        rc, cmp = qship(
            capsys,
            "compare",
            "--model", str(tiny_gemma),
            "--recipes", str(r),
            "--out", str(tmp_path / f"cmp-{r.stem}"),
            "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu",
        )  # fmt: skip
        assert rc == 0, cmp
        ev = yaml.safe_load(
            (tmp_path / f"cmp-{r.stem}" / "recipes" / load_recipe(r).name / "eval.json").read_text()
        )
        kl[r.stem] = ev["metrics"]["kl"]["mean"]
    assert kl["rtn-sens"] < 0.8 * kl["rtn-w4-small"], kl


def test_write_recipe_needs_budget_and_keeps_existing_file(tiny_gemma, small_rtn, tmp_path, capsys):
    rc, err = qship(
        capsys, "sensitivity", "--model", str(tiny_gemma), "--recipe", str(small_rtn),
        "--write-recipe", str(tmp_path / "x.yaml"), "--cache-dir", str(tmp_path / "c"),
    )  # fmt: skip
    assert rc == 2 and "--max-bits" in err["message"]
    existing = tmp_path / "exists.yaml"
    existing.write_text("keep me\n")
    rc, err = qship(
        capsys, "sensitivity", "--model", str(tiny_gemma), "--recipe", str(small_rtn),
        "--write-recipe", str(existing), "--max-bits", "5", "--cache-dir", str(tmp_path / "c"),
    )  # fmt: skip
    assert rc == 2 and "exists" in err["message"]
    assert existing.read_text() == "keep me\n"


def test_upgrade_excludes_the_chosen_modules_from_their_old_group(tiny_gemma):
    from pipeline.compare.recipe_writer import upgrade_recipe

    data = {
        "name": "all-linear",
        "groups": [
            {"name": "all", "targets": [f"model.layers.0.mlp.{t}_proj" for t in ("gate", "up", "down")],
             "method": "rtn",
             "scheme": {"bits": 4, "symmetric": True, "group_size": 128}},
            {"name": "rest", "targets": [r"re:(?!model\.layers\.0\.mlp\.).*_proj$"], "method": "rtn",
             "scheme": {"bits": 4, "symmetric": True, "group_size": 128}},
            {"name": "head", "targets": ["lm_head"], "method": "none"},
        ],
        "calibration": {"num_samples": 8, "seq_len": 128},
        "evaluation": {"sequences": 8, "seq_len": 128},
    }  # fmt: skip
    base = load_recipe_from(data, tiny_gemma)
    plan = plan_for_dir(tiny_gemma, base)
    pick = [{"name": "model.layers.0.mlp.down_proj", "group": "all"}]
    out = upgrade_recipe(copy.deepcopy(data), base, plan, pick)
    assert [g["name"] for g in out["groups"]] == ["all", "all-w8g128", "rest", "head"]
    assert out["groups"][0]["targets"] == data["groups"][0]["targets"]  # claims unchanged
    assert out["groups"][0]["exclude"] == ["model.layers.0.mlp.down_proj"]
    assert out["groups"][1]["targets"] == ["model.layers.0.mlp.down_proj"]
    assert out["groups"][1]["scheme"]["bits"] == 8
    by = plan_for_dir(tiny_gemma, load_recipe_from(out, tiny_gemma)).by_name()
    assert (
        by["model.layers.0.mlp.down_proj"].group,
        by["model.layers.0.mlp.down_proj"].scheme.bits,
    ) == ("all-w8g128", 8)
    assert (
        by["model.layers.0.mlp.up_proj"].group,
        by["model.layers.0.mlp.up_proj"].scheme.bits,
    ) == ("all", 4)


def load_recipe_from(data: dict, _model: Path):
    from pipeline.recipe import Recipe

    return Recipe.model_validate(data)
