"""Mixture-of-Experts layers as quantizable Linear modules.

transformers 5 stores each MoE layer's experts fused, as 3-D parameters (experts.gate_up_proj
[E, 2I, H], experts.down_proj [E, H, I]): no Linear to quantize, and no target a recipe
could name. llm-compressor's linearization (llmcompressor.modeling.moe) replaces each with
a LinearExperts2D of per-expert gate_proj / up_proj / down_proj Linear modules, whose
calibration forward sends every token through every expert while the layer's output still
uses only the routed ones (oneshot's `moe_calibrate_all_experts`, on by default). The saved
checkpoint has per-expert tensors (experts.N.gate_proj.weight_packed ...), the layout vLLM
reads and transformers re-fuses on load.
"""

from __future__ import annotations

from typing import Any


def fused_experts(model: Any) -> list[tuple[str, Any]]:
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    return list(get_non_linearized_moes(model))


def linearize(model: Any) -> int:
    """Replace the fused experts of a loaded model by Linear ones (weights copied); returns
    how many MoE layers were linearized."""
    found = fused_experts(model)
    if found:
        from llmcompressor.modeling.moe.linearize import linearize_moe

        linearize_moe(model)
    return len(found)


def linearize_meta(model: Any) -> int:
    """The same on a meta-device model: the module structure only (nothing to copy)."""
    import torch
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    found = fused_experts(model)
    with torch.device("meta"):
        for name, mod in found:
            cls = LinearExperts2D.get_linear_experts_cls(mod.__class__)
            model.set_submodule(name, cls(getattr(mod, "config", model.config)))
    return len(found)
