"""Per-expert checkpoints load straight into Linear experts (model/moe.py
loading_linear_experts): the same weights as fusing them on load and splitting them after,
transformers' conversion table left as it was (a fused load afterwards still finds its
expert tensors), and a fused checkpoint still taking the split-after-load path."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline.model import loading, moe

pytestmark = pytest.mark.usefixtures("two_threads")


def test_direct_load_equals_split_after_load_and_restores_the_table(tiny_moe, monkeypatch):
    import transformers.conversion_mapping as cm

    before = cm.get_checkpoint_conversion_mapping("qwen3_moe")
    with moe.loading_linear_experts(tiny_moe) as direct:
        assert direct
    direct_model = loading.load_model(tiny_moe, device="cpu", linear_experts=True)
    assert repr(cm.get_checkpoint_conversion_mapping("qwen3_moe")) == repr(before)
    fused = loading.load_model(tiny_moe, device="cpu")
    assert type(fused.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    monkeypatch.setattr(loading, "_experts", lambda path, linear: contextlib.nullcontext())
    split = loading.load_model(tiny_moe, device="cpu", linear_experts=True)
    a, b = direct_model.state_dict(), split.state_dict()
    assert set(a) == set(b) and any(".experts.3.up_proj." in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fused_checkpoint_takes_the_split_after_load_path(tiny_moe, tmp_path):
    import shutil

    from safetensors.torch import save_file

    fused = loading.load_model(tiny_moe, device="cpu")  # the model's own (fused) names
    sd = {k: v.contiguous() for k, v in fused.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for f in tiny_moe.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    assert not moe._per_expert(tmp_path) and moe._per_expert(tiny_moe)
    with moe.loading_linear_experts(tmp_path) as direct:
        assert not direct
    model = loading.load_model(tmp_path, device="cpu", linear_experts=True)
    assert type(model.model.layers[0].mlp.experts).__name__ == "LinearExperts2D"
    w = fused.model.layers[1].mlp.experts.gate_up_proj[5]  # [2I, H]: gate rows, then up
    assert torch.equal(model.model.layers[1].mlp.experts[5].up_proj.weight, w[w.shape[0] // 2 :])


def test_linearize_lets_each_fused_layer_go_before_copying_the_next(tiny_moe, monkeypatch):
    """Splitting fused experts after a load (families without a per-expert mapping) holds one
    layer's experts twice at a time, not the whole model's: each fused module is gone when
    the next is copied (llm-compressor's linearize_moe kept them all until the end)."""
    import weakref

    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    model = loading.load_model(tiny_moe, device="cpu")  # fused
    cls = LinearExperts2D.get_linear_experts_cls(type(model.model.layers[0].mlp.experts))
    original, seen, alive = cls.from_experts_module, [], []

    def recording(module, config):
        alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(module))
        return original(module, config)

    monkeypatch.setattr(cls, "from_experts_module", recording)
    assert moe.linearize(model) == 2 and alive == [0, 0]
