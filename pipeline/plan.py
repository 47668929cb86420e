"""The quantization plan: every Linear module -> group, method, scheme; AWQ mappings; size.

Built from the recipe and the model's module tree (a meta-device model is enough: no
weights are read). The plan is what `qship plan` prints and what `qship quantize`
translates into llm-compressor modifiers and checks the saved checkpoint against.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError
from .recipe import Recipe, Scheme, validate_for_model

DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}


@dataclass
class ModulePlan:
    name: str
    cls: str
    group: str
    method: str  # awq | gptq | rtn | none
    scheme: dict | None  # {bits, symmetric, group_size} or None (kept in dtype)
    in_features: int
    out_features: int
    tied: bool  # weight shared with the input embedding (stored once, as the embedding)
    bits_per_weight: float
    stored_bytes: int


@dataclass
class MappingPlan:
    kind: str  # "norm->qkv", "v->o", "norm->gate/up", "up->down"
    smooth: str
    balance: list[str]
    applied: bool
    reason: str


@dataclass
class Plan:
    recipe_name: str
    recipe_hash: str
    architecture: str
    model_type: str
    dtype: str
    modules: list[ModulePlan]
    mappings: list[MappingPlan]
    kv_cache: dict | None
    decoder_layers: list[str]
    bits_per_weight: dict
    expected_checkpoint_bytes: int
    params: dict
    notes: list[str] = field(default_factory=list)

    def by_name(self) -> dict[str, ModulePlan]:
        return {m.name: m for m in self.modules}

    def groups(self, method: str | None = None) -> dict[str, list[ModulePlan]]:
        out: dict[str, list[ModulePlan]] = {}
        for m in self.modules:
            if method is None or m.method == method:
                out.setdefault(m.group, []).append(m)
        return out

    def applied_mappings(self) -> list[MappingPlan]:
        return [m for m in self.mappings if m.applied]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        d = dict(d)
        d["modules"] = [ModulePlan(**m) for m in d["modules"]]
        d["mappings"] = [MappingPlan(**m) for m in d["mappings"]]
        return cls(**d)

    def summary(self):
        from rich.console import Group as RGroup
        from rich.table import Table

        t = Table(title=f"plan: {self.recipe_name} on {self.architecture}", show_lines=False)
        t.add_column("module", no_wrap=True)
        for col in ("class", "group", "method", "scheme", "in→out", "bits/w"):
            t.add_column(col)
        for m in self.modules:
            sch = _scheme_label(m.scheme, self.dtype) + (" (tied to embedding)" if m.tied else "")
            t.add_row(
                m.name,
                m.cls,
                m.group,
                m.method,
                sch,
                f"{m.in_features}→{m.out_features}",
                f"{m.bits_per_weight:.3f}",
            )
        mt = Table(title="AWQ smoothing mappings (restricted to AWQ groups)")
        mt.add_column("smooth", no_wrap=True)
        mt.add_column("balance")
        mt.add_column("status")
        for mp in self.mappings:
            mt.add_row(
                mp.smooth,
                ", ".join(b.rsplit(".", 1)[-1] for b in mp.balance),
                ("applied" if mp.applied else "skipped: ") + ("" if mp.applied else mp.reason),
            )
        bpw = self.bits_per_weight
        lines = [
            f"KV cache: {self.kv_cache or 'not quantized'}",
            f"bits per weight: {bpw['quantized']:.3f} over quantized Linear weights, "
            f"{bpw['linear']:.3f} over all Linear weights (tied head counted once, as embedding)",
            f"expected checkpoint size: {self.expected_checkpoint_bytes / 1e6:.2f} MB "
            f"(dense {self.dtype}: {self.params['dense_bytes'] / 1e6:.2f} MB)",
            *self.notes,
        ]
        items: list[Any] = [t]
        if self.mappings:
            items.append(mt)
        items.append("\n".join(lines))
        return RGroup(*items)


def _scheme_label(s: dict | None, dtype: str) -> str:
    if not s:
        return f"{dtype} (kept)"
    return Scheme(**s).label()


def weight_storage_bits(out_f: int, in_f: int, scheme: dict | None, dtype_bits: int) -> int:
    """Bits stored for one Linear weight in compressed-tensors pack-quantized format."""
    if not scheme:
        return out_f * in_f * dtype_bits
    bits = scheme["bits"]
    ngroups = in_f // scheme["group_size"] if scheme["group_size"] else 1
    total = out_f * in_f * bits  # weight_packed (int32 words, 32/bits values each)
    total += out_f * ngroups * dtype_bits  # weight_scale in the model dtype
    if not scheme["symmetric"]:
        total += out_f * ngroups * bits  # weight_zero_point, packed like the weight
    total += 2 * 32  # weight_shape (int32[2])
    return total


def load_meta_model(model_dir: Path):
    """The model's module tree on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UsageError(
            f"{model_dir} is not a checkpoint directory (no config.json)",
            path=str(model_dir),
            hint="pass a local Hugging Face checkpoint dir (e.g. the output of qship fetch)",
        )
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model


