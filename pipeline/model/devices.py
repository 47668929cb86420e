"""Where and in which precision the model math runs; the one table of dtypes.

16-bit matrix products have no fast kernels on most CPUs: on this project's 2-core AMD
EPYC a bf16 640x1536 GEMM ran at 0.2 GFLOP/s against 14.6 in float32 (70x slower), which
made AWQ's grid search take minutes per layer. So on the CPU the weights are upcast to
float32 for the computation (exact: every bf16 value is a float32 value) and the
checkpoint is written back in the recipe's dtype; on a GPU the recipe's dtype is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


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


# what a cap on paper (no CUDA here) may be: above the largest single GPU made (288 GB)
MAX_GPU_BYTES_ON_PAPER = 512 * 2**30


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def check_device(device: str | None, *, on_paper: bool = False) -> str | None:
    """`device` as torch names it -- cpu, cuda or cuda:N -- and, unless the command only
    plans on paper (`qship plan`, `compare --matrix`), usable here: exit 2 at once naming
    --device (a CUDA device without CUDA used to run stages for ~20 s, then fail with an
    AssertionError from torch; `tpu` failed as exit 1)."""
    if device is None:
        return None
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", device)
    if m is None or (m.group(1) == "cpu" and m.group(2)):
        raise UsageError(f"--device {device!r} is not a device qship runs on", path="--device",
                         hint="use cpu, cuda or cuda:N (N: the GPU's index)")  # fmt: skip
    if m.group(1) == "cpu" or on_paper:
        return device
    import torch

    if not cuda_available():
        raise UsageError(f"--device {device}: this machine has no usable CUDA GPU (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda or 'not compiled in'})",
                         path="--device", hint="use --device cpu, or run on a machine with "
                         "a GPU (qship plan --device cuda plans for one on paper)")  # fmt: skip
    count = torch.cuda.device_count()
    if m.group(2) is not None and int(m.group(2)) >= count:
        raise UsageError(f"--device {device}: this machine has {count} GPU(s), cuda:0 to "
                         f"cuda:{count - 1}", path="--device", hint="use an index below "
                         f"{count}")  # fmt: skip
    return device


def check_gpu_cap(device: str | None, cap: int | None) -> int | None:
    """A --gpu-memory cap no GPU it is meant for could have is exit 2: above the named
    card's total memory when CUDA is here, above MAX_GPU_BYTES_ON_PAPER when not."""
    if cap is None:
        return None
    import torch

    here = torch.cuda.is_available() and (device or "cuda").startswith("cuda")
    if here:
        dev = torch.device(device or "cuda")
        total = torch.cuda.get_device_properties(
            dev if dev.index is not None else torch.cuda.current_device()).total_memory  # fmt: skip
        what = f"the {torch.cuda.get_device_name(dev)}'s {total / 2**30:.1f} GiB"
    else:
        total, what = MAX_GPU_BYTES_ON_PAPER, f"{MAX_GPU_BYTES_ON_PAPER / 2**30:.0f} GiB (any GPU)"
    if cap > total:
        raise UsageError(f"--gpu-memory {cap / 2**30:.1f} GiB is more than {what}",
                         path="--gpu-memory", hint="give at most the card's memory (or "
                         "leave --gpu-memory out to plan with what is free)")  # fmt: skip
    return cap


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
