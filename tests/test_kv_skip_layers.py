"""16-bit KV cache on chosen layers (recipe `kv_cache.skip_layers`, vLLM's
--kv-cache-dtype-skip-layers): those layers' K, V and query stay unrounded in evaluate, the
served check and the benchmarks, the list travels in the checkpoint's quantize record and
the artifact's recipe, vLLM is handed the flag (it does not read it from the checkpoint),
and an index the model does not have exits 2 naming the field."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import PACKAGE_RECIPE  # noqa: E402
from transformers import AutoConfig, AutoTokenizer

from pipeline.data.tokens import build_token_sets
from pipeline.errors import RecipeError
from pipeline.evaluate import engines
from pipeline.evaluate.engine import evaluate, model_ref
from pipeline.evaluate.perf import _skip_args
from pipeline.evaluate.vllm_child import llm_kwargs
from pipeline.quantize import plan_for_config, quantize
from pipeline.recipe import parse_recipe
from pipeline.records.checkpoint import kv_skip_layers
from pipeline.records.evaluation import EvalOptions

# the package fixture's RTN recipe with an FP8 KV cache (per tensor), layer 1 kept 16-bit
RECIPE_D = {**yaml.safe_load(PACKAGE_RECIPE), "name": "tiny-kv-skip",
            "kv_cache": {"skip_layers": [1]},
            "calibration": {"num_samples": 8, "seq_len": 64, "batch_size": 8}}  # fmt: skip
RECIPE_D["groups"][0]["scheme"]["group_size"] = 32


def recipe(**kv) -> object:
    return parse_recipe({**RECIPE_D, "kv_cache": kv}, path="RECIPE")


@pytest.fixture(scope="module")
def skipped(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("kvskip")
    r = parse_recipe(RECIPE_D, path="RECIPE")
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=work / "c")  # fmt: skip
    qc = quantize(tiny_llama, r, work / "q", tokens=tokens, device="cpu")
    return qc, tokens.heldout_ids, work


def _eval(tiny_llama, qc, ids, work, skip):
    return evaluate(model_ref(tiny_llama), model_ref(qc.path), heldout_ids=ids,
                    cache_dir=work / "cache", options=EvalOptions(device="cpu", exact=True,
                    kv_skip_layers=skip))  # fmt: skip


def test_the_record_carries_the_layers_and_evaluate_reads_them(skipped, tiny_llama):
    qc, ids, work = skipped
    assert kv_skip_layers(qc.path) == (1,)
    assert "16-bit on layers 1 (vLLM --kv-cache-dtype-skip-layers)" in qc.plan.summary()
    rep = _eval(tiny_llama, qc, ids, work, None)  # None: what the checkpoint says
    assert rep.settings.kv_16bit_layers == [1]
    assert rep.candidate.kv_hooked_attention_modules == 3  # of 4 layers


def test_skipping_every_layer_is_the_weights_only_figure(skipped, tiny_llama):
    qc, ids, work = skipped
    every = _eval(tiny_llama, qc, ids, work, (0, 1, 2, 3))
    none = _eval(tiny_llama, qc, ids, work, ())
    one = _eval(tiny_llama, qc, ids, work, (1,))
    # no layer rounds its KV: the "KV on" pass is the weights-only pass, to the bit
    assert every.metrics.kl.mean == none.metrics_weights_only.kl.mean
    assert every.candidate.kv_hooked_attention_modules == 0
    assert none.metrics.kl.mean != none.metrics_weights_only.kl.mean
    assert one.metrics.kl.mean not in (none.metrics.kl.mean, every.metrics.kl.mean)


def test_a_layer_the_model_lacks_exits_2_naming_the_field(tiny_llama):
    cfg = AutoConfig.from_pretrained(tiny_llama)
    with pytest.raises(RecipeError, match=r"kv_cache.skip_layers lists layer 4.*4 decoder layers"):
        plan_for_config(cfg, recipe(skip_layers=[0, 4]))
    for bad, why in (([-1], "start at 0"), ([2, 2], "listed twice")):
        with pytest.raises(RecipeError, match=f"field `kv_cache.skip_layers`: .*{why}"):
            recipe(skip_layers=bad)
    assert recipe(skip_layers=[3, 0]).kv_cache.skip_layers == [0, 3]


def test_engines_serve_those_layers_16bit(skipped, tmp_path, monkeypatch):
    qc, _, _ = skipped
    # vLLM: the flag in the child's arguments, the cache sized as if every layer were 16-bit
    monkeypatch.setattr(engines, "unavailable", lambda name: None)
    eng = engines.make("vllm", qc.path, kv_cache_dtype="auto")
    assert eng.args["kv_cache_dtype_skip_layers"] == ["1"]
    assert eng.facts["kv_cache_dtype_skip_layers"] == "1"
    kw = llm_kwargs({**eng.args, "kv_cache_memory_bytes": 1 << 30}, 65, 80 << 30)
    assert kw["kv_cache_dtype_skip_layers"] == ["1"]
    # transformers: that layer's hook off for good, the KV switch leaves it alone
    t = engines.make("transformers", qc.path, kv_cache_dtype="auto", device="cpu")
    assert len(t.hooked) == 3
    # vllm serve (the speed bench) gets the flag; an artifact's recipe.yaml says it too
    assert _skip_args(qc.path) == ["--kv-cache-dtype-skip-layers", "1"]
    (tmp_path / "recipe.yaml").write_text(recipe(skip_layers=[0, 2]).to_yaml())
    assert kv_skip_layers(tmp_path) == ()  # a bare folder's recipe.yaml: llm-compressor's
    (tmp_path / "provenance.json").write_text("{}")  # an artifact's: qship's
    assert kv_skip_layers(tmp_path) == (0, 2) and _skip_args(tmp_path)[1:] == ["0", "2"]


def test_the_model_card_says_how_to_serve_them():
    from pipeline.artifact.model_card import _vllm_use
    from pipeline.recipe import KVCache

    text = "\n".join(_vllm_use(KVCache(strategy="attn_head", query=True, skip_layers=[0, 23])))
    assert "--kv-cache-dtype-skip-layers 0 23" in text
    assert "kv_cache_dtype_skip_layers=['0', '23']" in text
    assert "(per KV head)" in text and "(its calibrated scale)" in text
    plain = "\n".join(_vllm_use(KVCache()))
    assert "skip" not in plain and "(per tensor)" in plain and "(scale 1.0)" in plain


def test_a_served_check_without_the_skip_differs(skipped, tiny_llama):
    """The measured log-probs hold the skip: an engine serving every layer FP8 is not what
    was measured (the served check would catch a deployment without the flag)."""
    from pipeline.evaluate.scoring import forward_logits, kv_quantization

    qc, ids, _ = skipped
    with_skip = engines.make("transformers", qc.path, device="cpu")
    without = engines.make("transformers", qc.path, device="cpu", kv_skip_layers=())
    with kv_quantization(with_skip.model, True), kv_quantization(without.model, True):
        a, _ = forward_logits(with_skip.model, ids[:1])
        b, _ = forward_logits(without.model, ids[:1])
    assert not torch.equal(a, b)
    assert json.loads(json.dumps(with_skip.facts))  # facts stay plain strings
