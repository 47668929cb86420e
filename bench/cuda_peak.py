"""What is resident on the GPU at the peak of a run, by the code that allocated it.

    with cuda_peak.recording():          # torch's allocator history (python stacks)
        run()
    print(cuda_peak.breakdown_text(cuda_peak.breakdown()))

Replays the allocator trace, finds the moment the allocated total was highest and groups
the blocks live then by their innermost frame in llm-compressor, compressed-tensors,
transformers or qship. Used by bench/quantize_bench.py --memory-breakdown (issue 3).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

PACKAGES = ("llmcompressor/", "compressed_tensors/", "transformers/", "pipeline/", "bench/")


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000):
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:
        pass  # the history stays until breakdown() has read it


def _site(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        name = f.get("filename", "")
        for pkg in PACKAGES:
            i = name.rfind(pkg)
            if i >= 0:
                return f"{name[i:]}:{f.get('line')} {f.get('name')}"
    return "other"


def breakdown(top: int = 15) -> dict:
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in (snap.get("device_traces") or [[]])[0]:
        act, addr, size = ev["action"], ev["addr"], ev["size"]
        if act == "alloc":
            live[addr] = (size, _site(ev.get("frames") or []))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif act in ("free_completed",) and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, int] = defaultdict(int)
    for size, site in at_peak.values():
        groups[site] += size
    rows = sorted(groups.items(), key=lambda kv: -kv[1])
    return {
        # allocations made before the (ring-buffered) trace starts are not in these figures
        "traced_peak_bytes": peak,
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "top": [{"site": s, "bytes": b} for s, b in rows[:top]],
        "rest_bytes": sum(b for _, b in rows[top:]),
    }


def breakdown_text(b: dict) -> str:
    lines = [f"traced peak {b['traced_peak_bytes'] / 1e6:.1f} MB live, by allocation site:"]
    lines += [f"  {r['bytes'] / 1e6:9.1f} MB  {r['site']}" for r in b["top"]]
    lines.append(f"  {b['rest_bytes'] / 1e6:9.1f} MB  (everything else)")
    return "\n".join(lines)
