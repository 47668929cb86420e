"""Roles of a causal LM's modules, from its module tree: one recipe fits every family.

    attention   the Linear layers of each decoder layer's attention block
    mlp         the Linear layers of its dense MLP (and of an MoE block's shared expert)
    experts     the Linear layers of the routed experts (MoE, linearized: experts.N.*_proj)
    router      the module choosing experts (mlp.gate; not a Linear in transformers 5),
                and a shared expert's gate
    embeddings  the input embedding
    lm_head     the output projection

The rules are structural, so they hold for families qship has not seen: the decoder layers
are the model's largest ModuleList of blocks; in each, the attention block is the child
whose class is an *Attention (it holds the q/k/v projections and the softmax), the MLP
block is the child holding the remaining Linear layers; inside an MoE block the experts
are the LinearExperts2D / ModuleList named `experts`, the router its `gate`/`router`.
CHECKED lists the model types these rules were checked on (tests/test_roles.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..records.plan import ModuleScheme

ROLES = ("attention", "mlp", "experts", "router", "embeddings", "lm_head")
CHECKED = (
    "gemma2", "gemma3_text", "llama", "mistral", "qwen2", "qwen3", "phi3",
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
)  # fmt: skip
# the last projection of a block: what AWQ balances from its value/up input (v->o, up->down)
ATTN_OUTPUT = ("o_proj", "out_proj", "dense", "c_proj", "wo")
MLP_OUTPUT = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2")
# Linear layers a serving engine loads as one fused layer with one quantization scheme:
# vLLM's packed_modules_mapping (qkv_proj, gate_up_proj) and its FusedMoE (every expert of
# an MoE block). vLLM takes the fused layer's scheme from its first shard, so shards at other
# bits or group sizes fail to load (compressed_tensors/utils.py: find_matched_target).
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
_EXPERT = re.compile(r"(.*\.experts)\.\d+\.[^.]+$")


@dataclass
class LayerParts:
    """One decoder layer's blocks (module paths) as the AWQ mappings need them."""

    layer: str
    attention: str | None = None
    mlp: str | None = None
    attn_norm: str | None = None  # the norm whose output the attention block reads
    mlp_norm: str | None = None  # the norm whose output the MLP block reads
    experts: str | None = None


@dataclass
class Structure:
    roles: dict[str, list[str]]  # role -> module names (Linear, except embeddings/router)
    layers: list[LayerParts]
    rule: str  # which rules resolved it, for the plan
    notes: list[str] = field(default_factory=list)

    def role_of(self) -> dict[str, str]:
        return {n: r for r, names in self.roles.items() for n in names}


def fusion_key(name: str) -> str:
    """The fused layer `name` is served as (itself when no engine fuses it)."""
    m = _EXPERT.match(name)
    if m:
        return m.group(1)
    parent, _, leaf = name.rpartition(".")
    return f"{parent}.{FUSED[leaf]}" if leaf in FUSED else name


def fused_sets(names: Iterable[str]) -> list[list[str]]:
    """`names` partitioned by `fusion_key`, in first-seen order."""
    sets: dict[str, list[str]] = {}
    for n in names:
        sets.setdefault(fusion_key(n), []).append(n)
    return list(sets.values())


def split_fused(schemes: Mapping[str, ModuleScheme | None]) -> list[str]:
    """One line per fused set whose modules `schemes` stores two ways (None: 16-bit)."""
    out = []
    for members in fused_sets(schemes):
        kind = {n: s.stored() if (s := schemes[n]) else "16-bit" for n in members}
        a = members[0]
        b = next((n for n in members if kind[n] != kind[a]), None)
        if b is not None:
            out.append(f"{a} is {kind[a]} but {b} is {kind[b]}: vLLM loads {fusion_key(a)} "
                       "as one fused layer with one scheme")  # fmt: skip
    return out


def _linear(mod: Any) -> bool:
    import torch

    return isinstance(mod, torch.nn.Linear)


