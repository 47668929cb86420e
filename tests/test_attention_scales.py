"""Calibrated attention (recipe `kv_cache: {strategy: attn_head, query: true}`): per-KV-head K/V
scales and a calibrated query scale through llm-compressor's attention quantization, stored
as vLLM 0.26 loads them, and the query rounded in evaluate as vLLM rounds it."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import yaml
from conftest import PACKAGE_RECIPE  # noqa: E402
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from pipeline.data.tokens import build_token_sets
from pipeline.errors import IntegrityError, RecipeError, StageError
from pipeline.evaluate.numerics import FP8_MAX, _q_scale, fp8_round
from pipeline.evaluate.scoring import quantizes_activations
from pipeline.model.checkpoint import inspect_checkpoint
from pipeline.quantize import plan_for_config, quantize
from pipeline.recipe import parse_recipe

# the package fixture's RTN recipe with calibrated attention: per-KV-head K/V and the query
RECIPE_D = {**yaml.safe_load(PACKAGE_RECIPE), "name": "tiny-attention",
            "kv_cache": {"strategy": "attn_head", "query": True},
            "calibration": {"num_samples": 8, "seq_len": 64, "batch_size": 8}}  # fmt: skip
RECIPE_D["groups"][0]["scheme"]["group_size"] = 32
RECIPE = yaml.safe_dump(RECIPE_D)


@pytest.fixture(scope="module")
def calibrated(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("attention")
    r = parse_recipe(yaml.safe_load(RECIPE), path="RECIPE")
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=work / "c")  # fmt: skip
    qc = quantize(tiny_llama, r, work / "q", tokens=tokens, device="cpu")
    return qc, tokens, work


def test_query_and_per_head_kv_scales_are_calibrated_and_stored_for_vllm(calibrated, tiny_llama):
    qc, tokens, _ = calibrated
    cfg = json.loads((qc.path / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["kv_cache_scheme"]["strategy"] == "attn_head"
    # one config group with the attention class as its only target: vLLM 0.26 skips it and
    # reads q/k/v scales through its KV-cache method
    attn = [g for g in q["config_groups"].values() if g["targets"] == ["LlamaAttention"]]
    assert len(attn) == 1 and attn[0]["input_activations"]["strategy"] == "attn_head"
    # a rounded query, not rounded Linear inputs (the served check's rounding floor reaches
    # this checkpoint through its FP8 KV scheme: served.rounds_at_run_time)
    assert quantizes_activations(qc.path) and not quantizes_activations(qc.path, query=False)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sd = load_file(str(qc.path / "model.safetensors"))
    a = "model.layers.0.self_attn"  # its input is the embeddings: no upstream rounding
    assert sd[f"{a}.q_scale"].shape == (heads, 1, 1)
    assert sd[f"{a}.k_scale"].shape == sd[f"{a}.v_scale"].shape == (kv_heads, 1, 1)
    # the query scale is what the query reached on the calibration text: amax / 448 per
    # head of the 16-bit model's query as its attention function receives it (after RoPE;
    # llm-compressor observes activations before it rounds the weights)
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    from pipeline.compat.transformers_5 import attention_function, attn_implementation

    src = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    impl = attn_implementation(src)
    inner, seen = registry[impl], {}

    def grab(module, query, *args, **kwargs):
        if module is src.model.layers[0].self_attn:
            seen["amax"] = query.abs().amax(dim=(0, 2, 3))
        return inner(module, query, *args, **kwargs)

    with attention_function(impl, grab), torch.no_grad():
        src(input_ids=tokens.calib_ids)
    want = seen["amax"] / FP8_MAX
    got = sd[f"{a}.q_scale"].float().flatten()
    assert torch.allclose(got, want, rtol=0.01), (got, want)  # stored in bf16


def test_evaluate_rounds_the_query_as_vllm_does():
    """vLLM reduces per-query-head scales to one per KV head (the max over its group) and
    quantizes the query with that: the reference below, written out by hand."""
    mod = torch.nn.Module()
    mod.config = AutoConfig.for_model("llama", num_attention_heads=8, num_key_value_heads=2)
    mod.q_scale = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.2, 0.1, 0.4, 0.3]).view(8, 1, 1)
    s = _q_scale(mod)
    assert s.shape == (1, 8, 1, 1)
    assert torch.equal(s.flatten(), torch.tensor([3.0] * 4 + [0.4] * 4))
    q = torch.randn(2, 8, 5, 16) * 3
    want = torch.stack([
        (q[:, h] / g).clamp(-448, 448).to(torch.float8_e4m3fn).float() * g
        for h, g in enumerate(torch.tensor([3.0] * 4 + [0.4] * 4))], dim=1)  # fmt: skip
    assert torch.equal(fp8_round(q, s), want)
    mod.q_scale = torch.tensor([0.25])
    assert _q_scale(mod) == 0.25
    del mod.q_scale
    assert _q_scale(mod) == 1.0  # no calibrated scale: vLLM's 1.0


def test_evaluate_runs_the_attention_the_hook_wraps(calibrated, monkeypatch):
    """A checkpoint with a calibrated query loads with compressed-tensors' hooked attention;
    evaluate's served attention runs, for each layer, qship's query rounding and then the
    function that hook wraps (not the hook, which would round the query again), and is
    undone after."""
    from compressed_tensors.modeling.attention import HOOKED_ATTENTION_NAME
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    from pipeline.compat.compressed_tensors_0_19 import hooked_attention_inner
    from pipeline.compat.transformers_5 import attn_implementation
    from pipeline.evaluate import numerics
    from pipeline.evaluate.scoring import forward_logits, kv_modules, kv_quantization
    from pipeline.model.loading import load_model

    qc, tokens, _ = calibrated
    model = load_model(qc.path, device="cpu")
    impl = attn_implementation(model)
    inner = hooked_attention_inner(impl)
    assert impl == HOOKED_ATTENTION_NAME and inner != impl
    assert inner == "eager" or inner in registry
    rounded: list[int] = []
    real = numerics.fp8_round
    monkeypatch.setattr(numerics, "fp8_round", lambda x, s=1.0: rounded.append(1) or real(x, s))
    hooked, ids = kv_modules(model), tokens.heldout_ids[:2, :32]
    with kv_quantization(model, True):
        before, _ = forward_logits(model, ids)
        assert not rounded  # the hook rounds the query itself
        with numerics.served_attention(model, "vllm", hooked) as wrapped:
            served, _ = forward_logits(model, ids)
        assert wrapped and len(rounded) == len(hooked)
        after, _ = forward_logits(model, ids)
    # tiny-llama has one KV head per query head: vLLM's per-KV-head query scale is the
    # hook's per-head one, so the query rounded once by either gives the same logits
    assert torch.equal(before, served) and torch.equal(before, after)
    assert len(rounded) == len(hooked)  # undone: the last pass did not call it


def test_an_uncalibrated_attention_scale_is_refused(calibrated, tmp_path):
    """A query scale left as allocated memory (what llm-compressor 0.14 saves when its eager
    switch bypasses the query hook: 1e-43 .. 8e21) is positive and finite, and still wrong."""
    import shutil

    qc, _, _ = calibrated
    bad = tmp_path / "bad"
    shutil.copytree(qc.path, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.0.self_attn.q_scale"] = torch.full_like(
        sd["model.layers.0.self_attn.q_scale"], 1e-30
    )
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(IntegrityError, match="q_scale: scale .* no calibrated FP8 attention scale"):
        inspect_checkpoint(bad)
    inspect_checkpoint(qc.path)  # the calibrated one passes


def test_attn_head_needs_query_heads_grouped_over_kv_heads():
    from transformers import LlamaConfig

    r = parse_recipe(yaml.safe_load(RECIPE), path="RECIPE")
    cfg = LlamaConfig(hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=4, vocab_size=128)  # fmt: skip
    with pytest.raises(RecipeError, match="kv_cache.strategy attn_head") as e:
        plan_for_config(cfg, r)
    assert e.value.exit_code == 2 and "tensor" in e.value.hint
    ok = LlamaConfig(hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=6, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    plan = plan_for_config(ok, r)
    assert plan.attention_class == "LlamaAttention" and "per KV head" in plan.summary()


def test_the_patch_is_what_calibrates_the_query(tiny_llama, tmp_path, monkeypatch):
    """Without qship's patch (compat hooked_attention_stays_hooked) llm-compressor 0.14
    never calls the query hook; with it, it does -- counted on the library's own hook."""
    import llmcompressor.modifiers.quantization.quantization.mixin as mixin

    from pipeline.quantize import engine

    calls = {"n": 0}
    original = mixin.calibrate_query_hook

    def counting(module, query):
        calls["n"] += 1
        return original(module, query)

    monkeypatch.setattr(mixin, "calibrate_query_hook", counting)
    r = parse_recipe(yaml.safe_load(RECIPE), path="RECIPE")
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=tmp_path / "c")  # fmt: skip
    quantize(tiny_llama, r, tmp_path / "with", tokens=tokens, device="cpu")
    assert calls["n"] > 0
    calls["n"] = 0
    monkeypatch.setattr(engine, "hooked_attention_stays_hooked", contextlib.nullcontext)
    # the unobserved q_scale is whatever memory held; the checks refuse it unless that
    # happens to look like a scale, so the outcome is not asserted, only the missing calls
    with contextlib.suppress(IntegrityError, StageError):
        quantize(tiny_llama, r, tmp_path / "without", tokens=tokens, device="cpu")
    assert calls["n"] == 0


@pytest.mark.parametrize("group", ["attention", "attention_query"])
def test_a_recipe_group_named_like_the_query_group_keeps_its_scheme(tiny_llama, tmp_path, group):
    """The query's config group must not take the place of a recipe group of the same name
    (rtn-w4's attention group was replaced: its q_proj saved unquantized)."""
    d = yaml.safe_load(RECIPE)
    d["groups"][0]["name"] = group
    r = parse_recipe(d, path="RECIPE")
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=tmp_path / "c")  # fmt: skip
    qc = quantize(tiny_llama, r, tmp_path / "q", tokens=tokens, device="cpu")  # checks pass
    groups = json.loads((qc.path / "config.json").read_text())["quantization_config"][
        "config_groups"
    ]
    assert sum(g["targets"] == ["LlamaAttention"] for g in groups.values()) == 1
    assert sum(bool(g.get("weights")) for g in groups.values()) == 1
