"""AWQ (and SmoothQuant) smoothing mappings, derived from the model's structure (model/roles.py), per layer.

    norm -> attention inputs     the norm the attention block reads -> q/k/v (or fused qkv)
    v -> o                       v_proj -> the attention output (only when v_proj's outputs
                                 are o_proj's inputs: not under GQA)
    norm -> mlp inputs           the norm the MLP block reads -> gate/up (dense), or every
                                 expert's gate/up and the router (MoE)
    up -> down                   up_proj -> down_proj, per MLP and per expert

Smoothing rescales the smooth layer's output and folds the inverse into every layer that
reads it. A mapping is applied only when the quantized layers it touches are all in AWQ
groups with the same options; a kept (16-bit) layer, like an MoE router, absorbs the
inverse scale exactly. Otherwise it is listed as skipped, with the reason.
"""

from __future__ import annotations

from typing import Any

from ..model.roles import ATTN_OUTPUT, MLP_OUTPUT, LayerParts, Structure
from ..recipe import Recipe
from ..records.plan import MappingPlan


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _candidates(lp: LayerParts, structure: Structure, mods: dict[str, Any]) -> list[tuple]:
    out: list[tuple[str, str, list[str]]] = []
    attn = [
        n for n in structure.roles["attention"] if lp.attention and n.startswith(lp.attention + ".")
    ]
    a_in = [n for n in attn if _leaf(n) not in ATTN_OUTPUT]
    a_out = [n for n in attn if _leaf(n) in ATTN_OUTPUT]
    if lp.attn_norm and a_in:
        out.append(("norm->qkv", f"{lp.layer}.{lp.attn_norm}", a_in))
    v = [n for n in a_in if _leaf(n) == "v_proj"]
    if v and len(a_out) == 1:
        out.append(("v->o", v[0], a_out))
    if lp.mlp is None:
        return out
    block = lp.mlp + "."
    mlp = [n for r in ("mlp", "experts") for n in structure.roles[r] if n.startswith(block)]
    router = [n for n in structure.roles["router"] if n.startswith(block)]
    m_in = [n for n in mlp if _leaf(n) not in MLP_OUTPUT]
    if lp.mlp_norm and m_in:
        balance = m_in + [n for n in router if hasattr(mods[n], "weight")]
        out.append(("norm->gate/up", f"{lp.layer}.{lp.mlp_norm}", balance))
    for up in (n for n in mlp if _leaf(n) == "up_proj"):
        down = up[: -len("up_proj")] + "down_proj"
        if down in mods:
            out.append(("up->down", up, [down]))
    return out


def derive_awq_mappings(
    model: Any, structure: Structure, owner: dict[str, str | None], recipe: Recipe
) -> list[MappingPlan]:
    import torch

    method = {g.name: g.method for g in recipe.groups}
    quantizing = {g.name for g in recipe.groups if g.quantizes}
    smoothed = {g.name for g in recipe.groups if g.smoothed}
    # AWQ alone and AWQ scales under GPTQ rounding are different settings of one mapping
    opts = {g.name: (g.method, g.options.model_dump_json()) for g in recipe.groups}
    if not smoothed:
        return []
    mods = dict(model.named_modules())
    out: list[MappingPlan] = []
    for lp in structure.layers:
        for kind, smooth, balance in _candidates(lp, structure, mods):
            involved = [*balance, *([smooth] if isinstance(mods[smooth], torch.nn.Linear) else [])]
            groups = {n: owner.get(n) for n in involved if n in owner}
            quantized = {n: g for n, g in groups.items() if g in quantizing}
            if not any(g in smoothed for g in quantized.values()):
                continue  # nothing AWQ here: not listed
            reason = ""
            non = [f"{_leaf(n)} in {g!r} ({method[g]})" for n, g in quantized.items()
                   if g not in smoothed]  # fmt: skip
            if non:
                reason = "not all quantized layers are in AWQ groups: " + ", ".join(non[:4])
            elif len({opts[g] for g in quantized.values()}) > 1:
                reason = "layers are in AWQ groups with different options"
            elif kind == "v->o" and mods[smooth].out_features != mods[balance[0]].in_features:
                cfg = model.config
                reason = (
                    f"shapes differ: v_proj gives {mods[smooth].out_features} features, the "
                    f"output projection takes {mods[balance[0]].in_features} (GQA: "
                    f"{getattr(cfg, 'num_key_value_heads', '?')} KV heads for "
                    f"{getattr(cfg, 'num_attention_heads', '?')} query heads)"
                )
            out.append(MappingPlan(kind=kind, smooth=smooth, balance=balance, applied=not reason,
                                   reason=reason or "shapes compatible"))  # fmt: skip
    return out


def derive_smoothquant_mappings(
    model: Any, structure: Structure, owner: dict[str, str | None], recipe: Recipe
) -> list[MappingPlan]:
    """SmoothQuant's norm -> (q/k/v | gate/up) mappings, per layer, for a recipe with
    `smoothquant`: applied when every layer that reads the norm quantizes its activations
    (the point of smoothing). Norms computing x * (1 + w) (Gemma) are smoothed correctly:
    llm-compressor 0.14's oneshot swaps them for x * w' during calibration and back
    (modeling/offset_norm.py)."""
    if recipe.smoothquant is None:
        return []
    acts = {g.name for g in recipe.groups if g.scheme and g.scheme.activations}
    mods = dict(model.named_modules())
    out: list[MappingPlan] = []
    for lp in structure.layers:
        for kind, smooth, balance in _candidates(lp, structure, mods):
            if not kind.startswith("norm->"):
                continue
            linear = [n for n in balance if n in owner]  # a router without weights excluded
            reason = ""
            plain = [_leaf(n) for n in linear if owner.get(n) not in acts]
            if plain:
                reason = "16-bit activations in " + ", ".join(plain[:4])
            out.append(MappingPlan(kind=kind, smooth=smooth, balance=linear, applied=not reason,
                                   reason=reason or "activations quantized"))  # fmt: skip
    return out
