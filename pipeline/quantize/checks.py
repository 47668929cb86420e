"""The checks a saved checkpoint passes before quantize returns it (else StageError, exit 1,
and the half-made output folder is removed):

1. the shared checkpoint validator (pipeline.model.checkpoint: headers, shapes, packed
   tensors vs their config group, finite positive scales, KV scales);
2. every Linear module was saved with exactly its planned scheme (llm-compressor renames
   groups to group_0.. and lets a later modifier silently win on overlapping targets);
3. transformers reloads it and gives finite logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import StageError
from ..model.checkpoint import CheckpointInspection, inspect_checkpoint
from ..model.loading import load_model
from ..model.moe import reads_per_expert
from ..recipe import CALIBRATED_METHODS, Recipe
from ..records.plan import Plan

HINT = "report this as a bug with the recipe; the checkpoint was not kept"


def check_saved(out_dir: Path, plan: Plan) -> CheckpointInspection:
    insp = inspect_checkpoint(out_dir, error=StageError, hint=HINT)
    check_against_plan(insp, plan, where=str(Path(out_dir) / "config.json"))
    return insp


# what the saved files may exceed the plan's size by: headers, metadata, KV scales' rounding
SIZE_SLACK = 0.15
SIZE_SLACK_BYTES = 1 << 20


def check_against_plan(insp: CheckpointInspection, plan: Plan, *, where: str) -> None:
    want = plan.expected_checkpoint_bytes
    if insp.bytes > want * (1 + SIZE_SLACK) + SIZE_SLACK_BYTES:
        raise StageError(
            f"the checkpoint is {insp.bytes / 1e6:.1f} MB, the plan predicted "
            f"{want / 1e6:.1f} MB: something is stored that the plan did not count (a "
            "tensor twice, an embedding untied from the head)",
            path=where,
            hint=HINT,
        )
    for mp in plan.modules:
        got = insp.schemes.get(mp.name)
        if mp.scheme is None and got is not None:
            raise StageError(
                f"module {mp.name} was planned to stay {plan.dtype} but is saved as {got.label()}",
                path=where,
                hint="a modifier matched a module outside its group; " + HINT,
            )
        if mp.scheme is not None and got != mp.scheme:
            saved = got.label() if got else "unquantized"
            raise StageError(
                f"module {mp.name}: saved scheme {saved} differs from the planned "
                f"{mp.scheme.label()} (group {mp.group})",
                path=where,
                hint="llm-compressor silently overrode the scheme; " + HINT,
            )
    if insp.kv_cache != (plan.kv_cache is not None):
        raise StageError(
            f"the saved kv_cache_scheme is {'set' if insp.kv_cache else 'absent'} but the plan "
            f"has {plan.kv_cache}",
            path=where,
            hint=HINT,
        )


def check_expert_tokens(
    counts: dict[str, int], plan: Plan, recipe: Recipe, model_dir: Path
) -> None:
    """Every expert whose rounding depends on data (GPTQ, AWQ) received at least
    `calibration.min_expert_tokens` calibration tokens: an expert the router never chose
    would otherwise be saved with scales from no data (NaN or zero)."""
    need = recipe.calibration.min_expert_tokens
    data = {m.name.rsplit(".", 1)[0] for m in plan.modules if m.role == "experts"
            and m.method in CALIBRATED_METHODS}  # fmt: skip
    starved = sorted(((n, c) for n, c in counts.items() if n in data and c < need),
                     key=lambda nc: (nc[1], nc[0]))  # the emptiest first  # fmt: skip
    if starved:
        shown = ", ".join(f"{n} ({c})" for n, c in starved[:5])
        raise StageError(
            f"{len(starved)} expert(s) received fewer than {need} calibration tokens: {shown}"
            + (" …" if len(starved) > 5 else ""),
            path=str(model_dir),
            hint="calibrate every expert on every token (`calibration.all_experts: true`, the "
            "default), add calibration samples, or lower `calibration.min_expert_tokens`",
        )


def verify_reload(
    out_dir: Path,
    probe_ids: torch.Tensor,
    device: str = "cpu",
    *,
    offload: str = "none",
) -> int:
    """Reload with transformers (on `device`, weights where `offload` says) and check the
    logits are finite; returns the number of probe tokens."""
    probe_ids = probe_ids.to(device)
    # a packed checkpoint is a quarter of the dense size: host memory suffices (and
    # accelerate's disk offload narrows packed int32 zero points to int8)
    # one probe forward: pageable host copies (pinning them costs time and host memory)
    # offloaded, an MoE's experts are read as Linear modules where they can be, so that
    # each is decompressed as the forward reaches it: transformers' fused experts are
    # decompressed whole on load (16 Qwen3-30B-A3B-dims layers: 36.8 GB of host memory
    # in the check, 1.74x the weights, H100 2026-12-06)
    try:
        how: dict[str, Any] = {
            "device": device,
            "offload": "cpu" if offload == "disk" else offload,
            "pin": False,
            "linear_experts": offload != "none" and reads_per_expert(out_dir),
        }
        m = load_model(out_dir, **how)
    except Exception as e:  # noqa: BLE001
        raise StageError(
            f"transformers cannot reload the checkpoint: {e}", path=str(out_dir)
        ) from e
    with torch.no_grad(), decompressed_per_module(m):
        logits = m(input_ids=probe_ids).logits
    if not torch.isfinite(logits).all():
        if offload != "none":  # the probe dropped the offloaded weights: load them again
            del m
            m = load_model(out_dir, **how)
        bad = _first_nonfinite_module(m, probe_ids)
        raise StageError(
            f"reloaded checkpoint gives non-finite logits (first non-finite output: {bad})",
            path=str(out_dir),
            hint="check that module's scheme; Gemma needs bf16, not fp16",
        )
    return int(probe_ids.numel())


@contextlib.contextmanager
def decompressed_per_module(model: Any) -> Iterator[None]:
    """For one forward of a packed checkpoint loaded with offloading: compressed-tensors
    decompresses every Linear into 16-bit weights before the first forward, so the host then
    holds the whole model packed and dense (the 8B-dims reload check's 1.34x the weights,
    H100 2026-12-05). Instead each quantized module is decompressed as the forward reaches
    it and its tensors dropped (to meta) once it has run: the model serves that one forward
    (a module called twice in one forward would find nothing; none of the supported
    architectures does that)."""
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is None:  # dense, or decompressed at load: nothing to save
        yield
        return
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.offload import from_accelerate
    from compressed_tensors.offload.utils import to_meta
    from compressed_tensors.quantization.utils import is_module_quantized

    hook.remove()
    del model.ct_decompress_hook
    from_accelerate(model)  # as ModelCompressor.decompress_model: compressed-tensors' offloading
    handles = []
    for mod in model.modules():
        if is_module_quantized(mod):
            handles.append(mod.register_forward_pre_hook(lambda m, _a: decompress_module(m)))
            handles.append(mod.register_forward_hook(lambda m, _a, _o: to_meta(m)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _first_nonfinite_module(model: Any, ids: torch.Tensor) -> str:
    found: list[str] = []
    hooks = []
    for n, mod in model.named_modules():

        def hook(_m, _i, out, n=n):
            t = out[0] if isinstance(out, tuple) else out
            if not found and isinstance(t, torch.Tensor) and not torch.isfinite(t).all():
                found.append(n)

        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else "?"
