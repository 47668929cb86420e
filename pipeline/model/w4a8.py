"""The weights vLLM's CUTLASS W4A8 kernel (sm90) serves for a symmetric int4 group-quantized
Linear with FP8 activations, shared by evaluate (which computes with them) and quantize
(whose GPTQ rounds to them).

The kernel stores the group scales s [out, groups] in FP8 with a float32 factor per output
channel: c = max|s| / 448 over the row (QuantFP8 per token over the scale row), then
s8 = fp8(fp8(s / c) / 8) and c * 8 (vLLM quant_utils.convert_bf16_scales_to_fp8). Its main
loop reads each weight from a table of the group's products q * s8, each rounded to FP8
(CUTLASS's packed_scale_t), so the weight served for q is fp8(q * s8) * c * 8: up to 1/16
off q * s where q * s8 needs more than FP8's four significant bits. As stored the format is
plain W4AFP8 (q and s); this is only how it is read.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..recipe.formats import serves_as_w4a8

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's lower bound on a dynamic FP8 scale
INT4 = torch.arange(-8, 8, dtype=torch.float32)  # the 16 values of symmetric int4
# W4A8-FP8 checkpoints are bfloat16 (quantize/serving.py refuses others), and vLLM derives
# its FP8 scales from the group scales as stored: quantize rounds with them at that precision
STORED_DTYPE = torch.bfloat16


def is_w4a8(scheme: Any) -> bool:
    """Whether a compressed-tensors QuantizationScheme is what the W4A8 kernel serves (the
    rule recipe.formats states for a recipe's scheme)."""
    w = getattr(scheme, "weights", None)
    act = getattr(scheme, "input_activations", None)
    if w is None or act is None:
        return False
    return serves_as_w4a8(_value(w.type), w.num_bits, bool(w.symmetric), _value(w.strategy),
                          _value(act.type))  # fmt: skip


def _value(x: Any) -> str:
    """A compressed-tensors enum member's value ("int", "group", ...), or the string given."""
    return str(getattr(x, "value", x))


def served_by_w4a8(module: Any) -> bool:
    """Whether a quantized module (its compressed-tensors scheme attached) is W4A8."""
    return is_w4a8(getattr(module, "quantization_scheme", None))


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def channel_factor(scales: torch.Tensor) -> torch.Tensor:
    """c for group scales [..., groups]: [..., 1]."""
    return (scales.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def fp8_group_scales(scales: torch.Tensor, chan: torch.Tensor) -> torch.Tensor:
    """s8 (float32 values) for group scales [...] of rows whose channel factor c broadcasts."""
    return _fp8(_fp8((scales.float() / chan).clamp(-FP8_MAX, FP8_MAX)) / 8.0)


def w4a8_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The group scales [out, groups] as the kernel stores them: s8 [out, groups] and the
    float32 factor c * 8 per output channel [out, 1]."""
    chan = channel_factor(scales)
    return fp8_group_scales(scales, chan), chan * 8.0


def served_values(q: torch.Tensor, s8: torch.Tensor, chan8: torch.Tensor) -> torch.Tensor:
    """fp8(q * s8) * c8 in float32, the three broadcasting against each other."""
    return _fp8(q.float() * s8) * chan8


def w4a8_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int4 values q [out, groups, group] as the kernel multiplies them, in float32."""
    s8, chan8 = w4a8_scales(scales)
    return served_values(q, s8.unsqueeze(-1), chan8.unsqueeze(-1))


def int4_levels(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int4 values q [out, groups, group] of a decompressed group-quantized weight
    (q * s) and its group scales [out, groups]."""
    wf = weight.float().reshape(weight.shape[0], scales.shape[1], -1)
    return torch.round(wf / scales.float().unsqueeze(-1)).clamp(-8, 7)


@functools.cache
def _int4_on(device: torch.device) -> torch.Tensor:
    """INT4 on `device`, copied once: GPTQ asks for it on every column, and a host-to-device
    copy from pageable memory waits for the GPU each time."""
    return INT4.to(device)


def nearest_served(
    w: torch.Tensor, scale: torch.Tensor, chan: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For weights w [...] in groups of scale `scale` [...] on rows of channel factor `chan`
    [...]: the int4 value q whose served weight is nearest, and that served weight. Where
    the group's s8 underflows to 0 every q serves 0 and q is w's uniform rounding."""
    s8 = fp8_group_scales(scale, chan)
    table = served_values(_int4_on(w.device), s8.unsqueeze(-1), (chan * 8.0).unsqueeze(-1))
    k = (w.float().unsqueeze(-1) - table).abs().argmin(dim=-1, keepdim=True)
    served = torch.gather(table, -1, k).squeeze(-1)
    q = torch.where(s8 > 0, k.squeeze(-1).float() - 8.0,
                    torch.round(w.float() / scale.float()).clamp(-8, 7))  # fmt: skip
    return q, served
