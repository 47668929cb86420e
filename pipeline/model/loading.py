"""The one model loader (real weights, or the module tree on the meta device from a config)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..compat.compressed_tensors_0_19 import offload_caches
from ..errors import QshipError, UsageError
from .devices import device_kind
from .files import read_config_json, require_config_file
from .moe import linearize, linearize_meta, loading_linear_experts


def _require_checkpoint(path: Path) -> Path:
    require_config_file(Path(path))
    return Path(path)


OFFLOAD_MODES = ("none", "cpu", "disk")


def load_model(
    path: Path,
    *,
    device: str,
    dtype: str | None = None,
    linear_experts: bool = False,
    offload: str = "none",
    offload_dir: Path | None = None,
    pin: bool = True,
) -> Any:
    """A causal LM in eval mode that computes on `device`. dtype None: float32 on the CPU
    (16-bit GEMMs are ~70x slower there, devices.py), the checkpoint's own dtype elsewhere.
    Compressed checkpoints are decompressed by transformers (compressed-tensors), FP8 KV
    hooks on. `linear_experts`: MoE experts as per-expert Linear modules (moe.py), to
    quantize them.

    `offload`: where the weights live while the model computes on `device` -- "none" all on
    `device`; "cpu" in host memory, "disk" memory-mapped safetensors under `offload_dir`,
    each module's weights moved to `device` for its forward (compressed-tensors' offloading,
    which llm-compressor's sequential pipeline onloads one decoder layer at a time). Under
    torch.distributed rank 0 reads the weights and the other ranks share them. `pin`: page-
    lock the host copies of an offloaded model (for a model that computes much; a single
    check does not repay pinning 16 GB, 7 s on an 8B, nor the pinned cache it leaves)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = _require_checkpoint(path)
    if dtype is None and device_kind(device) == "cpu":
        dtype = "float32"
    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    if offload == "cpu" and device_kind(device) == "cpu" and not _distributed():
        offload = "none"  # host memory is where the weights are anyway
    if offload == "none" and not _distributed():
        # read straight onto an accelerator, where a compressed checkpoint is then unpacked
        # (read to the host first, the host unpacked every int4 expert: the reload check took
        # 223 of an 8-layer MoE quantize's 378 s, H100 2026-12-06)
        on = {"device_map": device} if device_kind(device) != "cpu" else {}
        with warnings.catch_warnings(), _experts(path, linear_experts):
            # "loading attributes ... will be overwritten": asked for
            warnings.filterwarnings("ignore", message=".*quantization_config.*")
            model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype,
                                                               output_loading_info=True, **on,
                                                               **_dequantized(path))  # fmt: skip
        _require_complete(path, info)
        _cast_strays(model, torch_dtype)
        if linear_experts:
            linearize(model)
        return model.to(device).eval()
    if offload not in OFFLOAD_MODES:
        raise UsageError(f"offload {offload!r} is not one of {', '.join(OFFLOAD_MODES)}",
                         path="--offload", hint="use none, cpu or disk")  # fmt: skip
    if offload == "disk" and offload_dir is None:
        raise UsageError("offload to disk needs a folder", path="--offload",
                         hint="pass offload_dir (qship uses a folder in the stage cache)")  # fmt: skip
    import psutil
    from compressed_tensors.offload import load_offloaded_model, set_onload_device

    # the weights' home: the compute device itself ("none" under torch.distributed: every
    # rank gets rank 0's copy), host memory, or safetensors files on disk
    where: Any = {"none": device, "cpu": "cpu", "disk": {"": "disk"}}[offload]
    kw: dict[str, Any] = {"device_map": where, "dtype": torch_dtype}
    if offload != "none" or device_kind(device) == "cpu":
        # compressed-tensors' own memory estimate asks for an accelerator
        kw["max_memory"] = {"cpu": int(psutil.virtual_memory().available)}
    if offload == "disk":
        kw["offload_folder"] = str(offload_dir)
    with load_offloaded_model(), _experts(path, linear_experts):
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    if linear_experts:
        linearize(model)
    set_onload_device(model, torch.device(device))
    if pin and offload == "cpu" and device_kind(device) == "cuda" and not _distributed():
        _pin(model)
    return model.eval()


