"""Host memory of loading an MoE checkpoint for quantization with `--offload cpu` on a GPU,
by step and by kind (anonymous, file-backed, shared; torch's page-locked pool), for how
qship loads it today and how it did before (issue 32: 3.15x the weights of 8
Qwen3-30B-A3B-dims layers, H100 2026-12-06).

    python bench/studies/moe_host_probe.py MODEL_DIR VARIANT [--json OUT]

VARIANT: `old` (experts fused on load then split, each tensor pinned on its own), `direct`
(per-expert tensors read as Linear experts, each pinned on its own), `packed` (qship now:
direct, pinned in blocks). One variant a process: the high-water marks are the process's.
Also times one decoder layer's host-to-GPU copy (pinned views must copy at pinned speed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.model import loading  # noqa: E402
from pipeline.quantize.memory import _AnonSampler, _status_kb  # noqa: E402


def status() -> dict[str, int]:
    return {
        k: (v or 0) * 1024 for k, v in _status_kb("RssAnon", "RssFile", "RssShmem", "VmHWM").items()
    }


def one_by_one(model) -> int:
    """The pinning before blocks: each host copy pinned on its own."""
    for t in loading.pageable_host_copies(model):
        t.data = t.data.pin_memory()
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("variant", choices=["old", "direct", "packed"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    peak, steps = _AnonSampler(), {}  # qship's own host-peak sampler (50 ms)
    if a.variant == "old":
        loading._experts = lambda path, linear: contextlib.nullcontext()
    if a.variant != "packed":
        loading._pin = one_by_one
    t0 = time.perf_counter()
    model = loading.load_model(a.model, device="cuda", offload="cpu", linear_experts=True)
    time.sleep(0.1)
    steps["loaded"] = {**status(), "peak_anon_shmem": peak.take(), "s": time.perf_counter() - t0}
    from compressed_tensors.offload import disable_onloading

    with disable_onloading():
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        pinned = sum(p.is_pinned() for p in model.parameters())
        n = sum(1 for _ in model.parameters())
    stats = torch.cuda.memory.host_memory_stats()
    layer = model.model.layers[0]
    with disable_onloading():
        host = [p for p in layer.parameters()]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    on = [p.to("cuda", non_blocking=True) for p in host]
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t1
    nbytes = sum(p.numel() * p.element_size() for p in host)
    row = {"variant": a.variant, "weights_bytes": weights, "params_pinned": f"{pinned}/{n}",
           "steps": steps, "host_pinned_allocated_bytes": stats.get("allocated_bytes.current"),
           "layer0_h2d_gb_s": nbytes / copy_s / 1e9, "layer0_bytes": nbytes}  # fmt: skip
    del on
    print(json.dumps(row, indent=1))
    if a.json:
        a.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
