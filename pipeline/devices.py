"""Where and in which precision the model math runs.

16-bit matrix products have no fast kernels on most CPUs: on this project's 2-core AMD
EPYC a bf16 640x1536 GEMM ran at 0.2 GFLOP/s against 14.6 in float32 (70x slower), which
made AWQ's grid search take minutes per layer. So on the CPU the weights are upcast to
float32 for the computation (exact: every bf16 value is a float32 value) and the
checkpoint is written back in the recipe's dtype; on a GPU the recipe's dtype is used.
"""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return torch.float32 if device.split(":")[0] == "cpu" else dt
