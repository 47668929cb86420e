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

from ..compat.compressed_tensors_0_19 import hooked_attention_inner
from ..compat.transformers_5 import attention_function, attn_implementation
from ..model.w4a8 import FP8_MAX, FP8_MIN_SCALE, int4_levels, is_w4a8, w4a8_weight

# The simulation's revision, recorded with every evaluation it computed and part of the
# stage key of evaluations it touches: bump it when the simulated arithmetic changes, so
# cached figures of the old arithmetic are recomputed rather than reused or compared.
# r1 the query rounded to FP8 with the KV cache; r2 Linear inputs as vLLM's W8A8 / W4A8
# kernels round them; r3 W4A8's FP8 group scales and FP8-rounded products.
SERVED_NUMERICS = "vllm-0.26/r3"


def fp8_round(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """x through float8_e4m3fn with a static scale (per tensor, or a tensor that broadcasts
    over x: per head), saturating as vLLM's static quantization does, back in x's dtype."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(x.device)
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (y.float() * scale).to(x.dtype)


def _q_scale(module: Any) -> float | torch.Tensor:
    """The query's FP8 scale as vLLM 0.26 applies it: 1.0 without a calibrated q_scale; one
    per tensor; or, stored per query head (attn_head), reduced to one per KV head by the max
    over that head's group (FlashAttention takes one descale per KV head) and broadcast over
    the query's [batch, heads, tokens, dim]."""
    s = getattr(module, "q_scale", None)
    if not isinstance(s, torch.Tensor):
        return 1.0
    if s.numel() == 1:
        return float(s.float().item())
    s = s.detach().float().flatten()
    kv_heads = int(getattr(module.config, "num_key_value_heads", 0) or s.numel())
    per_kv = s.view(kv_heads, -1).amax(dim=1)
    return per_kv.repeat_interleave(s.numel() // kv_heads).view(1, -1, 1, 1)


@contextlib.contextmanager
def served_attention(model: Any, numerics: str, hooked: list[torch.nn.Module]) -> Iterator[bool]:
    """Within the block the model's attention runs with `numerics` ("vllm": FP8 query on
    the `hooked` modules while their KV rounding is on; "kv-only": unchanged). Yields
    whether anything was wrapped."""
    if numerics != "vllm" or not hooked:
        yield False
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    impl = attn_implementation(model)
    ids = {id(m) for m in hooked}
    # a checkpoint with a calibrated query scale loads with compressed-tensors' hooked
    # attention, which would round the query again (per query head, not as vLLM does): the
    # attention it wraps runs here instead
    inner = hooked_attention_inner(impl)
    base = registry.get(inner) if inner != "eager" else None

    def attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if id(module) in ids and getattr(module, "quantization_enabled", True):
            query = fp8_round(query, _q_scale(module))
        fn = base or sys.modules[type(module).__module__].eager_attention_forward
        return fn(module, query, *args, **kwargs)

    with attention_function(impl, attention):
        yield True


# ---------------------------------------------------------------- quantized Linear layers
#
# vLLM's kernels for checkpoints that quantize activations, as qship's evaluation runs them
# (CUDA kernels in vLLM 0.26: csrc/quantization, model_executor/layers/quantization):
#   FP8 per token, dynamic   scale = max(amax / 448, 1 / (448 * 512)) in float32 per row
#                            (scaled_fp8_quant, use_per_token_if_dynamic)
#   FP8 per 128-group        scale = max(amax, 1e-10) / 448 per group (per_token_group_quant_fp8)
#   INT8 per token, dynamic  scale = amax / 127, round half to even, saturate (scaled_int8_quant)
#   static (per tensor)      the stored input_scale
# and W4A8 (CUTLASS, sm90) runs the int4 weights as model/w4a8.py derives them: group scales
# in FP8 with a factor per output channel, each weight an FP8-rounded product.
# compressed-tensors' own activation rounding differs in small ways (scales in the model
# dtype, no lower bound), and it knows nothing of W4A8's FP8 scales.

INT8_MAX = 127.0


def fp8_token_quant(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x rounded through FP8 e4m3 with a dynamic scale per row of the last dimension (or
    per `group` consecutive values of it), as vLLM's dynamic FP8 kernels do."""
    shape = x.shape
    xf = x.float().reshape(-1, group) if group else x.float().reshape(-1, shape[-1])
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (
        (amax.clamp(min=1e-10) / FP8_MAX) if group else (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    )
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(shape).to(x.dtype)


def int8_token_quant(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with a dynamic symmetric scale per row (vLLM's scaled_int8_quant)."""
    xf = x.float().reshape(-1, x.shape[-1])
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    q = torch.round(xf / scale.clamp(min=1e-30)).clamp(-INT8_MAX - 1, INT8_MAX)
    return (q * scale).reshape(x.shape).to(x.dtype)


def static_quant(x: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """x through FP8 or int8 with one stored scale (static per-tensor input_scale)."""
    if kind == "float":
        return fp8_round(x, scale)
    q = torch.round(x.float() / scale).clamp(-INT8_MAX - 1, INT8_MAX)
    return (q * scale).to(x.dtype)


def _act_quant(module: Any, args: Any) -> Any:
    if args.dynamic:
        if args.type == "float":
            group = args.group_size if str(args.strategy).endswith("group") else None
            return lambda x: fp8_token_quant(x, group)
        return int8_token_quant
    scale = float(module.input_scale.float().max().item())
    kind = str(args.type).rsplit(".", 1)[-1].lower()
    return lambda x: static_quant(x, scale, kind)


def _w4a8(module: Any) -> None:
    """Re-round an int4 group-quantized weight with vLLM's FP8 group scales."""
    w, s = module.weight.data, module.weight_scale.data
    module.weight.data = w4a8_weight(int4_levels(w, s), s).reshape(w.shape).to(w.dtype)


def _round_inputs(quant: Any) -> Any:
    def hook(module: Any, inputs: tuple) -> tuple:
        return (quant(inputs[0]), *inputs[1:])

    return hook


def serve_linears(model: Any) -> int:
    """Make the quantized Linear layers of a loaded checkpoint compute as vLLM's kernels do
    (see above): input activations rounded by qship's hooks instead of compressed-tensors'
    (whose input rounding is switched off), W4A8 weights re-rounded with FP8 group scales.
    Idempotent; returns how many layers it changed."""
    n = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue  # attention modules carry the KV scheme as "input activations"
        scheme: Any = getattr(module, "quantization_scheme", None)
        act = getattr(scheme, "input_activations", None)
        if scheme is None or act is None or getattr(module, "_qship_served", False):
            continue
        if is_w4a8(scheme):
            _w4a8(module)
        quant = _act_quant(module, act)
        module.quantization_scheme = scheme.model_copy(update={"input_activations": None})
        module.register_forward_pre_hook(_round_inputs(quant))
        module._qship_served = True
        n += 1
    return n
