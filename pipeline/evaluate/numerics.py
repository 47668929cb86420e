"""The attention arithmetic of the engine that will serve the checkpoint, in transformers.

compressed-tensors' hooks round K and V through FP8 e4m3 with the stored scales. vLLM on
CUDA, serving the same checkpoint with its FP8 KV cache, also rounds the *query* to FP8
(per tensor, with the layer's q_scale: 1.0 when the checkpoint stores none; vllm
model_executor/layers/attention `query_quant`) so that FlashAttention 3 multiplies FP8 by
FP8. Measured on two tiny trained models served by vLLM 0.26 on an H200, leaving that
rounding out made the served KL 15-18 % worse than qship's figure.
`served_attention(model, "vllm")` wraps the model's attention function so that each
KV-hooked attention module whose KV rounding is on also rounds its query; with the
rounding off (the weights-only pass) it does nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_round(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x through float8_e4m3fn with a per-tensor scale (saturating, as vLLM's static
    per-tensor quantization does), back in x's dtype."""
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (y.float() * scale).to(x.dtype)


def _q_scale(module: Any) -> float:
    s = getattr(module, "q_scale", None)
    return float(s.float().item()) if isinstance(s, torch.Tensor) and s.numel() == 1 else 1.0


@contextlib.contextmanager
def served_attention(model: Any, numerics: str, hooked: list[torch.nn.Module]) -> Iterator[bool]:
    """Within the block the model's attention runs with `numerics` ("vllm": FP8 query on
    the `hooked` modules while their KV rounding is on; "kv-only": unchanged). Yields
    whether anything was wrapped."""
    if numerics != "vllm" or not hooked:
        yield False
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    impl = model.config._attn_implementation
    ids = {id(m) for m in hooked}
    local = registry._local_mapping
    had, old = impl in local, local.get(impl)
    base = registry.get(impl) if impl != "eager" else None

    def attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if id(module) in ids and getattr(module, "quantization_enabled", True):
            query = fp8_round(query, _q_scale(module))
        fn = base or sys.modules[type(module).__module__].eager_attention_forward
        return fn(module, query, *args, **kwargs)

    local[impl] = attention
    try:
        yield True
    finally:
        if had:
            local[impl] = old
        else:
            local.pop(impl, None)
