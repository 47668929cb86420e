"""W4A8 weights that RTN quantized moved to the int4 value whose *served* weight is
nearest, before the checkpoint is written.

Round-to-nearest picks q = round(w / s); vLLM's CUTLASS W4A8 kernel then serves
fp8(q * s8) * c * 8, not q * s (model/w4a8.py), and for some weights another q's served
value is nearer w. Choosing q by the served values instead puts each weight at the nearest
value the kernel can serve: on four layers of Gemma 3 270M / Qwen2.5-Coder-0.5B (min-max
scales) the served weights' squared error over exact int4 falls from +6.1 / +5.3 % to +2.0 /
+1.8 % (bench/RESULTS.md, bench/studies/w4a8_grid.py). No error feedback: that is GPTQ's
(quantize/w4a8_gptq.py), which these modules do not run. In KL it is small beside RTN's own
error: Gemma 3 270M's data-free W4A8, exact mean KL 0.6431 -> 0.6399, p99 3.71 -> 3.60.

The weight is overwritten with q * s at the stored scale precision, so the compression at
save (round(w / s)) stores exactly q; format, scales and quantization_config are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..model.w4a8 import STORED_DTYPE, channel_factor, nearest_served, served_by_w4a8

# weights per slice of rows: nearest_served builds a 16-entry float32 table per weight
# (64 bytes each), so a slice costs about 64 x this in bytes (256 MiB)
SLICE_WEIGHTS = 1 << 22


def served_rounding(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * s [out, in] for a weight [out, in] and its group scales [out, groups], q the int4
    value whose served weight is nearest each weight; in the weight's dtype."""
    s = scales.to(STORED_DTYPE).float()
    group = weight.shape[1] // s.shape[1]
    out = torch.empty_like(weight)
    rows = max(1, SLICE_WEIGHTS // weight.shape[1])
    for r in range(0, weight.shape[0], rows):
        sr = s[r : r + rows]
        eff = sr.repeat_interleave(group, dim=1)
        q, _ = nearest_served(weight[r : r + rows].float(), eff, channel_factor(sr))
        out[r : r + rows] = (q * eff).to(weight.dtype)
    return out


def rtn_rounds_to_served_w4a8(model: Any, names: Iterable[str]) -> int:
    """Moves the weights of the W4A8 Linears among `names` (modules RTN quantized) to the
    served rounding, offloaded ones included; how many it moved."""
    from compressed_tensors.offload import align_module_device, update_offload_parameter

    moved = 0
    for name in names:
        module = model.get_submodule(name)
        if not served_by_w4a8(module) or not hasattr(module, "weight_scale"):
            continue
        with torch.no_grad(), align_module_device(module):
            new = served_rounding(module.weight.data, module.weight_scale.data)
        update_offload_parameter(module, "weight", new)
        moved += 1
    return moved
