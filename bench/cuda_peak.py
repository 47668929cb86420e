"""What is resident on the GPU at the peak of a run, by the code that allocated it.

    with cuda_peak.recording():          # torch's allocator history (python stacks)
        run()
    print(cuda_peak.breakdown_text(cuda_peak.breakdown()))

Replays the allocator trace, finds the moment the allocated total was highest and groups
the blocks live then by their innermost frame in llm-compressor, compressed-tensors,
transformers or qship. Used by bench/studies/quantize_bench.py --memory-breakdown (issue 3).
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
    stack = _stack(frames, depth=1)
    return stack[0] if stack else "other"


def _stack(frames: list[dict], depth: int = 14) -> list[str]:
    """The frames of one allocation inside the watched packages, innermost first: says in
    which phase (calibration forward, AWQ grid search, GPTQ compression ...) it happened."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        for pkg in PACKAGES:
            i = name.rfind(pkg)
            if i >= 0:
                out.append(f"{name[i:]}:{f.get('line')} {f.get('name')}")
                break
    return out[:depth]


# phase -> a function name on the allocating stack that marks it
PHASES = {"oneshot": "oneshot", "reload check": "verify_reload"}


def breakdown(top: int = 15, phases: dict[str, str] = PHASES) -> dict:
    """What is live at the peak of the whole recording and at the peak of each phase (the
    highest total reached by an allocation made inside that phase)."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = 0
    peaks = {name: {"bytes": 0, "live": {}, "stack": []} for name in ["all", *phases]}
    for ev in (snap.get("device_traces") or [[]])[0]:
        act, addr, size = ev["action"], ev["addr"], ev["size"]
        if act == "alloc":
            frames = ev.get("frames") or []
            live[addr] = (size, _site(frames))
            total += size
            funcs = None  # the stack's function names, only when a peak may move
            for name, pk in peaks.items():
                if total <= pk["bytes"]:
                    continue
                funcs = funcs or {f.get("name") for f in frames}
                if name == "all" or phases[name] in funcs:
                    pk.update(bytes=total, live=dict(live), stack=_stack(frames))
        elif act == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    out = {
        # allocations made before the (ring-buffered) trace starts are not in these figures
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "phases": {},
    }
    for name, pk in peaks.items():
        groups: dict[str, int] = defaultdict(int)
        for size, site in pk["live"].values():
            groups[site] += size
        rows = sorted(groups.items(), key=lambda kv: -kv[1])
        out["phases"][name] = {
            "traced_peak_bytes": pk["bytes"],
            "top": [{"site": s, "bytes": b} for s, b in rows[:top]],
            "rest_bytes": sum(b for _, b in rows[top:]),
            "peak_stack": pk["stack"],  # the allocation that set this peak
        }
    return out


def breakdown_text(b: dict) -> str:
    lines = []
    for name, ph in b["phases"].items():
        lines.append(
            f"[{name}] traced peak {ph['traced_peak_bytes'] / 1e6:.1f} MB live, by allocation site:"
        )
        lines += [f"  {r['bytes'] / 1e6:9.1f} MB  {r['site']}" for r in ph["top"]]
        lines.append(f"  {ph['rest_bytes'] / 1e6:9.1f} MB  (everything else)")
        lines.append("  set by an allocation at (innermost first):")
        lines += [f"    {f}" for f in ph["peak_stack"]]
    return "\n".join(lines)
