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

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..compat.llmcompressor_0_14 import save_mapping_set_on_loaded_model
from ..compat.transformers_5 import conversion_mapping_restored
from ..errors import QshipError
from .files import read_config_json


def fused_experts(model: Any) -> list[tuple[str, Any]]:
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    return list(get_non_linearized_moes(model))


def linearize(model: Any) -> int:
    """Replace the fused experts of a loaded model by Linear ones (weights copied); returns
    how many MoE layers were linearized. Layer by layer, each fused module let go before the
    next is copied: llm-compressor's linearize_moe holds every fused module in its list until
    the last is replaced, the experts twice at the peak (2 Qwen3-30B-A3B-dims layers on the
    CPU: 5.23 GB peak for 3.7 GB of weights)."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    names = [name for name, _ in fused_experts(model)]
    for name in names:
        fused = model.get_submodule(name)
        cls = LinearExperts2D.get_linear_experts_cls(fused.__class__)
        model.set_submodule(
            name, cls.from_experts_module(fused, getattr(fused, "config", model.config))
        )
        del fused
    return len(names)


@contextlib.contextmanager
def loading_linear_experts(path: Path) -> Iterator[bool]:
    """Inside: AutoModelForCausalLM.from_pretrained reads a checkpoint's per-expert tensors
    straight into Linear experts (llm-compressor's load_quantizable_moe), where the family
    has such a mapping and the checkpoint stores its experts per expert. Yields whether it
    does; otherwise loading fuses them and `linearize` splits them again, which holds
    the experts twice (1.8x the weights of 8 Qwen3-30B-A3B-dims layers, H100 2026-12-06;
    on 4 layers on the CPU 30 s against 6 s read directly). transformers' table for the family is
    restored on exit: the library leaves its save mapping registered, with which a later
    load of the fused model in this process would find none of its expert tensors."""
    model_type = _model_type(path)
    if not reads_per_expert(path):
        yield False
        return
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoModelForCausalLM

    with conversion_mapping_restored(model_type), _importable_transformers_modules(), \
            save_mapping_set_on_loaded_model(), load_quantizable_moe(AutoModelForCausalLM):  # fmt: skip
        yield True


def reads_per_expert(path: Path) -> bool:
    """Whether loading_linear_experts reads this checkpoint's experts as Linear modules: the
    family has llm-compressor's per-expert mapping and the checkpoint stores them so."""
    return family_reads_per_expert(_model_type(path)) and _per_expert(path)


def family_reads_per_expert(model_type: str | None) -> bool:
    """Whether llm-compressor maps this family's per-expert tensors onto Linear experts
    (Qwen2/3-MoE: yes; Mixtral, PhiMoE, gpt-oss: no, their experts are fused on load)."""
    from llmcompressor.modeling.moe.conversion_mappings import has_linearize_load_mappings

    return bool(model_type and has_linearize_load_mappings(model_type))


def _model_type(path: Path) -> str | None:
    try:
        return read_config_json(Path(path)).get("model_type")
    except QshipError:  # no readable config: no family to map
        return None


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def _per_expert(path: Path) -> bool:
    """Whether the checkpoint stores experts one tensor each (the Hub layout), not fused."""
    from safetensors import safe_open

    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = []
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                names += list(h.keys())
    return any(_PER_EXPERT.search(n) for n in names)


@contextlib.contextmanager
def _importable_transformers_modules() -> Iterator[None]:
    """transformers 5.17's apply_patches (which load_quantizable_moe's loading enters) lists
    every loaded transformers module with dir(); its aliases of the vision processors import
    torchvision when listed, and fail without it. Those aliases are set aside meanwhile."""
    aside: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers") and module is not None:
            try:
                dir(module)
            except ImportError:
                aside[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(aside)


def linearize_meta(model: Any) -> int:
    """The same on a meta-device model: the module structure only (nothing to copy). Fused
    experts hold every expert in one 3-D parameter: a model without one has none, and the
    plan of a dense model does not import llm-compressor's registry (1.5 s of the recipe
    stage on 2 cores)."""
    import torch

    if not any(p.dim() >= 3 for p in model.parameters()):
        return 0
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
