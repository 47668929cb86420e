"""Every family the README names runs the shipped default recipe end to end: a tiny
random model of its class (transformers' own classes, 2 layers, the tiny Llama's tokenizer)
through `qship run` with gemma-mixed-w4-cpu (shrunk: small_recipes.py) -- plan, AWQ + GPTQ
quantize, the post-save check against the plan, the reload check, evaluate, gate, package
-- and `qship verify` on the artifact. Random weights: the KL says nothing here; the point is
that each family's modules are planned, saved, checked and loaded back. Mixtral is refused
before compute (exit 2): transformers 5.17 cannot load back its experts (quantize/plan.py,
RELOAD_FAULTS)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from cli_run import qship
from factories import DIMS
from small_recipes import small_recipe

MODELS = Path(__file__).parent / "fixtures" / "models"
# each family's MoE fields as its real configs have them
EXTRA = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=128),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip
FAMILIES = ["gemma2", "gemma3_text", "llama", "mistral", "qwen2", "qwen3", "phi3",
            "qwen3_moe", "qwen2_moe", "olmoe"]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("families")
    return tmp, small_recipe(tmp, "gemma-mixed-w4-cpu")


def tiny_random(model_type: str, dest: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**DIMS, "vocab_size": 2048},
                               **EXTRA.get(model_type, {}))  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS / "tiny-llama" / f, dest / f)
    return dest


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_default_recipe_runs_end_to_end(model_type, work, capsys):
    tmp, recipe = work
    model = tiny_random(model_type, tmp / model_type)
    out = tmp / f"{model_type}-art"
    rc, rec = qship(capsys, "run", "--model", str(model), "--recipe", str(recipe), "--out",
                    str(out), "--device", "cpu", "--cache-dir", str(tmp / "cache"))  # fmt: skip
    assert rc == 0, rec
    plan = json.loads((tmp / f"{model_type}-art.report" / "plan.json").read_text())
    quantized = {m["role"] for m in plan["modules"] if m["scheme"]}
    assert "attention" in quantized and quantized & {"mlp", "experts"}
    ev = json.loads((out / "eval.json").read_text())
    assert math.isfinite(ev["metrics"]["kl"]["mean"]) and ev["verdict"]["passed"]
    rc, rep = qship(capsys, "verify", str(out))
    assert rc == 0 and rep["ok"], rep


def test_mixtral_is_refused_before_compute_naming_the_library_fault(work, capsys):
    tmp, recipe = work
    model = tiny_random("mixtral", tmp / "mixtral")
    rc, err = qship(capsys, "run", "--model", str(model), "--recipe", str(recipe), "--out",
                    str(tmp / "mixtral-art"), "--device", "cpu", "--cache-dir", str(tmp / "cache"))  # fmt: skip
    assert rc == 2 and "transformers 5.17 cannot load back the experts" in err["message"]
    assert "fetch" not in [s["stage"] for s in err["result"]["stages"]]  # before anything
    assert not (tmp / "mixtral-art").exists()