def _decoder_layers(model) -> list[str]:
    import torch

    layers = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.endswith("layers"):
            layers.extend(f"{name}.{i}" for i in range(len(mod)))
            break
    return layers


def derive_awq_mappings(model, owner: dict[str, str], recipe: Recipe) -> list[MappingPlan]:
    """AWQ mappings for this architecture, one per decoder layer, restricted to AWQ groups.

    input_layernorm → q/k/v; v_proj → o_proj (only when v_proj's outputs equal o_proj's
    inputs, i.e. not under GQA); the MLP's input norm (pre_feedforward_layernorm on
    Gemma, post_attention_layernorm elsewhere) → gate/up; up_proj → down_proj. A mapping
    is applied only when every balance layer (and a Linear smooth layer) is in an AWQ
    group with the same options; otherwise it is listed as skipped, with the reason.
    """
    import torch

    method = {g.name: g.method for g in recipe.groups}
    opts = {g.name: g.options.model_dump_json() for g in recipe.groups}
    mods = dict(model.named_modules())
    out: list[MappingPlan] = []
    if not any(m == "awq" for m in method.values()):
        return out
    for layer in _decoder_layers(model):

        def has(n: str) -> bool:
            return n in mods

        attn = f"{layer}.self_attn"
        mlp = f"{layer}.mlp"
        cands: list[tuple[str, str, list[str]]] = []
        if has(f"{layer}.input_layernorm"):
            cands.append(
                ("norm->qkv", f"{layer}.input_layernorm", [f"{attn}.{p}_proj" for p in "qkv"])
            )
        cands.append(("v->o", f"{attn}.v_proj", [f"{attn}.o_proj"]))
        mlp_norm = next(
            (
                f"{layer}.{n}"
                for n in ("pre_feedforward_layernorm", "post_attention_layernorm")
                if has(f"{layer}.{n}")
            ),
            None,
        )
        if mlp_norm:
            cands.append(("norm->gate/up", mlp_norm, [f"{mlp}.gate_proj", f"{mlp}.up_proj"]))
        cands.append(("up->down", f"{mlp}.up_proj", [f"{mlp}.down_proj"]))
        for kind, smooth, balance in cands:
            if not has(smooth) or not all(has(b) for b in balance):
                continue
            involved = balance + ([smooth] if isinstance(mods[smooth], torch.nn.Linear) else [])
            groups = {owner.get(n) for n in involved}
            if not any(method.get(g) == "awq" for g in groups):
                continue  # nothing AWQ here: not listed
            reason = ""
            if any(method.get(g) != "awq" for g in groups):
                non = [
                    f"{n.rsplit('.', 1)[-1]} in {owner.get(n)!r} ({method.get(owner.get(n))})"
                    for n in involved
                    if method.get(owner.get(n)) != "awq"
                ]
                reason = "not all layers are in AWQ groups: " + ", ".join(non)
            elif len({opts[g] for g in groups}) > 1:
                reason = "layers are in AWQ groups with different options"
            elif kind == "v->o":
                v, o = mods[smooth], mods[balance[0]]
                if v.out_features != o.in_features:
                    cfg = model.config
                    reason = (
                        f"shapes differ: v_proj gives {v.out_features} features, o_proj takes "
                        f"{o.in_features} (GQA: {getattr(cfg, 'num_key_value_heads', '?')} KV heads "
                        f"for {getattr(cfg, 'num_attention_heads', '?')} query heads)"
                    )
            out.append(
                MappingPlan(kind, smooth, balance, not reason, reason or "shapes compatible")
            )
    return out