def decoder_layer_list(model: Any) -> tuple[str, Any] | None:
    """(name, ModuleList) of the decoder layers: the longest ModuleList of blocks that hold
    Linear layers (llm-compressor's sequential pipeline runs through the same list)."""
    import torch

    best: tuple[str, Any] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or not len(mod):
            continue
        if not any(_linear(x) for x in mod[0].modules()) or name.endswith("experts"):
            continue
        if best is None or len(mod) > len(best[1]):
            best = (name, mod)
    return best


def _norm_child(layer: Any, prefer: tuple[str, ...]) -> str | None:
    names = [n for n, _ in layer.named_children()]
    return next((p for p in prefer if p in names), None)


def resolve(model: Any) -> Structure:
    """The roles of `model`'s modules (a meta-device model is enough)."""
    roles: dict[str, list[str]] = {r: [] for r in ROLES}
    notes: list[str] = []
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if emb is not None and id(emb) in names:
        roles["embeddings"].append(names[id(emb)])
    if head is not None and id(head) in names and _linear(head):
        roles["lm_head"].append(names[id(head)])
    found = decoder_layer_list(model)
    parts: list[LayerParts] = []
    if found is None:
        notes.append("no decoder-layer list found: only the embeddings and lm_head have roles")
        return Structure(roles, parts, "none (no decoder layers found)", notes)
    list_name, layers = found
    for i, layer in enumerate(layers):
        prefix = f"{list_name}.{i}"
        lp = LayerParts(prefix)
        for cname, child in layer.named_children():
            path = f"{prefix}.{cname}"
            cls = type(child).__name__
            if not any(_linear(x) for x in child.modules()):
                continue
            if cls.endswith("Attention") or "attn" in cname or cname == "attention":
                lp.attention = path
                roles["attention"] += [
                    f"{path}.{n}" for n, x in child.named_modules() if _linear(x)
                ]
            else:
                lp.mlp = path
                _mlp_roles(child, path, roles, lp)
        lp.attn_norm = _norm_child(layer, ("input_layernorm", "ln_1", "attention_norm"))
        lp.mlp_norm = _norm_child(
            layer, ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm")
        )
        parts.append(lp)
    claimed = {n for r in ("attention", "mlp", "experts", "router") for n in roles[r]}
    loose = [
        f"{list_name}.{i}.{n}"
        for i, layer in enumerate(layers)
        for n, x in layer.named_modules()
        if _linear(x) and f"{list_name}.{i}.{n}" not in claimed
    ]
    if loose:
        notes.append(
            f"{len(loose)} Linear module(s) in the decoder layers have no role: {loose[0]} …"
        )
    if model_type in CHECKED:
        rule = f"structural rules, checked on {model_type}"
    else:
        rule = (
            f"generic structural rules ({model_type or 'unknown model type'} is not among the "
            "checked families): attention = the *Attention child of each decoder layer, mlp = "
            "the other block holding Linear layers, experts/router inside an MoE block"
        )
    return Structure(roles, parts, rule, notes)


def _mlp_roles(block: Any, path: str, roles: dict[str, list[str]], lp: LayerParts) -> None:
    """Dense MLP: all its Linear layers. MoE block: experts, router, shared expert."""
    children = dict(block.named_children())
    experts = children.get("experts")
    if experts is None:
        roles["mlp"] += [f"{path}.{n}" for n, x in block.named_modules() if _linear(x)]
        return
    lp.experts = f"{path}.experts"
    roles["experts"] += [f"{path}.experts.{n}" for n, x in experts.named_modules() if _linear(x)]
    for cname, child in children.items():
        if cname == "experts":
            continue
        sub = f"{path}.{cname}"
        if cname in ("gate", "router") or "gate" in cname and _linear(child):
            roles["router"].append(sub)  # kept 16-bit by default: it decides the routing
        else:
            roles["mlp"] += [
                f"{sub}.{n}" if n else sub for n, x in child.named_modules() if _linear(x)
            ]
