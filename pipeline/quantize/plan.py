"""The quantization plan: every Linear module -> group, method, scheme (or kept, and why);
its role; the AWQ mappings; the expected size in bits per weight and bytes.

Built from the recipe and the model's module tree (a meta-device model is enough: no
weights are read), after validate.py accepted the recipe. The plan is what `qship plan`
prints, what modifiers.py translates into llm-compressor modifiers and what the post-save
check holds the checkpoint to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..model.devices import DTYPES
from ..model.loading import load_meta_model, meta_model
from ..model.roles import Structure, split_fused
from ..recipe import Recipe, Scheme
from ..records.plan import (
    ActivationScheme,
    BitsPerWeight,
    ModulePlan,
    ModuleScheme,
    ParamCounts,
    Plan,
)
from .awq_mappings import derive_awq_mappings, derive_smoothquant_mappings
from .serving import check_lengths, check_target
from .validate import Claims, validate_for_model

OTHERS = "(others)"  # the group name of Linear modules kept under `others: keep`


def module_scheme(s: Scheme, group_size: int | None) -> ModuleScheme:
    """The recipe scheme as it applies to one module whose group size is `group_size` (the
    recipe's, or the fallback that divides the module)."""
    act = s.activations
    return ModuleScheme(
        bits=s.bits, symmetric=s.symmetric, group_size=group_size, observer=s.observer,
        type=s.type, block=s.block,
        strategy=s.strategy if s.strategy != "group" or group_size else "channel",
        activations=ActivationScheme(**act.model_dump()) if act else None,
    )  # fmt: skip


def weight_storage_bits(out_f: int, in_f: int, scheme: ModuleScheme | None, dtype_bits: int) -> int:
    """Bits stored for one Linear weight as compressed-tensors saves it: packed int4/int8
    (pack-quantized), int8 (int-quantized: INT8 W8A8) or FP8 (float-quantized)."""
    if not scheme:
        return out_f * in_f * dtype_bits
    bits = scheme.bits
    if scheme.strategy == "block" and scheme.block:
        scales = -(-out_f // scheme.block[0]) * -(-in_f // scheme.block[1])
    elif scheme.strategy == "tensor":
        scales = 1
    else:
        scales = out_f * (in_f // scheme.group_size if scheme.group_size else 1)
    total = out_f * in_f * bits  # weight_packed (int32 words, 32/bits values each), or int8/fp8
    total += scales * dtype_bits  # weight_scale in the model dtype
    act = scheme.activations
    if act is not None and not act.dynamic:
        total += dtype_bits  # input_scale (per tensor)
    if scheme.type == "float" or scheme.activations is not None and bits == 8:
        return total  # int-quantized / float-quantized: no weight_shape
    ngroups = in_f // scheme.group_size if scheme.group_size else 1
    if not scheme.symmetric:
        total += out_f * ngroups * bits  # weight_zero_point, packed like the weight
    total += 2 * 32  # weight_shape (int32[2])
    return total


def _module_plan(name: str, mod: Any, recipe: Recipe, claims: Claims, tied: bool,
                 role: str | None, dtype_bits: int) -> ModulePlan:  # fmt: skip
    gname = claims.owner[name]
    g = next((g for g in recipe.groups if g.name == gname), None)
    scheme, note = None, ""
    if g is None:
        note = "kept: no group claims it (`others: keep`)"
    elif g.scheme is None:
        note = f"kept: group {g.name!r} has method none"
    else:
        gs = claims.group_size.get(name, g.scheme.group_size)
        scheme = module_scheme(g.scheme, gs)
        if name in claims.group_size:
            note = (f"group size {g.scheme.group_size} does not divide {mod.in_features}: "
                    + (f"group size {gs}" if gs else "one scale per channel"))  # fmt: skip
    if tied and scheme:
        raise RecipeError(
            f"{name} shares its weight with the input embedding and cannot be quantized alone",
            path=recipe.path,
            hint=f"keep it: put {name} (role lm_head) in a `method: none` group",
        )
    bits = weight_storage_bits(mod.out_features, mod.in_features, scheme, dtype_bits)
    return ModulePlan(
        name=name, cls=type(mod).__name__, group=gname or OTHERS,
        method=g.method if g else "none", scheme=scheme, role=role, note=note,
        in_features=mod.in_features, out_features=mod.out_features, tied=tied,
        bits_per_weight=bits / (mod.out_features * mod.in_features),
        stored_bytes=0 if tied else bits // 8,
    )  # fmt: skip


def check_fused(modules: list[ModulePlan], recipe: Recipe) -> None:
    """Modules a serving engine fuses into one layer (q/k/v, gate/up, one block's experts)
    must be stored alike: vLLM loads the fused layer with one scheme."""
    bad = split_fused({m.name: m.scheme for m in modules})
    if bad:
        raise RecipeError(
            bad[0] + (f" (and {len(bad) - 1} more such sets)" if len(bad) > 1 else ""),
            path=recipe.path,
            hint="give the whole set the same bits, symmetry and group size (one group's "
            "targets on all of them), or keep all of them 16-bit",
        )


# Families whose quantized checkpoint the pinned transformers (5.17) cannot load back, so
# that qship could neither evaluate nor verify it. Mixtral: llm-compressor linearizes the
# experts and the checkpoint is saved in the Hub layout (block_sparse_moe.experts.N.w1/w3/w2,
# the names vLLM reads); loading it, transformers matches none of the per-expert tensors,
# quantized or 16-bit, to its fused experts and initializes those at random (its load
# report: experts MISSING, every per-expert tensor UNEXPECTED). A library fault: refused
# here, in one place, until the pinned versions load it (qship's reload check would also
# stop it, after calibration).
RELOAD_FAULTS = {"mixtral": "transformers 5.17 cannot load back the experts of a Mixtral "
                 "checkpoint written through llm-compressor 0.14's expert linearization (they "
                 "come back random)"}  # fmt: skip


def _scales_per_layer(recipe: Recipe, cfg: Any) -> int:
    """The KV cache's scale tensors' elements per attention layer: k and v (and q), one per
    tensor or one per head (K/V heads, query heads); exit 2 for attn_head on a model whose
    query heads do not group evenly over its KV heads (vLLM reduces q per KV head)."""
    kv = recipe.kv_cache
    if kv is None:
        return 0
    if kv.strategy == "tensor":
        return 2 + int(kv.query)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    if not heads or heads % kv_heads:
        raise RecipeError(
            f"kv_cache.strategy attn_head: {heads} query heads do not group evenly over "
            f"{kv_heads} KV heads (vLLM reduces the query's scales per KV head)",
            path=recipe.path, hint="use kv_cache.strategy: tensor for this model",
        )  # fmt: skip
    return 2 * kv_heads + (heads if kv.query else 0)


def check_skip_layers(recipe: Recipe, n_layers: int) -> None:
    """Exit 2 for a kv_cache.skip_layers index the model does not have: a typo there would
    leave the layer meant to stay 16-bit at FP8."""
    kv = recipe.kv_cache
    bad = [i for i in (kv.skip_layers if kv else []) if i >= n_layers]
    if bad:
        raise RecipeError(f"kv_cache.skip_layers lists layer {bad[0]}, but the model has "
                          f"{n_layers} decoder layers (0-{n_layers - 1})", path=recipe.path,
                          hint=f"list indices below {n_layers}")  # fmt: skip


def check_reloadable(modules: list[ModulePlan], model_type: str, recipe: Recipe) -> None:
    """Exit 2 before compute for a family whose checkpoint the pinned transformers cannot
    load back (RELOAD_FAULTS)."""
    why = RELOAD_FAULTS.get(model_type)
    if why and any(m.role == "experts" for m in modules):
        raise RecipeError(
            f"{model_type} is not supported by the pinned libraries: {why}",
            path=recipe.path,
            hint="quantize a Mixtral with another tool for now, or a family qship runs end "
            'to end (README, "Recipes"); qship\'s evaluation could not measure this one',
        )


def build_plan(model: Any, recipe: Recipe, structure: Structure | None = None) -> Plan:
    """Validate `recipe` against `model` (RecipeError, exit 2) and build the plan."""
    import torch

    claims = validate_for_model(recipe, model, structure)
    structure = claims.structure
    assert structure is not None
    dtype_bits = DTYPES[recipe.dtype].bits
    emb_w = getattr(model.get_input_embeddings(), "weight", None)
    role_of = structure.role_of()
    modules = [
        _module_plan(
            name,
            mod,
            recipe,
            claims,
            emb_w is not None and mod.weight is emb_w,
            role_of.get(name),
            dtype_bits,
        )  # fmt: skip
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear)
    ]
    check_fused(modules, recipe)
    target_notes = check_target(modules, recipe)
    cfg_text = getattr(model.config, "get_text_config", lambda: model.config)()
    check_lengths(recipe, getattr(cfg_text, "max_position_embeddings", None))
    check_reloadable(modules, str(getattr(getattr(model, "config", None), "model_type", "")),
                     recipe)  # fmt: skip
    # whole-checkpoint size: every parameter once; quantized Linear weights packed
    linear_w = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    seen: set[int] = set()
    other_bytes = dense_bytes = n_params = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n_params += p.numel()
        dense_bytes += p.numel() * dtype_bits // 8
        if id(p) not in linear_w or (emb_w is not None and p is emb_w):
            other_bytes += p.numel() * dtype_bits // 8
    attention = [lp for lp in structure.layers if lp.attention]
    check_skip_layers(recipe, len(structure.layers))
    kv_bytes = len(attention) * _scales_per_layer(recipe, cfg_text) * dtype_bits // 8
    attn_class = (type(model.get_submodule(attention[0].attention)).__name__
                  if attention and recipe.kv_cache and recipe.kv_cache.query else None)  # fmt: skip
    expected = other_bytes + sum(m.stored_bytes for m in modules) + kv_bytes
    q = [m for m in modules if m.scheme]
    untied = [m for m in modules if not m.tied]

    def _avg(ms: list[ModulePlan]) -> float:
        n = sum(m.in_features * m.out_features for m in ms)
        return sum(m.bits_per_weight * m.in_features * m.out_features for m in ms) / n if n else 0.0

    mappings = derive_awq_mappings(model, structure, claims.owner, recipe)
    smoothing = derive_smoothquant_mappings(model, structure, claims.owner, recipe)
    notes = list(structure.notes) + target_notes
    sq_skipped = [m for m in smoothing if not m.applied]
    if sq_skipped:
        notes.append(f"SmoothQuant: {len(sq_skipped)} of {len(smoothing)} norm mapping(s) "
                     f"skipped, e.g. {sq_skipped[0].smooth}: {sq_skipped[0].reason}")  # fmt: skip
    if not recipe.needs_calibration():
        notes.append("data-free: no calibration pass (RTN weights, dynamic activation scales)")
    skipped = [m for m in mappings if not m.applied]
    if skipped:
        notes.append(
            f"{len(skipped)} AWQ mapping(s) skipped; their layers get AWQ scales from the "
            "other mappings or plain rounding"
        )
    covered = {b for mp in mappings if mp.applied for b in mp.balance}
    unsmoothed = sorted(m.name for m in modules if m.method == "awq" and m.name not in covered)
    if unsmoothed:
        notes.append(f"{len(unsmoothed)} AWQ module(s) with no applied mapping (rounded "
                     f"without smoothing): {', '.join(unsmoothed[:4])}")  # fmt: skip
    fallbacks = [m for m in modules if m.scheme and m.name in claims.group_size]
    if fallbacks:
        notes.append(f"{len(fallbacks)} module(s) quantized with a fallback group size "
                     f"(on_indivisible: fallback), e.g. {fallbacks[0].name}: {fallbacks[0].note}")  # fmt: skip
    cfg = model.config
    return Plan(
        recipe_name=recipe.name,
        recipe_hash=recipe.hash(),
        architecture=(getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        model_type=str(getattr(cfg, "model_type", "")),
        dtype=recipe.dtype,
        modules=modules,
        mappings=mappings,
        smoothquant=smoothing,
        kv_cache=recipe.kv_cache,
        attention_class=attn_class,
        decoder_layers=[lp.layer for lp in structure.layers],
        structure_rule=structure.rule,
        roles={r: len(names) for r, names in structure.roles.items()},
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
