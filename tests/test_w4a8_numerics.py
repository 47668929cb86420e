"""vLLM's CUTLASS W4A8 arithmetic as qship's evaluation simulates it (evaluate/numerics.py):
the FP8 group scales with their per-channel factor, and the FP8-rounded products the kernel's
main loop reads each weight from, against references built here."""

from __future__ import annotations

import pytest
import torch


def test_w4a8_scales_are_vllms_fp8_pair():
    from pipeline.model.w4a8 import w4a8_scales

    torch.manual_seed(1)
    s = torch.rand(64, 8) * 0.02 + 1e-4
    s8, chan = w4a8_scales(s.to(torch.bfloat16))
    for r in range(s.shape[0]):
        row = s[r].to(torch.bfloat16).float()
        c = max(float(row.abs().max()) / 448, 1 / (448 * 512))
        want = (row / c).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        want = (want / 8).to(torch.float8_e4m3fn).float()
        assert torch.equal(s8[r], want) and float(chan[r]) == pytest.approx(c * 8, rel=1e-6)
    rel = ((s8 * chan - s.to(torch.bfloat16).float()).abs() / s).max()
    assert 0 < rel < 0.2  # FP8 scales: a few per cent off, never wildly


def test_w4a8_weight_is_the_kernels_fp8_product_table():
    """Each weight is one of the group's eight FP8 products q * s8 (negated for q > 0),
    times the channel factor: not the exact product q * s8."""
    from pipeline.model.w4a8 import w4a8_scales, w4a8_weight

    torch.manual_seed(2)
    s = torch.rand(16, 4) * 0.02 + 1e-4
    q = torch.randint(-8, 8, (16, 4, 128)).float()
    got = w4a8_weight(q, s)
    s8, chan = w4a8_scales(s)
    table = {}  # (row, group) -> {q: value}, built as the kernel's packed scales are
    for r in range(16):
        for g in range(4):
            neg = {-k: float(torch.tensor(-k * float(s8[r, g])).to(torch.float8_e4m3fn).float())
                   for k in range(1, 9)}  # fmt: skip
            table[r, g] = {0: 0.0, **neg, **{k: -neg[-k] for k in range(1, 8)}}
    want = torch.tensor([[[table[r, g][int(v)] for v in q[r, g]] for g in range(4)]
                         for r in range(16)]) * chan.unsqueeze(-1)  # fmt: skip
    assert torch.equal(got, want)
    exact = q * (s8 * chan).unsqueeze(-1)
    assert not torch.equal(got, exact) and ((got - exact).abs() <= exact.abs() / 16 + 1e-12).all()
