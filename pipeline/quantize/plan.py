"""The quantization plan: every Linear module -> group, method, scheme; AWQ mappings; size.

Built from the recipe and the model's module tree (a meta-device model is enough: no
weights are read), after `validate.validate_for_model` accepted the recipe. The plan is
what `qship plan` prints, what modifiers.py translates into llm-compressor modifiers and
what the post-save check holds the checkpoint to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..model.devices import DTYPES
from ..model.loading import load_meta_model, meta_model
from ..recipe import Recipe
from ..records.plan import (
    BitsPerWeight,
    MappingPlan,
    ModulePlan,
    ModuleScheme,
    ParamCounts,
    Plan,
)
from .validate import validate_for_model


def weight_storage_bits(out_f: int, in_f: int, scheme: ModuleScheme | None, dtype_bits: int) -> int:
    """Bits stored for one Linear weight in compressed-tensors pack-quantized format."""
    if not scheme:
        return out_f * in_f * dtype_bits
    bits = scheme.bits
    ngroups = in_f // scheme.group_size if scheme.group_size else 1
    total = out_f * in_f * bits  # weight_packed (int32 words, 32/bits values each)
    total += out_f * ngroups * dtype_bits  # weight_scale in the model dtype
    if not scheme.symmetric:
        total += out_f * ngroups * bits  # weight_zero_point, packed like the weight
    total += 2 * 32  # weight_shape (int32[2])
    return total


def decoder_layers(model: Any) -> list[str]:
    import torch

    layers: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.endswith("layers"):
            layers.extend(f"{name}.{i}" for i in range(len(mod)))
            break
    return layers


def derive_awq_mappings(model: Any, owner: dict[str, str], recipe: Recipe) -> list[MappingPlan]:
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
    for layer in decoder_layers(model):

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
            groups = {owner.get(n, "") for n in involved}
            if not any(method.get(g) == "awq" for g in groups):
                continue  # nothing AWQ here: not listed
            reason = ""
            if any(method.get(g) != "awq" for g in groups):
                non = [
                    f"{n.rsplit('.', 1)[-1]} in {owner.get(n)!r} ({method.get(owner.get(n, ''))})"
                    for n in involved
                    if method.get(owner.get(n, "")) != "awq"
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
                MappingPlan(
                    kind=kind,
                    smooth=smooth,
                    balance=balance,
                    applied=not reason,
                    reason=reason or "shapes compatible",
                )
            )
    return out


def build_plan(model: Any, recipe: Recipe) -> Plan:
    """Validate `recipe` against `model` (RecipeError, exit 2) and build the plan."""
    import torch

    owner = validate_for_model(recipe, model)
    groups = {g.name: g for g in recipe.groups}
    dtype_bits = DTYPES[recipe.dtype].bits
    emb = model.get_input_embeddings()
    emb_w = getattr(emb, "weight", None)

    modules: list[ModulePlan] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        g = groups[owner[name]]
        scheme = (
            ModuleScheme(
                bits=g.scheme.bits,
                symmetric=g.scheme.symmetric,
                group_size=g.scheme.group_size,
                observer=g.scheme.observer,
            )
            if g.scheme
            else None
        )
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
    n_layers = len(decoder_layers(model))
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
    return Plan(
        recipe_name=recipe.name,
        recipe_hash=recipe.hash(),
        architecture=(getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        model_type=str(getattr(model.config, "model_type", "")),
        dtype=recipe.dtype,
        modules=modules,
        mappings=mappings,
        kv_cache=recipe.kv_cache,
        decoder_layers=decoder_layers(model),
        bits_per_weight=BitsPerWeight(
            quantized=_avg(q) if q else float(dtype_bits),
            linear=_avg(untied),
            whole_checkpoint=expected * 8 / n_params,
        ),
        expected_checkpoint_bytes=int(expected),
        params=ParamCounts(
            total=int(n_params),
            dense_bytes=int(dense_bytes),
            quantized_linear=int(sum(m.in_features * m.out_features for m in q)),
        ),
        notes=notes,
    )


def plan_for_config(config: Any, recipe: Recipe) -> Plan:
    """The plan from a model config alone (meta device): for checks before any download."""
    return build_plan(meta_model(config), recipe)


def plan_for_dir(model_dir: Path, recipe: Recipe) -> Plan:
    return build_plan(load_meta_model(model_dir), recipe)