def build_plan(model, recipe: Recipe) -> Plan:
    """Validate `recipe` against `model` (RecipeError, exit 2) and build the plan."""
    import torch

    owner = validate_for_model(recipe, model)
    groups = {g.name: g for g in recipe.groups}
    dtype_bits = DTYPE_BITS[recipe.dtype]
    emb = model.get_input_embeddings()
    emb_w = getattr(emb, "weight", None)

    modules: list[ModulePlan] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        g = groups[owner[name]]
        scheme = g.scheme.planned() if g.scheme else None
        tied = emb_w is not None and mod.weight is emb_w
        bits = weight_storage_bits(mod.out_features, mod.in_features, scheme, dtype_bits)
        modules.append(
            ModulePlan(
                name=name,
                cls=type(mod).__name__,
                group=g.name,
                method=g.method,
                scheme=scheme,
                in_features=mod.in_features,
                out_features=mod.out_features,
                tied=tied,
                bits_per_weight=bits / (mod.out_features * mod.in_features),
                stored_bytes=0 if tied else bits // 8,
            )
        )
        if tied and scheme:
            raise UsageError(
                f"{name} shares its weight with the input embedding and cannot be quantized alone",
                path=recipe.path,
                hint=f"put {name} in a `method: none` group",
            )

    # whole-checkpoint size: every parameter/buffer once; quantized Linear weights packed
    linear_w = {
        id(mod.weight) for _, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
    }
    seen: set[int] = set()
    other_bytes = 0
    dense_bytes = 0
    n_params = 0
    for _, p in list(model.named_parameters(remove_duplicate=True)):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n_params += p.numel()
        dense_bytes += p.numel() * dtype_bits // 8
        if id(p) not in linear_w or (emb_w is not None and p is emb_w):
            other_bytes += p.numel() * dtype_bits // 8
    lin_bytes = sum(m.stored_bytes for m in modules)
    n_layers = len(_decoder_layers(model))
    kv_bytes = 2 * n_layers * dtype_bits // 8 if recipe.kv_cache else 0
    expected = other_bytes + lin_bytes + kv_bytes

    q = [m for m in modules if m.scheme]
    untied = [m for m in modules if not m.tied]

    def _avg(ms: list[ModulePlan]) -> float:
        n = sum(m.in_features * m.out_features for m in ms)
        return sum(m.bits_per_weight * m.in_features * m.out_features for m in ms) / n if n else 0.0

    mappings = derive_awq_mappings(model, owner, recipe)
    notes = []
    skipped = [m for m in mappings if not m.applied]
    if skipped:
        notes.append(
            f"{len(skipped)} AWQ mapping(s) skipped (see table); their layers get AWQ scales from the other mappings or plain rounding"
        )
    awq_mods = {m.name for m in modules if m.method == "awq"}
    covered = {b for mp in mappings if mp.applied for b in mp.balance}
    unsmoothed = sorted(awq_mods - covered)
    if unsmoothed:
        notes.append(
            f"AWQ modules with no applied mapping (rounded without smoothing): {', '.join(unsmoothed)}"
        )
    kv = recipe.kv_cache.model_dump() if recipe.kv_cache else None
    return Plan(
        recipe_name=recipe.name,
        recipe_hash=recipe.hash(),
        architecture=(getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        model_type=str(getattr(model.config, "model_type", "")),
        dtype=recipe.dtype,
        modules=modules,
        mappings=mappings,
        kv_cache=kv,
        decoder_layers=_decoder_layers(model),
        bits_per_weight={
            "quantized": _avg(q) if q else float(dtype_bits),
            "linear": _avg(untied),
            "whole_checkpoint": expected * 8 / n_params,
        },
        expected_checkpoint_bytes=int(expected),
        params={
            "total": int(n_params),
            "dense_bytes": int(dense_bytes),
            "quantized_linear": int(sum(m.in_features * m.out_features for m in q)),
        },
        notes=notes,
    )


def plan_for_dir(model_dir: Path, recipe: Recipe) -> Plan:
    return build_plan(load_meta_model(model_dir), recipe)


def dumps(plan: Plan) -> str:
    return json.dumps(plan.to_json(), indent=2, sort_keys=True)
