"""GPTQ that rounds each W4A8 weight to the value vLLM's CUTLASS W4A8 kernel will serve.

The kernel reads a symmetric int4 weight q of group scale s as fp8(q * s8) * c * 8, not
q * s (model/w4a8.py), and the difference, added after GPTQ has spent its error feedback,
does not cancel: on Gemma 3 270M and Qwen2.5-Coder-0.5B it is two thirds of W4A8's KL gap
to the same weights served as W4A16 (bench/RESULTS.md). Here GPTQ's column loop picks, for
every weight, the q whose *served* value is nearest and feeds that value's error forward,
so the later columns compensate what the kernel will do. The checkpoint stores q and s as
before (the weight is written as q * s); only the choice of q and the feedback change.
Measured with this rounding: mean KL -9.4 % on Gemma, -11.9 % on Qwen (RESULTS.md).

llm-compressor 0.14 quantizes modules in batches of one weight scheme and hands the block
update neither module nor activation scheme, so three scoped patches do it
(compat.llmcompressor_0_14.gptq_block_update_for): batches are split into W4A8 and other
modules, and the block update rounds to the served values for W4A8 batches and is the
library's own (its Triton kernel on a GPU) for the rest.
"""

from __future__ import annotations

import contextlib

import torch

from ..compat.llmcompressor_0_14 import gptq_block_update_for
from ..model.w4a8 import STORED_DTYPE, channel_factor, nearest_served, served_by_w4a8


def served_block_update(W1: torch.Tensor, Hinv1: torch.Tensor, Q1: torch.Tensor,
                        Err1: torch.Tensor, losses1: torch.Tensor, *, scale: torch.Tensor,
                        eff: torch.Tensor) -> None:  # fmt: skip
    """One GPTQ block [batch, rows, width] (the eager update of llm-compressor's
    gptq_block_update) rounding to the served values: `scale` the batch's group scales
    [batch, rows, groups], `eff` each column's [batch, rows, width]."""
    stored = scale.to(STORED_DTYPE).float().reshape(scale.shape[0], scale.shape[1], -1)
    chan = channel_factor(stored).squeeze(-1)  # [batch, rows]
    eff = eff.to(STORED_DTYPE).float()
    for i in range(W1.shape[-1]):
        w = W1[:, :, i]
        q, served = nearest_served(w, eff[:, :, i], chan)
        error = (w - served.to(w.dtype)) / Hinv1[:, i, i][:, None]
        Q1[:, :, i] = (q * eff[:, :, i]).to(Q1.dtype)  # stored as q * s, served as `served`
        Err1[:, :, i] = error
        losses1[:, :, i] = error.square()
        W1[:, :, i:] -= error.unsqueeze(-1) * Hinv1[:, i, i:].unsqueeze(1)


def gptq_rounds_to_served_w4a8() -> contextlib.AbstractContextManager[list[int]]:
    """Inside the block, GPTQ rounds W4A8 Linears to their served values (module
    docstring). Yields a one-item list: how many modules it rounded so, once the block ends."""
    return gptq_block_update_for(served_by_w4a8, served_block_update)
