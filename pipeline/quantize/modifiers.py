"""The plan as llm-compressor modifiers (one calibration pass, sequential pipeline), in order:

  SmoothQuantModifier with the plan's applied norm mappings (recipe `smoothquant`)
  AWQModifier (transform only) per option set of the smoothed groups (method awq, and gptq
    with `awq_scales`), with the plan's applied mappings
  QuantizationModifier: config groups of the AWQ and RTN modules (+ the FP8 KV scheme)
  GPTQModifier per GPTQ option set: config groups of its modules
  AutoRoundModifier (mended: autoround_modifier.py) per AutoRound option set: config groups
    of its modules

AWQ only scales; the quantizing modifier after it (RTN or GPTQ) reads the scheme it searched
the scales for. The FP8 KV scheme goes with the QuantizationModifier or the first GPTQ one.

Config-group targets come from the plan's exact module sets (model.matching.compact_targets:
one regex per group when that is exact), so what llm-compressor quantizes is what the plan
says, also for roles and for modules whose group size fell back. `none` modules are matched
by no group and stay in the recipe's dtype.
"""

from __future__ import annotations

from typing import Any

from ..model.matching import compact_targets
from ..recipe import Recipe
from ..records.plan import ModuleScheme, Plan
from .autoround_modifier import autoround_modifier_class


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


def _option_sets(recipe: Recipe, plan: Plan, method: str) -> dict[str, list[str]]:
    """{options: group names} of the groups with `method` ("smoothed": AWQ's scales)."""
    present = {m.group for m in plan.modules}
    sets: dict[str, list[str]] = {}
    for g in recipe.groups:
        hit = g.smoothed if method == "smoothed" else g.method == method
        if hit and g.name in present:
            sets.setdefault(g.method + g.options.model_dump_json(), []).append(g.name)
    return sets


def build_modifiers(plan: Plan, recipe: Recipe) -> list[Any]:
    """The llm-compressor modifiers for this plan (see the module docstring)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

    groups = {g.name: g for g in recipe.groups}
    kv = None
    query = None
    if recipe.kv_cache is not None:
        kv = QuantizationArgs(num_bits=8, type="float", strategy=recipe.kv_cache.strategy,
                              dynamic=False, symmetric=True)  # fmt: skip
        if recipe.kv_cache.query and plan.attention_class:
            from compressed_tensors.quantization import QuantizationScheme

            # attention quantization: the query's scale calibrated beside K and V; one class
            # name as target, which vLLM recognises and leaves to its KV-cache method
            query = QuantizationScheme(targets=[plan.attention_class], input_activations=kv)
    owner = {m.name: m.group for m in plan.modules}
    mods: list[Any] = []
    sq = [[list(mp.balance), mp.smooth] for mp in plan.smoothquant if mp.applied]
    if recipe.smoothquant is not None and sq:
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        mods.append(SmoothQuantModifier(smoothing_strength=recipe.smoothquant.strength,
                                        mappings=sq))  # fmt: skip
    for names in _option_sets(recipe, plan, "smoothed").values():
        opts = groups[names[0]].options
        maps = [AWQMapping(mp.smooth, list(mp.balance)) for mp in plan.applied_mappings()
                if owner.get(mp.balance[0]) in names]  # fmt: skip
        kw: dict[str, Any] = {"mappings": maps}
        if opts.n_grid is not None:
            kw["n_grid"] = opts.n_grid
        if opts.duo_scaling is not None:
            kw["duo_scaling"] = opts.duo_scaling
        # AWQ caches every batch's layer inputs for its grid search; in CPU memory they cost
        # a transfer per grid point (+24 % time on an 8B for 0.3 GB less peak GPU memory)
        if opts.offload_cache is not None:
            kw["offload_device"] = torch.device("cpu") if opts.offload_cache else None
        if maps:
            mods.append(AWQModifier(**kw))

    rtn_awq = [g.name for g in recipe.groups if g.method in ("awq", "rtn")]
    qm_groups = config_groups(plan, rtn_awq)
    gptq_sets = _option_sets(recipe, plan, "gptq")
    ar_sets = _option_sets(recipe, plan, "autoround")
    # AutoRound cannot carry the KV scheme (it takes every scheme it holds for a weight's)
    if query is not None:
        name = "attention_query"
        while name in qm_groups:  # a recipe group of that name keeps its own scheme
            name += "_"
        qm_groups = {**qm_groups, name: query}
    if qm_groups or (kv is not None and not gptq_sets):
        # targets=[]: the config groups name their own targets; the modifier's default
        # ("Linear") is used only when there are none (the KV scheme alone, beside
        # AutoRound), as a group on every Linear, the head included, for which
        # llm-compressor unties a tied embedding (Gemma 3 270M: 724 MB stored for 389 planned)
        mods.append(QuantizationModifier(config_groups=qm_groups, kv_cache_scheme=kv, targets=[]))
        kv = None
    for names in gptq_sets.values():
        opts = groups[names[0]].options
        kw = {"config_groups": config_groups(plan, names)}
        if opts.dampening_frac is not None:
            kw["dampening_frac"] = opts.dampening_frac
        if opts.actorder is not None:
            kw["actorder"] = opts.actorder
        if opts.block_size is not None:
            kw["block_size"] = opts.block_size
        if kv is not None:
            kw["kv_cache_scheme"], kv = kv, None
        mods.append(GPTQModifier(**kw))
    for names in ar_sets.values():
        opts = groups[names[0]].options
        # AutoRound's batch must be the pipeline's (a larger calibration batch makes
        # auto-round take the sequence for the batch axis and exit the process)
        kw = {"config_groups": config_groups(plan, names),
              "batch_size": recipe.calibration.batch_size}  # fmt: skip
        if opts.iters is not None:
            kw["iters"] = opts.iters
        # torch.compile of the tuning loop needs a compiler toolchain on the machine; the
        # loop is a small share of the time on models qship calibrates layer by layer
        mods.append(autoround_modifier_class()(enable_torch_compile=False, **kw))
    return mods
