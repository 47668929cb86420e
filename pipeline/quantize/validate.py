"""A recipe held against a concrete model's module tree (a meta-device model is enough).

Each group claims modules by role (pipeline/model/roles.py) and/or by target. Every
failure is a RecipeError (exit 2) naming the recipe file, the field and the fix: a role or
target that matches nothing on this model (an experts group on a dense model, say),
overlapping groups, a Linear matched by no group (unless `others: keep`), a quantizing
group that claims a module that is not a Linear, a group size that divides no width
(`on_indivisible: error`), a recipe that quantizes nothing, an FP8 KV cache on a model
without attention, fp16 chosen for a Gemma model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import RecipeError
from ..model.matching import matches
from ..model.roles import Structure, resolve
from ..recipe import Group, Recipe

MIN_FALLBACK_GROUP = 32


@dataclass
class Claims:
    """What each Linear module got: its group (None: kept under `others: keep`), the group
    size it is quantized with when the recipe's does not divide it, and the structure."""

    owner: dict[str, str | None]
    group_size: dict[str, int | None] = field(default_factory=dict)  # fallbacks only
    structure: Structure | None = None


def fallback_group_size(width: int, wanted: int) -> int | None:
    """The largest group size below `wanted`, at least 32, that divides `width`; None:
    one scale per output channel."""
    g = wanted - 1
    while g >= MIN_FALLBACK_GROUP:
        if width % g == 0 and g & (g - 1) == 0:  # powers of two, as kernels expect
            return g
        g -= 1
    return None


def _claimed(g: Group, gi: int, modules: dict[str, Any], roles: dict[str, list[str]],
             path: str, model_name: str) -> list[str]:  # fmt: skip
    # a role may be absent from a model (experts on a dense one): the group as a whole must
    # claim something; an explicit target must match (a typo would silently claim nothing)
    names = [n for role in g.roles for n in roles.get(role, [])]
    if g.roles and not names and not g.targets:
        raise RecipeError(
            f"field `groups[{gi}].roles`: roles {g.roles} of group {g.name!r} match no module "
            f"of this model ({model_name})",
            path=path,
            hint="delete the group (an `experts` or `router` group fits only Mixture-of-Experts "
            "models), or use a recipe written for this model",
        )
    for ti, t in enumerate(g.targets):
        hits = [n for n, m in modules.items() if matches(n, m, [t])]
        if not hits:
            linear = [n for n, m in modules.items() if type(m).__name__ == "Linear"]
            raise RecipeError(
                f"field `groups[{gi}].targets[{ti}]`: target {t!r} of group {g.name!r} "
                f"matches no module of this model ({model_name})",
                path=path,
                hint=f"fix or delete the target; module names look like {', '.join(linear[:3])}"
                " (regexes need the 're:' prefix and are matched from the start of the name),"
                " or claim modules by `roles`",
            )
        names += hits
    for ei, t in enumerate(g.exclude):
        out = {n for n in names if matches(n, modules[n], [t])}
        if not out:
            raise RecipeError(
                f"field `groups[{gi}].exclude[{ei}]`: {t!r} excludes nothing group {g.name!r} "
                "claims",
                path=path,
                hint="fix or delete it: exclude takes module names, class names or 're:' "
                "regexes among the group's own modules",
            )
        names = [n for n in names if n not in out]
    return list(dict.fromkeys(names))


