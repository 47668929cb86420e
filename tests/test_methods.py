"""The issue-17 levers as recipe methods, on the tiny trained Llama (CPU, 16 x 128 tokens):
AutoRound (`method: autoround`) and AWQ's scales under GPTQ rounding (`awq_scales`) quantize
as planned, reload, and round better than RTN at the same scheme; what llm-compressor 0.14
cannot do is refused before any compute (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import mean_kl as _mean_kl
from transformers import AutoTokenizer

from pipeline.data.tokens import build_token_sets
from pipeline.quantize import quantize
from pipeline.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("two_threads")


def _variant(name: str, method: str, options: dict | None = None, **scheme) -> Recipe:
    d = load_recipe(ROOT / "recipes" / "gptq-w4.yaml").model_dump(mode="json")
    d.update(name=name, kv_cache=None)
    d["calibration"].update(num_samples=16, seq_len=128, batch_size=16)
    d["evaluation"].update(sequences=8, seq_len=128, tasks=[])
    g = d["groups"][0]
    g.update(method=method, options=options or {})
    g["scheme"].update({"symmetric": False, **scheme})
    return Recipe.model_validate(d)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama):
    work = tmp_path_factory.mktemp("methods")
    done: dict = {}

    def get(r: Recipe):
        if r.name not in done:
            tok = AutoTokenizer.from_pretrained(tiny_llama)
            ts = build_token_sets(tok, r.calibration, r.evaluation, cache_dir=work / "cache")
            q = quantize(tiny_llama, r, work / r.name, tokens=ts, device="cpu")
            done[r.name] = (q, _mean_kl(tiny_llama, q.path, ts.heldout_ids))
        return done[r.name]

    return get


def test_autoround_and_awq_scales_beat_rtn(run):
    """What each method reliably delivers over RTN at the same scheme, on 2 threads.
    Measured (KL ratio to RTN, tiny Llama, 16 x 128 calibration tokens, 2-core dev box):
    AutoRound 50 steps 0.63, AWQ's scales under GPTQ 0.69 (0.69-0.70 on every seed). Until
    auto-round's zero points were stored (autoround_modifier.py) AutoRound gave 0.81-0.91: its
    asymmetric grid was read with zero point 0 and clamped, which the old bound of 0.95 let
    pass. The bounds sit ~12 and ~16 points above what was measured (the floating-point path
    moved AutoRound's ratio by 5 points between machines)."""
    q_rtn, kl_rtn = run(_variant("rtn-a", "rtn"))
    q_ar, kl_ar = run(_variant("autoround-a", "autoround", {"iters": 50}))
    q_awq, kl_awq = run(_variant("gptq-awq-a", "gptq", {"awq_scales": True}))
    for q, method in ((q_ar, "autoround"), (q_awq, "gptq")):
        # quantize's own check held the saved config to the plan; the plan says the method
        assert {m.method for m in q.plan.modules if m.scheme} == {method}
        assert {m.scheme for m in q.plan.modules if m.scheme} == {
            m.scheme for m in q_rtn.plan.modules if m.scheme
        }
    # AWQ's mappings are planned for the GPTQ group that asked for the scales
    assert any(mp.applied for mp in q_awq.plan.mappings)
    assert not q_rtn.plan.mappings
    print(f"\nKL rtn {kl_rtn:.5f}  autoround {kl_ar:.5f}  awq+gptq {kl_awq:.5f}")
    assert kl_ar < 0.75 * kl_rtn and kl_awq < 0.85 * kl_rtn


def test_autoround_tunes_each_module_at_its_own_scheme(tiny_llama, tmp_path):
    """An AutoRound recipe with an int8 module and a g64 one, and a GPTQ g64 module in the
    same decoder layer: each is stored at the scheme its group asked for. (llm-compressor
    0.14's AutoRound alone tuned the int8 module at int4 -- 17 levels stored in 8 bits --
    and failed on the g64 ones; quantize/modifiers.py mends it.)"""
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32
    from safetensors.torch import load_file

    d = _variant("ar-mixed", "autoround", {"iters": 5}).model_dump(mode="json")
    base = d["groups"][0]
    moved = {"layers.0.mlp.down_proj": ("autoround", 8, 128),
             "layers.1.mlp.down_proj": ("autoround", 4, 64),
             "layers.0.self_attn.o_proj": ("gptq", 4, 64)}  # fmt: skip
    for i, (name, (method, bits, gs)) in enumerate(moved.items()):
        rx = f"re:.*{name.replace('.', chr(92) + '.')}$"
        base.setdefault("exclude", []).append(rx)
        d["groups"].insert(1, {**base, "name": f"m{i}", "roles": [], "targets": [rx], "exclude": [],
                               "method": method, "options": {} if method == "gptq" else base["options"],
                               "scheme": {**base["scheme"], "bits": bits, "group_size": gs}})  # fmt: skip
    r = Recipe.model_validate(d)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ts = build_token_sets(tok, r.calibration, r.evaluation, cache_dir=tmp_path / "cache")
    q = quantize(tiny_llama, r, tmp_path / "q", tokens=ts, device="cpu")
    planned = {
        m.name: (m.method, m.scheme.bits, m.scheme.group_size) for m in q.plan.modules if m.scheme
    }
    sd = load_file(str(q.path / "model.safetensors"))
    for name, want in [*moved.items(), ("layers.1.mlp.up_proj", ("autoround", 4, 128))]:
        n = f"model.{name}"
        assert planned[n] == want
        shape = torch.Size(sd[f"{n}.weight_shape"].tolist())
        assert sd[f"{n}.weight_scale"].shape == (shape[0], shape[1] // want[2])
        levels = unpack_from_int32(sd[f"{n}.weight_packed"], want[1], shape)[0].unique().numel()
        assert (levels > 16) == (want[1] == 8), (name, levels)


@pytest.mark.parametrize(
    "method,options,scheme,msg",
    [
        ("autoround", {}, {"symmetric": True}, "negative scales"),
        ("gptq", {"actorder": "group"}, {}, "actorder 'group'"),
        ("autoround", {"awq_scales": True}, {}, "do not apply"),
        ("awq", {"iters": 10}, {}, "do not apply"),
    ],
)
def test_what_the_library_cannot_do_is_refused(method, options, scheme, msg):
    with pytest.raises(Exception, match=msg):
        _variant("bad", method, options, **scheme)


def test_autoround_keeps_tied_embeddings_tied(tiny_gemma, tmp_path):
    """llm-compressor 0.14's AutoRound unties the word embeddings whenever its default
    targets include the head, though qship's groups leave it 16-bit: the checkpoint stored
    the embedding twice (+62 % here, 723 vs 388 MB on Gemma 3 270M). The mended modifier
    keeps the tie, and the post-save check refuses a checkpoint larger than its plan. With
    an FP8 KV cache (as recipes/autoround-w4a.yaml ships) the KV scheme's own modifier untied
    it too: its default config group targets every Linear (the tuned Gemma recipe was
    refused at 724 MB for 389 planned, H100 2026-12-06). In this configuration auto-round's
    zero points were lost too (every packed word 0x88888888: zero point 0 in each group)."""
    import json

    from safetensors import safe_open

    d = _variant("ar-tied", "autoround", {"iters": 2}).model_dump(mode="json")
    d["kv_cache"] = {"scheme": "fp8_e4m3", "strategy": "tensor", "dynamic": False}
    r = Recipe.model_validate(d)
    tok = AutoTokenizer.from_pretrained(tiny_gemma)
    ts = build_token_sets(tok, r.calibration, r.evaluation, cache_dir=tmp_path / "cache")
    q = quantize(tiny_gemma, r, tmp_path / "q", tokens=ts, device="cpu")
    with safe_open(str(q.path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        zps = [f.get_tensor(k).flatten() for k in f.keys() if k.endswith("weight_zero_point")]
    assert zps and len(set(torch.cat(zps).tolist())) > 1  # asymmetric groups' own zero points
    assert json.loads((q.path / "config.json").read_text())["tie_word_embeddings"] is True
    assert q.checkpoint.bytes < 1.05 * q.checkpoint.expected_bytes
    config = json.loads((q.path / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]
