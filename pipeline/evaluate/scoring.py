"""Running a model over held-out tokens: forward passes, the FP8 KV-cache switch, and the
one scorer of a loaded model against a cached reference (evaluate's cached mode, compare,
sensitivity).

The candidate runs as deployed: with its FP8 KV cache in the loop (compressed-tensors
hooks every attention module with a `QuantizedKVCache` that rounds K/V through e4m3 with
the stored scales, also with use_cache=False). Running it again with that rounding off
(`quantization_enabled = False` on the hooked attention modules, the switch
compressed-tensors' QuantizedKVCache.forward reads) gives the weights-only figure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..errors import UsageError
from ..model.checkpoint import query_group
from ..model.files import read_config_json
from . import kl_stats

KV_ATTR = "kv_cache"  # compressed_tensors.modeling.kvcache.KV_CACHE_ATTR


def quantization_config(model_dir: Path) -> dict[str, Any]:
    """config.json's quantization_config ({} for a dense model)."""
    cfg = read_config_json(Path(model_dir))
    qc = cfg.get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def kv_scheme(model_dir: Path) -> dict[str, Any] | None:
    scheme = quantization_config(model_dir).get("kv_cache_scheme")
    return scheme if isinstance(scheme, dict) else None


def quantizes_activations(model_dir: Path, *, query: bool = True) -> bool:
    """Whether some config group rounds its layers' input activations (W8A8, W4A8; with
    `query`, also the group that rounds the attention modules' query, kv_cache.query: its
    one target is the attention class)."""
    groups = quantization_config(model_dir).get("config_groups") or {}
    return any(isinstance(g, dict) and g.get("input_activations")
               and (query or not query_group(g)) for g in groups.values())  # fmt: skip


SKIPPED = "_qship_kv_16bit"  # set on an attention module whose KV cache is served 16-bit


def kv_modules(model: Any) -> list[torch.nn.Module]:
    """Attention modules carrying compressed-tensors' KV-cache quantization hook (not those
    of skip_kv_layers)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, KV_ATTR)
        and getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
        and not getattr(m, SKIPPED, False)
    ]


def skip_kv_layers(model: Any, layers: tuple[int, ...]) -> int:
    """Leave the KV cache (and the query) of these decoder layers unrounded, as vLLM serves
    them with --kv-cache-dtype-skip-layers: their hooks off for good, out of kv_modules.
    -> how many layers were switched off (exit 2 when a listed layer has no KV hook)."""
    if not layers:
        return 0
    from ..model.roles import decoder_layer_list

    found = decoder_layer_list(model)
    blocks = list(found[1]) if found else []
    hooked = {id(m) for m in kv_modules(model)}
    for i in layers:
        mods = [m for m in blocks[i].modules() if id(m) in hooked] if i < len(blocks) else []
        if not mods:
            raise UsageError(f"kv_cache.skip_layers: layer {i} has no FP8 KV cache in this "
                             "checkpoint", path="kv_cache.skip_layers",
                             hint="list decoder layers of this model")  # fmt: skip
        for m in mods:
            m.quantization_enabled = False
            setattr(m, SKIPPED, True)
    return len(layers)


@contextlib.contextmanager
def kv_quantization(model: Any, enabled: bool) -> Iterator[int]:
    """Switch the simulated KV-cache quantization on or off; yields #modules touched."""
    mods = kv_modules(model)
    old = [getattr(m, "quantization_enabled", True) for m in mods]
    for m in mods:
        m.quantization_enabled = enabled
    try:
        yield len(mods)
    finally:
        for m, o in zip(mods, old, strict=True):
            m.quantization_enabled = o


@torch.inference_mode()
def forward_logits(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for positions 0..L-2 and the tokens they predict, flattened to [n, V], [n]."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Clock:
    """`with clock(name):` adds the block's seconds to spent[name], the device synchronized
    first and last so a GPU's queued work is counted where it was issued; with spent None,
    nothing: no caller asked, so no synchronization is added to the loop."""

    def __init__(self, device: str, spent: dict[str, float] | None):
        self.device, self.spent = device, spent

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.spent is None:
            yield
            return
        sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0


def score_against_reference(
    model: Any,
    ids: torch.Tensor,
    ref: dict[str, torch.Tensor],
    batch_size: int,
    kv_passes: dict[str, bool] | None = None,
    progress: str | None = None,
    capture: Any = None,
    timings: dict[str, float] | None = None,
) -> dict[str, kl_stats.Accumulator]:
    """Per-token figures of `model` on `ids` against a cached reference entry (top-k + tail,
    rows in sequence-then-position order). One pass per entry of `kv_passes` (name -> KV
    quantization on/off; a model without KV hooks is the same in both). Used by evaluate's
    cached mode, by compare (per-token KL for the plot) and by sensitivity. `capture`
    (served.Capture) keeps the first pass's top-k log-probs for the served check. `timings`
    gets the seconds of the forwards, the KL arithmetic and the capture (synchronized on a
    GPU): a GPU evaluate spent minutes on 32 sequences, CPU-bound, and this says where."""
    kv_passes = kv_passes or {"on": True}
    acc = {name: kl_stats.Accumulator() for name in kv_passes}
    per_seq = ids.shape[1] - 1
    n = ids.shape[0]
    bar = log.Progress(progress, n, unit="sequences") if progress else None
    clock = _Clock(str(next(model.parameters()).device), timings)
    for s in range(0, n, batch_size):
        batch = ids[s : s + batch_size]
        rows = slice(s * per_seq, (s + batch.shape[0]) * per_seq)
        part = {k: v[rows] for k, v in ref.items()}
        for i, (name, enabled) in enumerate(kv_passes.items()):
            with clock("forward_s"), kv_quantization(model, enabled):
                cl, nxt = forward_logits(model, batch)
            with clock("kl_s"):
                acc[name].add(kl_stats.kl_topk_tail(part, cl, nxt))
            if capture is not None and i == 0:
                with clock("capture_s"):
                    capture.add(part, cl)
            del cl
        if bar:
            bar.update(s + batch.shape[0])
    if bar:
        bar.close()
    return acc
