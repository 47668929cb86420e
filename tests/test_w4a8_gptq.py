"""GPTQ rounding W4A8 weights to what vLLM's CUTLASS W4A8 kernel serves
(quantize/w4a8_gptq.py): on the tiny trained Llama, the same recipe quantized with and
without it stores the same format and scales, and with it each layer's output, computed
with the weights as served, is nearer the unquantized layer's on held-out text."""

from __future__ import annotations

import contextlib

import pytest
import torch
from small_recipes import small_recipe, stored_format

from pipeline.model.loading import load_model
from pipeline.model.w4a8 import (
    INT4,
    int4_levels,
    nearest_served,
    served_values,
    w4a8_scales,
    w4a8_weight,
)


def test_nearest_served_is_the_nearest_of_the_sixteen_served_weights():
    torch.manual_seed(3)
    scales = torch.rand(32, 4) * 0.02 + 1e-4
    s8, chan8 = w4a8_scales(scales)
    w = torch.randn(32, 4) * scales * 5  # inside and beyond the int4 range
    q, served = nearest_served(w, scales, chan8 / 8.0)
    table = served_values(INT4, s8.unsqueeze(-1), chan8.unsqueeze(-1))  # [32, 4, 16]
    want = table.gather(-1, (w.unsqueeze(-1) - table).abs().argmin(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(served, want)
    assert torch.equal(served, served_values(q, s8, chan8))  # q is the value that serves it
    uniform = torch.round(w / scales).clamp(-8, 7)
    assert (q != uniform).any()  # the served grid is not the uniform one


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_llama):
    """tiny-llama under the shipped W4A8 recipe (shrunk), with qship's served rounding and
    with llm-compressor's own: {True: record, False: record}."""
    from transformers import AutoTokenizer

    import pipeline.quantize.engine as engine
    from pipeline.data.tokens import build_token_sets
    from pipeline.quantize import quantize
    from pipeline.recipe import load_recipe

    work = tmp_path_factory.mktemp("w4a8gptq")
    r = load_recipe(small_recipe(work, "w4a8-fp8", samples=16))
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=work / "cache")  # fmt: skip
    out = {True: quantize(tiny_llama, r, work / "served", tokens=tokens, device="cpu")}
    mp = pytest.MonkeyPatch()
    mp.setattr(engine, "gptq_rounds_to_served_w4a8", lambda: contextlib.nullcontext([0]))
    try:
        out[False] = quantize(tiny_llama, r, work / "plain", tokens=tokens, device="cpu")
    finally:
        mp.undo()
    return out, tokens


def test_the_format_and_scales_are_the_same_the_rounding_is_not(both):
    from safetensors import safe_open

    rec, _ = both
    assert rec[True].served_rounding_modules == rec[True].checkpoint.quantized_modules == 28
    assert rec[False].served_rounding_modules == 0

    assert stored_format(rec[True].path) == stored_format(rec[False].path)
    key = "model.layers.0.mlp.down_proj."
    with safe_open(str(rec[True].path / "model.safetensors"), "pt") as a, \
         safe_open(str(rec[False].path / "model.safetensors"), "pt") as b:  # fmt: skip
        assert torch.equal(a.get_tensor(key + "weight_scale"), b.get_tensor(key + "weight_scale"))
        assert not torch.equal(
            a.get_tensor(key + "weight_packed"), b.get_tensor(key + "weight_packed")
        )


def test_served_rounding_brings_each_layers_served_output_nearer(both, tiny_llama):
    """Held-out text through the unquantized model; for every quantized Linear, the squared
    error of its output with the weights as the kernel serves them, both checkpoints."""
    rec, tokens = both
    ref = load_model(tiny_llama, device="cpu")
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0]))
             for n, m in ref.named_modules()
             if isinstance(m, torch.nn.Linear) and "layers." in n]  # fmt: skip
    with torch.no_grad():
        ref(tokens.heldout_ids[:8])
    for h in hooks:
        h.remove()

    def served_errors(path) -> dict[str, float]:
        m = load_model(path, device="cpu")
        errs = {}
        for name, x in inputs.items():
            lin = m.get_submodule(name)
            w, s = lin.weight.detach().float(), lin.weight_scale.detach().float()
            q = int4_levels(w, s)
            assert torch.equal(q.reshape(w.shape) * s.repeat_interleave(128, 1), w)  # q * s
            served = w4a8_weight(q, s).reshape(w.shape)
            w0 = ref.get_submodule(name).weight.detach().float()
            x = torch.cat(x).reshape(-1, w.shape[1]).float()
            errs[name] = float((x @ (w0 - served).T).square().sum())
        return errs

    on, off = served_errors(rec[True].path), served_errors(rec[False].path)
    better = sum(on[n] < off[n] for n in on)
    assert better >= 0.9 * len(on), (better, len(on))
    assert sum(on.values()) < 0.95 * sum(off.values())
