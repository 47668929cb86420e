"""A recipe checked against a concrete model's module tree (the meta model is enough).

Every failure is a RecipeError (exit 2) naming the recipe file, the field and the fix:
a target that matches no module, overlapping groups, a Linear matched by no group, a
quantizing group that targets a non-Linear module, a group size that does not divide a
module's input width, a recipe that quantizes nothing, an FP8 KV cache on a model without
k_proj/v_proj, fp16 chosen for a Gemma model.
"""

from __future__ import annotations

from typing import Any

from ..errors import RecipeError
from ..model.matching import matches
from ..recipe import Recipe


def validate_for_model(recipe: Recipe, model: Any) -> dict[str, str]:
    """Check `recipe` against `model`; return {Linear module name: group name}."""
    import torch

    path = recipe.path
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    if recipe.dtype == "float16" and model_type.startswith("gemma"):
        raise RecipeError(
            f"field `dtype`: float16 chosen for a Gemma model ({model_type}); Gemma's "
            "activations overflow float16",
            path=path,
            hint="set `dtype: bfloat16`",
        )
    if recipe.kv_cache is None and all(g.method == "none" for g in recipe.groups):
        raise RecipeError(
            "field `groups`: every group keeps its modules in 16-bit and there is no "
            "kv_cache: the recipe quantizes nothing",
            path=path,
            hint="give a group method awq, gptq or rtn with a scheme",
        )
    modules = [(n, m) for n, m in model.named_modules() if n]
    linear_names = [n for n, m in modules if isinstance(m, torch.nn.Linear)]
    owner: dict[str, str] = {}
    for gi, g in enumerate(recipe.groups):
        for ti, t in enumerate(g.targets):
            hits = [n for n, m in modules if matches(n, m, [t])]
            if not hits:
                sample = ", ".join(linear_names[:3])
                raise RecipeError(
                    f"field `groups[{gi}].targets[{ti}]`: target {t!r} of group {g.name!r} "
                    f"matches no module of this model",
                    path=path,
                    hint=f"fix or delete the target; module names look like {sample}"
                    " (regexes need the 're:' prefix and are matched from the start of the name)",
                )
            if g.method != "none":
                bad = [(n, type(m).__name__) for n, m in modules
                       if n in hits and not isinstance(m, torch.nn.Linear)]  # fmt: skip
                if bad:
                    n, cls = bad[0]
                    raise RecipeError(
                        f"field `groups[{gi}].targets[{ti}]`: target {t!r} of group {g.name!r} "
                        f"matches {n} ({cls}), which is not a Linear module",
                        path=path,
                        hint="anchor the regex on Linear modules (e.g. end it with 'q_proj$'); "
                        "only Linear weights are quantized",
                    )
        for n, m in modules:
            if not isinstance(m, torch.nn.Linear) or not matches(n, m, g.targets):
                continue
            if n in owner:
                raise RecipeError(
                    f"field `groups`: groups {owner[n]!r} and {g.name!r} overlap: module {n} "
                    f"is matched by both",
                    path=path,
                    hint=f"narrow the targets of {owner[n]!r} or {g.name!r} so every module "
                    "belongs to exactly one group (llm-compressor would silently let the later one win)",
                )
            owner[n] = g.name
            if g.scheme is not None and g.scheme.group_size:
                width = m.in_features
                if width % g.scheme.group_size:
                    raise RecipeError(
                        f"field `groups[{gi}].scheme.group_size`: group size "
                        f"{g.scheme.group_size} of group {g.name!r} does not divide the input "
                        f"width {width} of module {n}",
                        path=path,
                        hint=f"choose a group size that divides {width} (e.g. "
                        f"{_divisor_hint(width, g.scheme.group_size)}) or null for per-channel",
                    )
    missing = [n for n in linear_names if n not in owner]
    if missing:
        raise RecipeError(
            f"field `groups`: Linear module {missing[0]} is matched by no group"
            + (f" ({len(missing)} modules unmatched)" if len(missing) > 1 else ""),
            path=path,
            hint="add it to a group; use a group with `method: none` to keep it in 16-bit "
            "(lm_head is usually kept that way)",
        )
    if recipe.kv_cache is not None:
        has_kv = any(n.endswith("k_proj") for n in linear_names) and any(
            n.endswith("v_proj") for n in linear_names
        )
        if not has_kv:
            raise RecipeError(
                "field `kv_cache`: this model has no k_proj/v_proj modules to quantize the KV cache at",
                path=path,
                hint="set `kv_cache: null`",
            )
    return owner


def _divisor_hint(width: int, gs: int) -> str:
    for cand in (128, 64, 32, 256, 16):
        if width % cand == 0 and cand != gs:
            return str(cand)
    return "null"
