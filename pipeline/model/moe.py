"""Mixture-of-Experts layers as quantizable Linear modules.

transformers 5 stores each MoE layer's experts fused, as 3-D parameters (experts.gate_up_proj
[E, 2I, H], experts.down_proj [E, H, I]): no Linear to quantize, and no target a recipe
could name. llm-compressor's linearization (llmcompressor.modeling.moe) replaces each with
a LinearExperts2D of per-expert gate_proj / up_proj / down_proj Linear modules, whose
calibration forward sends every token through every expert while the layer's output still
uses only the routed ones (oneshot's `moe_calibrate_all_experts`, on by default). The saved
checkpoint has per-expert tensors (experts.N.gate_proj.weight_packed ...), the layout vLLM
reads and transformers re-fuses on load.

Some families are saved in their Hub layout, not in the module names qship plans with:
transformers 5 reverses its checkpoint conversion on save, so a linearized Mixtral is
written as `block_sparse_moe.experts.N.w1/w3/w2` (the names vLLM reads) for the modules
`mlp.experts.N.gate_proj/up_proj/down_proj`. `saved_name_to_module` maps a stored name
back, from transformers' own conversion table for the model type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


# which per-expert Linear each source of a fused-experts target is (source order)
_FUSED_TARGETS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def saved_name_to_module(model_type: str | None) -> Callable[[str], str]:
    """name in a saved checkpoint -> name in the (linearized) model, for the families that
    transformers saves in another layout (identity for the others)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        rules = get_checkpoint_conversion_mapping(model_type) or [] if model_type else []
    except Exception:  # noqa: BLE001 - no table for this type: names are as saved
        rules = []
    subs: list[tuple[re.Pattern[str], str]] = []
    for r in rules:
        src, tgt = list(r.source_patterns), list(r.target_patterns)
        if type(r).__name__ == "WeightRenaming" and len(src) == len(tgt) == 1:
            subs.append((re.compile(re.escape(src[0])), tgt[0]))
            continue
        leaves = _FUSED_TARGETS.get(tgt[0].rsplit(".", 1)[-1]) if len(tgt) == 1 else None
        if not leaves or len(leaves) != len(src):
            continue
        for pattern, leaf in zip(src, leaves, strict=True):
            m = re.search(r"experts\.\*\.(\w+)\.weight$", pattern)
            if m and m.group(1) != leaf:
                subs.append(
                    (re.compile(rf"\.experts\.(\d+)\.{m.group(1)}\."), rf".experts.\1.{leaf}.")
                )

    def to_module(name: str) -> str:
        for pattern, repl in subs:
            name = pattern.sub(repl, name)
        return name

    return to_module
