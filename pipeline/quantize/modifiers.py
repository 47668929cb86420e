"""The plan as llm-compressor modifiers (one calibration pass, sequential pipeline), in order:

  SmoothQuantModifier with the plan's applied norm mappings (recipe `smoothquant`)
  AWQModifier (transform only) per option set of the smoothed groups (method awq, and gptq
    with `awq_scales`), with the plan's applied mappings
  QuantizationModifier: config groups of the modules of methods without a modifier of their
    own (AWQ, RTN) (+ the FP8 KV scheme)
  each method's own modifier (quantize/methods.py: ROUNDING, in its order) per option set:
    config groups of its modules -- GPTQModifier, then AutoRoundModifier (mended:
    autoround_modifier.py)

AWQ only scales; the quantizing modifier after it (RTN or GPTQ) reads the scheme it searched
the scales for. The FP8 KV scheme goes with the QuantizationModifier or the first modifier
that can carry it (GPTQ's).

Config-group targets come from the plan's exact module sets (model.matching.compact_targets:
one regex per group when that is exact), so what llm-compressor quantizes is what the plan
says, also for roles and for modules whose group size fell back. `none` modules are matched
by no group and stay in the recipe's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model.matching import compact_targets
from ..recipe import METHODS, Recipe
from ..records.plan import ModuleScheme, Plan
from .methods import ROUNDING


def qargs(scheme: ModuleScheme) -> dict[str, Any]:
    """compressed-tensors QuantizationArgs (as keyword arguments) for a weight scheme."""
    d: dict[str, Any] = {
        "num_bits": scheme.bits,
        "type": scheme.type,
        "symmetric": scheme.symmetric,
        "strategy": scheme.strategy,
        "dynamic": False,
    }
    if scheme.group_size:
        d["group_size"] = scheme.group_size
    if scheme.block:
        d["block_structure"] = list(scheme.block)
    if scheme.observer:
        d["observer"] = scheme.observer
    return d


def act_args(scheme: ModuleScheme) -> dict[str, Any] | None:
    """QuantizationArgs (as keyword arguments) for the input activations, or None."""
    a = scheme.activations
    if a is None:
        return None
    d: dict[str, Any] = {"num_bits": a.bits, "type": a.type, "symmetric": True,
                         "strategy": a.strategy, "dynamic": a.dynamic}  # fmt: skip
    if a.group_size:
        d["group_size"] = a.group_size
    if a.dynamic:
        d["observer"] = None  # scales are computed on the fly: nothing to calibrate
    return d


def config_groups(plan: Plan, groups: list[str]) -> dict[str, Any]:
    """{config group name: QuantizationScheme} for the plan's modules in `groups`: one per
    (recipe group, scheme) -- a group whose modules fell back to another group size splits."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    parts: dict[tuple[str, str], tuple[ModuleScheme, list[str]]] = {}
    for m in plan.modules:
        if m.scheme is not None and m.group in groups:
            key = (m.group, m.scheme.model_dump_json())
            parts.setdefault(key, (m.scheme, []))[1].append(m.name)
    universe = [m.name for m in plan.modules]
    out = {}
    for (group, _), (scheme, names) in parts.items():
        split = sum(1 for g, _ in parts if g == group) > 1
        name = f"{group}-g{scheme.group_size or 'ch'}" if split else group
        act = act_args(scheme)
        out[name] = QuantizationScheme(
            targets=compact_targets(names, universe),
            weights=QuantizationArgs(**qargs(scheme)),
            input_activations=QuantizationArgs(**act) if act else None,
            # set, not inferred: compressed-tensors would store W4A8-FP8 as int8 values
            format=scheme.saved_format(),
        )
    return out


def _option_sets(recipe: Recipe, plan: Plan, hit: Callable[[Any], bool]) -> dict[str, list[str]]:
    """{method and options: group names} of the planned groups for which `hit` holds."""
    present = {m.group for m in plan.modules}
    sets: dict[str, list[str]] = {}
    for g in recipe.groups:
        if hit(g) and g.name in present:
            sets.setdefault(g.method + g.options.model_dump_json(), []).append(g.name)
    return sets


def _is(method: str) -> Callable[[Any], bool]:
    return lambda g: g.method == method