def validate_for_model(recipe: Recipe, model: Any, structure: Structure | None = None) -> Claims:
    """Check `recipe` against `model`; return what every Linear module is claimed by."""
    import torch

    path = recipe.path
    cfg = getattr(model, "config", None)
    model_type = str(getattr(cfg, "model_type", "") or "")
    arch = type(model).__name__
    if recipe.dtype == "float16" and model_type.startswith("gemma"):
        raise RecipeError(
            f"field `dtype`: float16 chosen for a Gemma model ({model_type}); Gemma's "
            "activations overflow float16",
            path=path,
            hint="set `dtype: bfloat16`",
        )
    if recipe.kv_cache is None and not any(g.quantizes for g in recipe.groups):
        raise RecipeError(
            "field `groups`: every group keeps its modules in 16-bit and there is no "
            "kv_cache: the recipe quantizes nothing",
            path=path,
            hint="give a group method awq, gptq or rtn with a scheme",
        )
    structure = structure or resolve(model)
    modules = {n: m for n, m in model.named_modules() if n}
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    claims = Claims(owner={}, structure=structure)
    for gi, g in enumerate(recipe.groups):
        for n in _claimed(g, gi, modules, structure.roles, path, arch):
            m = modules[n]
            if not isinstance(m, torch.nn.Linear):
                if g.quantizes:
                    raise RecipeError(
                        f"field `groups[{gi}]`: group {g.name!r} ({g.method}) claims {n} "
                        f"({type(m).__name__}), which is not a Linear module",
                        path=path,
                        hint="only Linear weights are quantized: give this group `method: "
                        "none`, or anchor its targets on Linear modules (end a regex with "
                        "'q_proj$')",
                    )
                continue
            if n in claims.owner:
                raise RecipeError(
                    f"field `groups`: groups {claims.owner[n]!r} and {g.name!r} overlap: "
                    f"module {n} is claimed by both",
                    path=path,
                    hint=f"narrow {claims.owner[n]!r} or {g.name!r} so every module belongs to "
                    "exactly one group (llm-compressor would silently let the later one win)",
                )
            claims.owner[n] = g.name
            _check_width(g, gi, n, m.in_features, claims, path)
    widths = {modules[n].in_features for n in linear}
    for gi, g in enumerate(recipe.groups):
        gs = g.scheme.group_size if g.scheme and not g.scheme.w4a8 else None
        if gs and not any(w % gs == 0 for w in widths):  # a typo, not an odd width: refuse
            raise RecipeError(
                f"field `groups[{gi}].scheme.group_size`: group size {gs} of group {g.name!r} "
                f"divides none of this model's Linear input widths {sorted(widths)}",
                path=path,
                hint=f"choose a group size that divides them (e.g. "
                f"{fallback_group_size(min(widths), 1024) or 'null for per-channel'})",
            )
    missing = [n for n in linear if n not in claims.owner]
    if missing and recipe.others == "error":
        raise RecipeError(
            f"field `groups`: Linear module {missing[0]} is claimed by no group"
            + (f" ({len(missing)} modules unclaimed)" if len(missing) > 1 else ""),
            path=path,
            hint="add it to a group (`method: none` keeps it 16-bit), or set `others: keep`",
        )
    for n in missing:
        claims.owner[n] = None
    if recipe.kv_cache is not None and not structure.roles["attention"]:
        raise RecipeError(
            f"field `kv_cache`: this model ({arch}) has no attention block whose KV cache "
            "could be quantized",
            path=path,
            hint="set `kv_cache: null`",
        )
    return claims


def _check_width(g: Group, gi: int, name: str, width: int, claims: Claims, path: str) -> None:
    s = g.scheme
    if s is None or not s.group_size or width % s.group_size == 0:
        return
    if s.w4a8:  # its kernel's width rule has no fallback: the serving check's to refuse
        return
    if s.on_indivisible == "fallback":
        claims.group_size[name] = fallback_group_size(width, s.group_size)
        return
    fb = fallback_group_size(width, s.group_size)
    raise RecipeError(
        f"field `groups[{gi}].scheme.group_size`: group size {s.group_size} of group "
        f"{g.name!r} does not divide the input width {width} of module {name}",
        path=path,
        hint=f"choose a group size that divides {width} ({fb or 'null for per-channel'}), or "
        "set `on_indivisible: fallback` beside it (the largest group size that divides each "
        "such module, else per-channel)",
    )
