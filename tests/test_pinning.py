"""Packing an offloaded model's host copies into blocks (model/pinning.py): values and
shapes unchanged, each tensor a view of a block, and the bytes allocated close to the
tensors' own instead of rounded up to a power of two each."""

from __future__ import annotations

import torch

from pipeline.model import pinning


def test_pack_keeps_values_and_costs_little_more_than_the_tensors(monkeypatch):
    monkeypatch.setattr(pinning, "BLOCK", 1 << 20)
    gen = torch.Generator().manual_seed(0)
    # 96 KiB experts (rounded one by one: 128 KiB), a 1.5 MiB embedding (2 MiB), odd sizes
    ts = [torch.randn(48, 1024, generator=gen).bfloat16() for _ in range(200)]
    ts += [torch.randn(768, 1024, generator=gen).bfloat16(), torch.randn(7, 3), torch.zeros(0)]
    ts += [torch.arange(10, dtype=torch.int64), torch.randn(5, 8).t()]  # a non-contiguous one
    want = [t.clone() for t in ts]
    blocks = []

    def alloc(n):
        blocks.append(torch.empty(n, dtype=torch.uint8))
        return blocks[-1]

    total = pinning.pack(ts, alloc)
    for t, w in zip(ts, want, strict=True):
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w)
    placed = [t for t in ts if t.numel()]
    ptrs = [(b.untyped_storage().data_ptr(), b.numel()) for b in blocks]
    assert all(any(p <= t.data_ptr() < p + n for p, n in ptrs) for t in placed)
    own = sum(t.numel() * t.element_size() for t in placed)
    one_by_one = sum(1 << (t.numel() * t.element_size() - 1).bit_length() for t in placed)
    # ten experts a block (20 blocks), the embedding a 2 MiB one whose rest takes the others
    assert total == sum(b.numel() for b in blocks) == 22 << 20
    assert own / total > 0.9 and one_by_one > 1.3 * own
    ts[0].add_(1)  # a view: writing through it changes the block, not a copy
    assert torch.equal(ts[0], want[0] + 1)
