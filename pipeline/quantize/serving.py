"""What the serving target runs fast, checked before any compute (recipe `target`).

vLLM 0.26's compressed-tensors schemes (model_executor/layers/quantization/compressed_tensors)
pick a kernel per Linear from its weight and activation formats and the GPU:

    W4A16 / W8A16 int       Machete (sm90) or Marlin: any GPU from sm80
    INT8 W8A8               CUTLASS int8: weights per channel (or tensor), activations per
                            token (dynamic) or per tensor (static); no weight groups
    FP8 W8A8                CUTLASS FP8 on sm89+ (weights per channel / tensor; 128x128
                            blocks with activations per 128-group); on sm80 the weights run
                            weight-only through Marlin (no FP8 speed-up: flagged)
    W4A8-FP8                CUTLASS W4A8, sm90 only: symmetric int4 at group 128, FP8
                            activations per token, both widths divisible by 128, bf16 output
    W4A8-INT8               CPU only in vLLM: refused for a GPU target
    FP4 (NVFP4, MXFP4)      not written by qship (the recipe schema says why)

A combination the target cannot run is refused (exit 2) naming the recipe field and the fix;
one it runs without the speed the format exists for is listed in the plan's notes. That a
fused set (q/k/v, gate/up) has one scheme, activations included, is plan.check_fused's.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import RecipeError
from ..recipe import Recipe
from ..records.plan import ModulePlan

SM = {"sm80": 80, "sm89": 89, "sm90": 90, "sm100": 100}


def _refuse(recipe: Recipe, gi: int, field: str, msg: str, hint: str) -> RecipeError:
    g = recipe.groups[gi]
    return RecipeError(
        f"field `groups[{gi}].scheme.{field}` (group {g.name!r}): {msg} "
        f"(target {recipe.target.engine} on {recipe.target.gpu})",
        path=recipe.path,
        hint=hint,
    )


def check_target(modules: list[ModulePlan], recipe: Recipe) -> list[str]:
    """Refuse (RecipeError) what `recipe.target` cannot run; return notes for what it runs
    slower than the format promises."""
    sm = SM[recipe.target.gpu]
    notes: list[str] = []
    index = {g.name: i for i, g in enumerate(recipe.groups)}
    seen: set[str] = set()
    for m in modules:
        s = m.scheme
        if s is None or m.group not in index:
            continue
        gi, a = index[m.group], s.activations
        if s.type == "int" and a is not None and a.type == "int" and s.bits == 4:
            raise _refuse(recipe, gi, "activations", "int4 weights with INT8 activations "
                          "(W4A8-INT8) run on CPUs only in vLLM",
                          "use FP8 activations (preset W4AFP8) on Hopper, or W4A16")  # fmt: skip
        if s.type == "int" and a is not None and s.bits == 4:
            _check_w4a8(m, recipe, gi, sm, [x for x in modules if x.group == m.group])
        if s.type == "int" and a is not None and s.bits == 8:
            if s.strategy == "group":
                raise _refuse(recipe, gi, "group_size", "INT8 W8A8 weights with groups: vLLM's "
                              "int8 kernels take one scale per channel or per tensor",
                              "set group_size: null (per channel), as preset W8A8 does")  # fmt: skip
            if a.strategy == "group":
                raise _refuse(recipe, gi, "activations.strategy", "INT8 activations per "
                              "group: vLLM's int8 kernels scale per token or per tensor",
                              "use strategy token (dynamic), as preset W8A8 does")  # fmt: skip
        if s.type == "float" and a is not None:
            if s.strategy == "block" and (s.block != [128, 128] or a.strategy != "group"
                                          or a.group_size != 128):  # fmt: skip
                raise _refuse(recipe, gi, "block", "vLLM's block FP8 kernels take 128x128 "
                              "weight blocks with activations per 128-value group",
                              "use preset FP8_BLOCK")  # fmt: skip
            if s.strategy != "block" and a.strategy == "group":
                raise _refuse(recipe, gi, "activations.strategy", "FP8 activations per group "
                              "go with 128x128 block weights only", "use preset FP8_BLOCK, "
                              "or activations per token (FP8_DYNAMIC)")  # fmt: skip
        if s.type == "float" and sm < 89 and m.group not in seen:
            seen.add(m.group)
            notes.append(f"group {m.group!r}: FP8 on {recipe.target.gpu} has no FP8 tensor "
                         "cores: vLLM runs the weights weight-only (Marlin), activations 16-bit")  # fmt: skip
    return notes


def _check_w4a8(m: ModulePlan, recipe: Recipe, gi: int, sm: int, group: list[ModulePlan]) -> None:
    """W4A8-FP8's rules, the model's widths first: no recipe field can make vLLM's kernel
    serve a width 128 does not divide, so that refusal names the formats that can."""
    s = m.scheme
    assert s is not None and s.activations is not None
    fix = "use preset W4AFP8 (symmetric int4, group 128, FP8 per-token activations)"
    if sm != 90:
        raise _refuse(recipe, gi, "activations", "W4A8-FP8 runs on Hopper (sm90) only "
                      "(vLLM's CUTLASS W4A8 kernel)", "serve W4A16 there, or FP8_DYNAMIC "
                      "on sm89/sm100")  # fmt: skip
    if m.in_features % 128 or m.out_features % 128:
        g = w4a16_group_size(x.in_features for x in group)
        w4a16 = f"{{preset: W4A16, group_size: {g}}}" if g else "{preset: W4A16, group_size: null}"
        raise _refuse(recipe, gi, "preset", f"W4A8-FP8 cannot serve this model: {m.name} is "
                      f"{m.out_features} x {m.in_features}, and vLLM's W4A8 kernel needs both "
                      "widths divisible by 128 (no group size or fallback changes that)",
                      f"serve it as W4A16, scheme {w4a16} (recipes/gptq-w4.yaml), or as FP8 "
                      "W8A8, preset FP8_DYNAMIC (recipes/fp8-dynamic.yaml); or keep the "
                      "modules 128 does not divide, and their fused sets, in a W4A16 group")  # fmt: skip
    if not s.symmetric:
        raise _refuse(recipe, gi, "symmetric", "W4A8-FP8 takes no zero points", fix)
    if s.group_size != 128:
        raise _refuse(recipe, gi, "group_size", f"W4A8-FP8 runs at group size 128 only, "
                      f"{m.name} has {s.group_size or 'per-channel'}", fix)  # fmt: skip
    if s.activations.strategy != "token" or not s.activations.dynamic:
        raise _refuse(recipe, gi, "activations.strategy", "W4A8-FP8 rounds activations "
                      "per token, dynamically", fix)  # fmt: skip
    if recipe.dtype != "bfloat16":
        raise RecipeError(f"field `dtype`: W4A8-FP8 writes bfloat16 outputs only, the recipe "
                          f"has {recipe.dtype}", path=recipe.path, hint="set dtype: bfloat16")  # fmt: skip


def w4a16_group_size(widths: Iterable[int], largest: int = 128) -> int | None:
    """The largest power-of-two group size up to `largest` (at least 32) that divides every
    input width, or None (per channel)."""
    g = largest
    ws = list(widths)
    while g >= 32 and any(w % g for w in ws):
        g //= 2
    return g if g >= 32 else None


def check_lengths(recipe: Recipe, max_positions: int | None) -> None:
    """Exit 2 for a length the model cannot take, beyond its context (config.json
    max_position_embeddings), before any compute: a calibration or held-out window, a
    long-context trial, a served-performance workload."""
    if isinstance(max_positions, int) and max_positions > 0:
        for field in ("calibration", "evaluation"):
            n = getattr(recipe, field).seq_len
            if n > max_positions:
                raise RecipeError(f"field `{field}.seq_len`: {n}-token windows are longer than "
                                  f"the model's context of {max_positions} tokens",
                                  path=recipe.path, hint=f"set {field}.seq_len to at most "
                                  f"{max_positions}")  # fmt: skip
    lc = recipe.serve.long_context if recipe.serve is not None else None
    long = lc.beyond(max_positions) if lc is not None else None
    if long is not None:
        raise RecipeError(
            f"field `serve.long_context.lengths[{long[0]}]`: a {long[1]}-token trial is longer "
            f"than the model's context of {max_positions} tokens",
            path=recipe.path,
            hint=f"list lengths up to {max_positions}, or 'max' for the model's longest",
        )
    if recipe.serve is None or "workloads" not in recipe.serve.model_fields_set:
        return  # the default workloads are checked when performance is measured
    bad = recipe.serve.overlong(max_positions)
    if bad is not None:
        i, w = bad
        raise RecipeError(
            f"field `serve.workloads[{i}]` ({w.name}): prompt_len {w.prompt_len} + "
            f"output_len {w.output_len} exceeds the model's context of {max_positions} tokens",
            path=recipe.path,
            hint="shorten the workload (config.json max_position_embeddings is the limit)",
        )
