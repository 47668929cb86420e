"""Does GPTQ close W4A8's gap to W4A16 when it rounds against the weights vLLM's CUTLASS W4A8
kernel serves? (issue 29: as served, W4A8 is 18.7 % above its W4A16 twin on Gemma 3 270M and
20.9 % on Qwen2.5-Coder-0.5B, two thirds of it the weights as the kernel reads them, FP8 group
scales and FP8-rounded products, numerics.w4a8_weight; this rounding: Gemma +9.8 %.)

    python bench/w4a8_served_gptq.py compare --model GGUF --recipes R.yaml --exact --device cpu

runs qship's CLI with llm-compressor's eager GPTQ column update patched: each column is
rounded to the nearest weight the kernel can serve, fp8(q * s8) * chan for q in -8..7 (the
group's FP8 scale s8 and the channel factor as numerics.w4a8_scales derives them from the
group scales), instead of q * scale, so GPTQ's error feedback carries the served error. The
stored q and scales are unchanged in kind: vLLM derives the same s8 and chan from them.
Only symmetric int4 group weights with FP8 activations take the patched rounding.

The prototype of qship's own GPTQ for W4A8 (pipeline/quantize/w4a8_gptq.py, since
2026-12-07), which also stores exactly the q it chose (this script stores the served value
and lets compressed-tensors re-round it). With that in qship, qship's rounding runs first for
W4A8 Linears and this patch is never reached: the script reproduces the rows of 2026-12-06
and 2026-12-07 only when run on a tree before commit 8b8cfe1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.evaluate.numerics import FP8_MAX, FP8_MIN_SCALE  # noqa: E402

LEVELS = torch.arange(-8, 8, dtype=torch.float32)


def served_levels(eff: torch.Tensor, chan: torch.Tensor) -> torch.Tensor:
    """[..., 16] the weights the kernel serves for q = -8..7 at group scale `eff` [...] of a
    row whose factor is `chan` [...] (numerics.w4a8_scales / w4a8_weight, column-wise)."""
    s8 = (eff / chan).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s8 = (s8.float() / 8.0).to(torch.float8_e4m3fn).float()
    prod = (LEVELS.to(eff.device) * s8.unsqueeze(-1)).to(torch.float8_e4m3fn).float()
    return prod * (chan * 8.0).unsqueeze(-1)


def patch() -> None:
    import llmcompressor.modifiers.gptq.gptq_quantize as gq

    original = gq.gptq_block_update

    def block_update(W1, Hinv1, Q1, Err1, losses1, *, scale, zero_point, global_scale, g_idx,
                     quant_args, i1):  # fmt: skip
        block_update.calls += 1
        if not (quant_args.num_bits == 4 and quant_args.symmetric):
            return original(W1, Hinv1, Q1, Err1, losses1, scale=scale, zero_point=zero_point,
                            global_scale=global_scale, g_idx=g_idx, quant_args=quant_args,
                            i1=i1)  # fmt: skip
        width = W1.shape[-1]
        eff, _ = gq.column_scale_window(scale, zero_point, global_scale, g_idx, quant_args,
                                        num_rows=W1.shape[-2], i1=i1, i2=i1 + width)  # fmt: skip
        s = scale.float().reshape(scale.shape[0], scale.shape[1], -1)  # [batch, rows, groups]
        chan = (s.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)  # [batch, rows]
        for i in range(width):
            w = W1[:, :, i]
            levels = served_levels(eff[:, :, i].float(), chan)
            q = torch.gather(levels, -1, (w.unsqueeze(-1) - levels).abs().argmin(-1, keepdim=True))
            q = q.squeeze(-1).to(w.dtype)
            diagonal = Hinv1[:, i, i]
            error = (w - q) / diagonal[:, None]
            Q1[:, :, i] = q
            Err1[:, :, i] = error
            losses1[:, :, i] = error.square()
            W1[:, :, i:] -= error.unsqueeze(-1) * Hinv1[:, i, i:].unsqueeze(1)

    block_update.calls = 0
    gq.gptq_block_update = block_update  # every int4 symmetric weight in this run is W4A8


if __name__ == "__main__":
    patch()
    import llmcompressor.modifiers.gptq.gptq_quantize as gq

    from pipeline.cli import main

    rc = main(sys.argv[1:])
    print(f"patched GPTQ block updates: {gq.gptq_block_update.calls}", file=sys.stderr)
    sys.exit(rc)
