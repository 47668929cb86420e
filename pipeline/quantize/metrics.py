"""What llm-compressor measures while it calibrates, captured as it happens: GPTQ's
per-module error, AWQ's per-mapping loss reduction, and the time (and CUDA peak) of each
decoder layer of the sequential pipeline, which also drives the progress bar."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import log
from ..compat.llmcompressor_0_14 import awq_results, observing_calibration
from ..records.checkpoint import AwqMappingResult, LayerTime
from ..records.plan import Plan
from .resume import LayerStore


@dataclass
class Captured:
    gptq: dict[str, float] = field(default_factory=dict)
    awq: list[AwqMappingResult] = field(default_factory=list)
    layers: list[LayerTime] = field(default_factory=list)
    # MoE: calibration tokens each expert received (the propagation pass after a layer is
    # compressed is not counted)
    expert_tokens: dict[str, int] = field(default_factory=dict)


def _count_expert_tokens(model: Any, layers: list[str], got: Captured, done: set[str]) -> list[Any]:
    """Count calibration tokens per expert (layers in `done` -- finished or loaded -- not)."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    hooks = []
    for name, mod in model.named_modules():
        if not isinstance(mod, LinearExperts2D):
            continue
        layer = next((lay for lay in layers if name.startswith(lay + ".")), name)
        for i in range(mod.num_experts):
            path = f"{name}.{i}"
            got.expert_tokens[path] = 0

            def count(_m: Any, args: Any, path: str = path, layer: str = layer) -> None:
                if layer not in done and args and hasattr(args[0], "shape"):
                    got.expert_tokens[path] += int(args[0].reshape(-1, args[0].shape[-1]).shape[0])

            hooks.append(mod[i].register_forward_pre_hook(count))
    return hooks


def _awq_result(m: dict[str, Any]) -> AwqMappingResult:
    return AwqMappingResult(
        smooth=m.get("layer_name"),
        parent=m.get("parent_name"),
        initial_error=float(m.get("initial_error", 0.0)),
        best_error=float(m.get("best_error", 0.0)),
        loss_reduction=1.0 - float(m.get("reduction", 1.0)),
    )


def _of_layer(layer: str, got: Captured) -> dict[str, Any]:
    """What was measured on one decoder layer (stored with it for a resumed run). AWQ logs
    its results only when it finishes: they are read from the modifier as they are now."""
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.transform.awq import AWQModifier

    p = layer + "."
    awq = [_awq_result(m) for mod in active_session().lifecycle.recipe.modifiers
           if isinstance(mod, AWQModifier) for m in awq_results(mod)]  # fmt: skip
    return {
        "gptq": {k: v for k, v in got.gptq.items() if k.startswith(p)},
        "awq": [a.to_json() for a in awq if (a.smooth or "").startswith(p)],
        "expert_tokens": {k: v for k, v in got.expert_tokens.items() if k.startswith(p)},
    }


@contextlib.contextmanager
def capture_metrics(
    model: Any,
    plan: Plan,
    on_layer: Callable[[str, int], None] | None = None,
    store: LayerStore | None = None,
) -> Iterator[Captured]:
    """`store`: each finished layer is saved there; a layer it restored is not calibrated
    (its epoch end is skipped) and keeps what was measured when it was."""
    names = {id(m): n for n, m in model.named_modules()}
    layers = set(plan.decoder_layers)
    got = Captured()
    # decoder layers whose calibration pass is over, or which are loaded, not calibrated
    done: set[str] = {d for d in plan.decoder_layers if store and store.is_restorable(d)}
    counters = _count_expert_tokens(model, plan.decoder_layers, got, done)
    t_last = [time.perf_counter()]
    bar = log.Progress("calibrate", len(plan.decoder_layers), unit="layers")

    def gptq_loss(module: Any, loss: float) -> None:
        got.gptq[names.get(id(module), "?")] = loss

    def awq_done(metrics: list[dict[str, Any]]) -> None:
        got.awq.extend(_awq_result(m) for m in metrics)

    def epoch_end(modules: list[Any], run: Callable[[], Any]) -> Any:
        layer = next((names.get(id(m)) for m in modules if names.get(id(m)) in layers), None)
        out = None
        if layer is not None and store is not None and layer in store.restored:
            m = store.measured[layer]  # loaded, not calibrated: no event for the modifiers
            got.gptq.update(m["gptq"])
            got.awq.extend(AwqMappingResult.model_validate(a) for a in m["awq"])
            got.expert_tokens.update(m["expert_tokens"])
        else:
            out = run()
            if layer is not None and store is not None:
                store.save(layer, model.get_submodule(layer), _of_layer(layer, got))
        now = time.perf_counter()
        layer = layer or f"subgraph {len(got.layers) + 1} (no decoder layer)"
        done.add(layer)
        cuda = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
        got.layers.append(
            LayerTime(layer=layer, seconds=round(now - t_last[0], 3), cuda_max_allocated_bytes=cuda)
        )
        t_last[0] = now
        n = sum(1 for r in got.layers if r.layer in layers)
        log.detail(f"[{n}/{len(layers)} layers] {layer} done in {got.layers[-1].seconds:.2f} s")
        bar.update(n, layer)
        if on_layer is not None:
            on_layer(layer, n)
        return out

    with observing_calibration(gptq_loss, awq_done, epoch_end), bar:
        try:
            yield got
        finally:
            for h in counters:
                h.remove()
