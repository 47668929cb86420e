"""Page-locked host copies of an offloaded model's weights, packed into large blocks.

torch's caching host allocator rounds every page-locked allocation up to a power of two, so
pinning tensor by tensor costs up to 2x their bytes: a Qwen3-30B-A3B expert Linear (768 x
2048 bf16, 3 MiB) takes 4 MiB, its 151,936 x 2048 embedding 1 GiB for 594 MiB. Packed
into blocks of a power-of-two size, each tensor a view of its block, the weights take what
they are plus the unfilled ends of the blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

BLOCK = 1 << 30  # bytes; the unfilled end of each is the cost of packing
ALIGN = 512  # bytes between tensors (any element size divides it)


def _pinned(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pack(tensors: Iterable[Any], alloc: Callable[[int], Any] = _pinned) -> int:
    """Move each tensor's data into blocks from `alloc(nbytes)` (1-D uint8), first fit, in
    place (`t.data` becomes a view of its block, values unchanged). A block lives as long as
    one of its tensors does. Returns the bytes allocated."""
    blocks: list[list[Any]] = []  # [block, bytes used]
    total = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if not t.is_contiguous():
            t.data = t.data.contiguous()
        slot = next((b for b in blocks if b[1] + n <= b[0].numel()), None)
        if slot is None:
            size = max(BLOCK, 1 << (n - 1).bit_length())
            slot = [alloc(size), 0]
            blocks.append(slot)
            total += size
        block, at = slot
        view = block[at : at + n].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
        slot[1] = -(-(at + n) // ALIGN) * ALIGN
    return total