def _kv_schemes(plan: Plan, recipe: Recipe) -> tuple[Any, Any]:
    """(the FP8 KV cache's QuantizationArgs, the query's QuantizationScheme), each or None."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if recipe.kv_cache is None:
        return None, None
    kv = QuantizationArgs(num_bits=8, type="float", strategy=recipe.kv_cache.strategy,
                          dynamic=False, symmetric=True)  # fmt: skip
    if not (recipe.kv_cache.query and plan.attention_class):
        return kv, None
    # attention quantization: the query's scale calibrated beside K and V; one class name
    # as target, which vLLM recognises and leaves to its KV-cache method
    return kv, QuantizationScheme(targets=[plan.attention_class], input_activations=kv)


def _smoothing(plan: Plan, recipe: Recipe) -> list[Any]:
    """SmoothQuant with the plan's applied mappings, then one AWQ transform per option set
    of the smoothed groups."""
    import torch
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

    mods: list[Any] = []
    sq = [[list(mp.balance), mp.smooth] for mp in plan.smoothquant if mp.applied]
    if recipe.smoothquant is not None and sq:
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        mods.append(SmoothQuantModifier(smoothing_strength=recipe.smoothquant.strength,
                                        mappings=sq))  # fmt: skip
    groups = {g.name: g for g in recipe.groups}
    owner = {m.name: m.group for m in plan.modules}
    for names in _option_sets(recipe, plan, lambda g: g.smoothed).values():
        # AWQ's own options (GPTQ's awq_scales groups take llm-compressor's defaults)
        opts = {k: getattr(groups[names[0]].options, k, None)
                for k in ("n_grid", "duo_scaling", "offload_cache")}  # fmt: skip
        maps = [AWQMapping(mp.smooth, list(mp.balance)) for mp in plan.applied_mappings()
                if owner.get(mp.balance[0]) in names]  # fmt: skip
        kw: dict[str, Any] = {"mappings": maps}
        kw.update({k: opts[k] for k in ("n_grid", "duo_scaling") if opts[k] is not None})
        # AWQ caches every batch's layer inputs for its grid search; in CPU memory they cost
        # a transfer per grid point (+24 % time on an 8B for 0.3 GB less peak GPU memory)
        if opts["offload_cache"] is not None:
            kw["offload_device"] = torch.device("cpu") if opts["offload_cache"] else None
        if maps:
            mods.append(AWQModifier(**kw))
    return mods


def build_modifiers(plan: Plan, recipe: Recipe) -> list[Any]:
    """The llm-compressor modifiers for this plan (see the module docstring): each method's
    part comes from quantize/methods.py's ROUNDING."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    groups = {g.name: g for g in recipe.groups}
    kv, query = _kv_schemes(plan, recipe)
    mods = _smoothing(plan, recipe)
    shared = [g.name for g in recipe.groups
              if METHODS[g.method].quantizes and ROUNDING[g.method].modifier is None]  # fmt: skip
    own = {method: _option_sets(recipe, plan, _is(method))
           for method, r in ROUNDING.items() if r.modifier is not None}  # fmt: skip
    qm_groups = config_groups(plan, shared)
    if query is not None:
        name = "attention_query"
        while name in qm_groups:  # a recipe group of that name keeps its own scheme
            name += "_"
        qm_groups = {**qm_groups, name: query}
    kv_elsewhere = any(sets and ROUNDING[m].carries_kv for m, sets in own.items())
    if qm_groups or (kv is not None and not kv_elsewhere):
        # targets=[]: the config groups name their own targets; the modifier's default
        # ("Linear") is used only when there are none (the KV scheme alone, beside
        # AutoRound), as a group on every Linear, the head included, for which
        # llm-compressor unties a tied embedding (Gemma 3 270M: 724 MB stored for 389 planned)
        mods.append(QuantizationModifier(config_groups=qm_groups, kv_cache_scheme=kv, targets=[]))
        kv = None
    for method, sets in own.items():
        build, carries_kv = ROUNDING[method].modifier, ROUNDING[method].carries_kv
        for names in sets.values():
            carried, kv = (kv, None) if carries_kv else (None, kv)
            if build is not None:
                opts = groups[names[0]].options
                mods.append(build(config_groups(plan, names), opts, recipe, carried))
    return mods
