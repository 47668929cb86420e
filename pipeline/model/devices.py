"""Where and in which precision the model math runs; the one table of dtypes.

16-bit matrix products have no fast kernels on most CPUs: on this project's 2-core AMD
EPYC a bf16 640x1536 GEMM ran at 0.2 GFLOP/s against 14.6 in float32 (70x slower), which
made AWQ's grid search take minutes per layer. So on the CPU the weights are upcast to
float32 for the computation (exact: every bf16 value is a float32 value) and the
checkpoint is written back in the recipe's dtype; on a GPU the recipe's dtype is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    name: str  # torch's name: torch.<name>
    bits: int
    safetensors: str  # the dtype code in a safetensors header

    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bfloat16", 16, "BF16"),
        DType("float16", 16, "F16"),
        DType("float32", 32, "F32"),
        DType("float64", 64, "F64"),
    )
}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_kind(device: str | None) -> str:
    """'cuda' / 'cpu': GPU and CPU kernels round differently, so results are keyed by it."""
    return (device or default_device()).split(":")[0]


def compute_dtype(dtype: str, device: str) -> str:
    """The dtype the math runs in: float32 on the CPU (see above), `dtype` elsewhere."""
    return "float32" if device_kind(device) == "cpu" else dtype


def free_gpu_bytes(device: str | None) -> int | None:
    """Free memory of the CUDA device a run will use (None on the CPU / without CUDA)."""
    import torch

    device = device or default_device()
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def usable_gpu_bytes(device: str | None, cap: int | None) -> int | None:
    """The GPU memory a run may plan with: what is free, at most `cap` (--gpu-memory); with
    a cap and no CUDA here (planning on paper) the cap itself."""
    free = free_gpu_bytes(device)
    if cap is None or not (device or default_device()).startswith("cuda"):
        return free
    return cap if free is None else min(free, cap)


def apply_gpu_cap(device: str | None, cap: int | None) -> None:
    """Hold this process to `cap` bytes of the GPU (torch's per-process memory fraction):
    an allocation beyond it fails as if the card were that small."""
    import torch

    device = device or default_device()
    if cap is None or not device.startswith("cuda") or not torch.cuda.is_available():
        return
    dev = torch.device(device)
    if dev.index is None:  # torch's cap needs an index: "cuda" is the current device
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)


def free_cpu_bytes() -> int:
    """Host memory available to a new allocation (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)
