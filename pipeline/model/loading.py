"""The one model loader (real weights, or the module tree on the meta device from a config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from .devices import device_kind
from .moe import linearize, linearize_meta


def _require_checkpoint(path: Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{path} is not a checkpoint directory (no config.json)",
            path=str(path),
            hint="pass a folder with config.json and *.safetensors (e.g. written by qship fetch)",
        )
    return path


def load_model(
    path: Path, *, device: str, dtype: str | None = None, linear_experts: bool = False
) -> Any:
    """A causal LM in eval mode on `device`. dtype None: float32 on the CPU (16-bit GEMMs
    are ~70x slower there, devices.py), the checkpoint's own dtype elsewhere. Compressed
    checkpoints are decompressed by transformers (compressed-tensors), FP8 KV hooks on.
    `linear_experts`: MoE experts as per-expert Linear modules (moe.py), to quantize them."""
    import torch
    from transformers import AutoModelForCausalLM

    path = _require_checkpoint(path)
    if dtype is None and device_kind(device) == "cpu":
        dtype = "float32"
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype) if dtype else "auto"
    )
    if linear_experts:
        linearize(model)
    return model.to(device).eval()


def load_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(_require_checkpoint(path)))


def meta_model(config: Any) -> Any:
    """The model's module tree on the meta device (no weights read, no memory used), MoE
    experts as the per-expert Linear modules that quantize and the checkpoint have."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linearize_meta(model)
    return model


def load_meta_model(path: Path) -> Any:
    return meta_model(load_config(path))