def _experts(path: Path, linear: bool) -> contextlib.AbstractContextManager[Any]:
    """Per-expert Linear experts read as such where the family and checkpoint allow (the
    `linearize` after loading then finds nothing left to split)."""
    return loading_linear_experts(path) if linear else contextlib.nullcontext()


def _dequantized(path: Path) -> dict[str, Any]:
    """For a compressed-tensors checkpoint: decompress the weights while loading, so every
    Linear has its dense `weight` before any forward (transformers 5.17's default leaves
    them packed until the first forward, which qship's served numerics cannot wait for)."""
    try:
        qc = read_config_json(path).get("quantization_config") or {}
    except QshipError:  # not readable: transformers' own load names the problem
        return {}
    if qc.get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def _require_complete(path: Path, info: dict[str, Any]) -> None:
    """A parameter the checkpoint did not fill is initialized at random by transformers, with
    only a log line: the model would look loaded and compute garbage. Fail instead."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        from ..errors import StageError

        raise StageError(
            f"transformers loaded {len(missing)} parameter(s) of {path.name} from nothing (they "
            f"would be random): {', '.join(missing[:4])}" + (" …" if len(missing) > 4 else ""),
            path=str(path / "config.json"),
            hint="the checkpoint's tensor names do not match what this transformers version "
            "loads (constraints.txt pins the versions qship is tested with)",
        )


def _cast_strays(model: Any, dtype: Any) -> None:
    """Floating parameters left in the checkpoint's dtype although another was asked for
    (transformers 5.17 leaves Mixtral's router, renamed on load from block_sparse_moe.gate,
    in bf16 when float32 is asked: the first forward fails on the dtype mix)."""
    if isinstance(dtype, str):  # "auto": the checkpoint's own dtypes are wanted
        return
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _pin(model: Any) -> int:
    """Page-lock the host copies of an offloaded model: every layer crosses to the GPU and
    back, and pageable memory halves that copy's speed. Packed into blocks (pinning.py):
    pinned one by one, an MoE's 3 MiB experts took 4 MiB each. (Under torch.distributed
    the copies are shared memory, which stays as it is.) Returns the bytes pinned."""
    from .pinning import pack

    return pack({id(t): t for t in pageable_host_copies(model)}.values())


def pageable_host_copies(model: Any) -> Iterator[Any]:
    """The offloaded weights and buffers held in pageable host memory, in module order (a
    tensor two modules share comes twice unless pinned when it is reached again)."""
    for m in model.modules():
        for cache in offload_caches(m):
            for t in cache.offloaded_values.values():
                if t is not None and t.device.type == "cpu" and not t.is_pinned():
                    yield t


def weights_in_place(model: Any) -> contextlib.AbstractContextManager[None]:
    """Inside: an offloaded model's parameters are the tensors where they live (host memory,
    or meta for disk) instead of a fresh GPU copy per access -- for reading shapes, sizes
    and which parameters are shared (the plan). Each access would otherwise onload: 17.1 GB
    on the GPU for an 8B (bench/RESULTS.md "Models bigger than the GPU")."""
    from compressed_tensors.offload import disable_onloading

    return disable_onloading() if offloaded(model) else contextlib.nullcontext()


def offloaded(model: Any) -> bool:
    return any(offload_caches(m) for m in model.modules())


def weights_elsewhere(model: Any) -> bool:
    """Whether any module keeps its weights away from the device it computes on (offloaded
    to host memory or disk). llm-compressor's pipelines put every module under offloading
    with its weights where they are, which `offloaded` counts and this does not."""
    from compressed_tensors.offload.convert.helpers import norm_device

    return any(
        norm_device(c.offload_device) != norm_device(c.onload_device)
        for m in model.modules()
        for c in offload_caches(m)
    )


def _distributed() -> bool:
    from compressed_tensors.distributed import is_distributed

    return bool(is_distributed())


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
