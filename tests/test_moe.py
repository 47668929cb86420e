"""Mixture-of-Experts end to end on the tiny trained Qwen3-MoE: experts linearized and
quantized, every expert calibrated on every token, token counts recorded, a starved expert
fails the run instead of being written with scales from no data, the router kept 16-bit."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from pipeline.data.tokens import build_token_sets
from pipeline.errors import IntegrityError, StageError
from pipeline.evaluate import evaluate, model_ref
from pipeline.model.checkpoint import inspect_checkpoint
from pipeline.quantize import quantize
from pipeline.recipe import parse_recipe
from pipeline.records.evaluation import EvalOptions

ROOT = Path(__file__).resolve().parent.parent
N, L = 8, 64  # calibration windows x tokens


pytestmark = pytest.mark.usefixtures("two_threads")


def recipe(all_experts: bool = True):
    d = yaml.safe_load((ROOT / "recipes" / "gptq-w4.yaml").read_text())  # roles: ..., experts
    d["calibration"].update(num_samples=N, seq_len=L, batch_size=N, all_experts=all_experts)
    d["evaluation"].update(sequences=4, seq_len=L, tasks=[], hub_tasks=[])
    return parse_recipe(d, path="gptq-w4 (small)")


@pytest.fixture(scope="module")
def tokens(tiny_moe, tmp_path_factory):
    r = recipe()
    return build_token_sets(AutoTokenizer.from_pretrained(tiny_moe), r.calibration, r.evaluation,
                            cache_dir=tmp_path_factory.mktemp("cache"))  # fmt: skip


@pytest.fixture(scope="module")
def quantized(tiny_moe, tokens, tmp_path_factory):
    return quantize(tiny_moe, recipe(), tmp_path_factory.mktemp("q") / "moe", tokens=tokens,
                    device="cpu")  # fmt: skip


def test_every_expert_is_quantized_and_calibrated_on_every_token(quantized):
    plan = quantized.plan
    experts = [m for m in plan.modules if m.role == "experts"]
    assert len(experts) == 2 * 8 * 3 and all(m.scheme and m.method == "gptq" for m in experts)
    assert plan.roles["router"] == 2 and "mlp.gate" not in {m.name for m in plan.modules}
    counts = quantized.expert_tokens
    assert len(counts) == 16 and set(counts.values()) == {N * L}  # each saw every token once
    assert set(quantized.gptq) >= {m.name for m in experts}  # GPTQ had data for all of them
    # saved per expert (the layout vLLM reads); the router stays a dense 16-bit tensor
    from safetensors import safe_open

    with safe_open(str(quantized.path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.7.down_proj.weight_packed" in keys
    assert "model.layers.1.mlp.gate.weight_packed" not in keys


def test_quantized_moe_reloads_and_stays_close(tiny_moe, quantized, tokens, tmp_path):
    """transformers re-fuses the per-expert tensors on load; KL to the reference is small."""
    rep = evaluate(model_ref(tiny_moe), model_ref(quantized.path), heldout_ids=tokens.heldout_ids,
                   cache_dir=tmp_path, options=EvalOptions(device="cpu", exact=True))  # fmt: skip
    assert 0 < rep.metrics.kl.mean < 0.5 and rep.metrics.top1_agreement > 0.7
    print(
        f"\ntiny MoE gptq-w4: KL {rep.metrics.kl.mean:.4f}, top-1 {rep.metrics.top1_agreement:.3f}"
    )


def test_routed_calibration_starves_experts_and_fails_closed(tiny_moe, tokens, tmp_path):
    """Without all-expert calibration the skewed router gives experts 6 and 7 of layer 1 no
    token: the run exits 1 naming them, and nothing is written."""
    out = tmp_path / "starved"
    with pytest.raises(StageError) as e:
        quantize(tiny_moe, recipe(all_experts=False), out, tokens=tokens, device="cpu")
    assert e.value.exit_code == 1
    assert "model.layers.1.mlp.experts.6 (0)" in e.value.message
    assert "model.layers.1.mlp.experts.7 (0)" in e.value.message
    assert "all_experts" in e.value.hint
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_post_save_check_proves_expert_scales_finite_and_nonzero(quantized, tmp_path):
    art = tmp_path / "moe"
    shutil.copytree(quantized.path, art)
    inspect_checkpoint(art)  # the saved checkpoint holds
    name = "model.layers.0.mlp.experts.5.up_proj.weight_scale"
    data = bytearray((art / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    t = json.loads(data[8 : 8 + n])[name]
    begin = 8 + n + t["data_offsets"][0]
    data[begin : begin + 2] = b"\x00\x00"  # one bf16 scale -> 0.0
    (art / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as e:
        inspect_checkpoint(art)
    assert name in e.value.message and "not finite and positive" in e.value.message


def test_reading_experts_per_expert_writes_the_same_checkpoint(tiny_moe, tokens, quantized,
                                                                tmp_path, monkeypatch):  # fmt: skip
    """The direct per-expert load (model/moe.py) is a memory fix only: quantizing after the
    old fuse-then-split load writes the same checkpoint, byte for byte (model hash)."""
    import contextlib

    from pipeline.model import loading

    monkeypatch.setattr(loading, "_experts", lambda path, linear: contextlib.nullcontext())
    old = quantize(tiny_moe, recipe(), tmp_path / "old", tokens=tokens, device="cpu")
    assert old.model_hash == quantized.model_hash


def test_offloaded_reload_check_decompresses_one_expert_at_a_time(quantized, tokens,
                                                                  monkeypatch):  # fmt: skip
    """With offloading the reload check reads the experts as Linear modules (checks.py), so
    each is decompressed when the forward reaches it and dropped after: transformers' fused
    experts are decompressed whole on load (1.74x the weights in host memory on 16
    Qwen3-30B-A3B-dims layers). The logits are those of the dense reload."""
    from compressed_tensors.offload import disable_onloading

    from pipeline.model import loading
    from pipeline.model.loading import load_model
    from pipeline.model.moe import reads_per_expert
    from pipeline.quantize import checks

    ids = tokens.heldout_ids[:1].long()
    with torch.no_grad():
        dense = load_model(quantized.path, device="cpu")(input_ids=ids).logits
    assert reads_per_expert(quantized.path)
    monkeypatch.setattr(loading, "_distributed", lambda: True)  # the offloaded load, on the CPU
    loaded = []
    real = checks.load_model
    monkeypatch.setattr(checks, "load_model", lambda *a, **k: loaded.append(real(*a, **k))
                        or loaded[-1])  # fmt: skip
    assert checks.verify_reload(quantized.path, ids, "cpu", offload="cpu") == ids.numel()
    linear = [mod for mod in loaded[0].model.layers[1].mlp.experts.modules()
              if isinstance(mod, torch.nn.Linear)]  # fmt: skip
    with disable_onloading():  # every expert ran once and was dropped: nothing left dense
        assert len(linear) == 8 * 3 and all(p.device.type == "meta" for mod in linear
                                            for p in mod.parameters())  # fmt: skip
    m = real(quantized.path, device="cpu", offload="cpu", pin=False, linear_experts=True)
    with disable_onloading():  # packed until the forward reaches them
        assert any(
            "weight_packed" in n for n, _ in m.model.layers[1].mlp.experts.named_parameters()
        )
    with torch.no_grad(), checks.decompressed_per_module(m):
        logits = m(input_ids=ids).logits
    # within bf16 rounding (the dense reload computes in float32): 0.024 at most here, the
    # fused experts' offloaded reload 0.048, on logits of mean magnitude 2.2
    torch.testing.assert_close(logits, dense, atol=0.03, rtol=0.01)


@pytest.mark.parametrize(("model", "imports"), [("tiny_llama", False), ("tiny_moe", True)])
def test_only_a_model_with_fused_experts_plans_through_llmcompressor(
    request, repo_root, model, imports
):
    """The meta model's experts are linearized with llm-compressor's registry, whose import
    was 1.5 s of every recipe stage on 2 cores; a model without a 3-D parameter has no fused
    experts and plans without it (a fresh process: nothing imported before)."""
    import subprocess
    import sys

    code = ("import sys; from pipeline.model.loading import load_meta_model; "
            "m = load_meta_model(sys.argv[1]); print('llmcompressor' in sys.modules, "
            "sum(type(x).__name__ == 'Linear' for x in m.modules()))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(request.getfixturevalue(model))],
                         cwd=repo_root, capture_output=True, text=True, check=True)  # fmt: skip
    imported, linears = out.stdout.splitlines()[-1].split()  # after llm-compressor's log
    assert imported == str(imports)
    assert int(linears) == {"tiny_llama": 29, "tiny_moe": 57}[model]  # experts as Linears
