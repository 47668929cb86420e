"""Narrow, scoped patches of llm-compressor 0.14 (each restored on exit) and the routing of
its log records. Why each exists is in its docstring; tests/test_quantize.py holds each to
the library's own result."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import StageError


def _owner(obj: Any) -> str:
    return str(getattr(obj, "__module__", None) or getattr(obj, "__name__", "?"))


def check_replaceable(obj: Any, attr: str, params: tuple[str, ...]) -> Any:
    """The attribute a patch replaces, as the pinned library version has it: present and
    taking exactly `params`. Anything else is a library qship's patches were not written
    for: exit 1 naming it and its version, instead of a patch that silently does nothing or
    breaks the library."""
    from importlib import metadata

    where = f"{getattr(obj, '__name__', type(obj).__name__)}.{attr}"
    dist = _owner(obj).split(".")[0].replace("_", "-")
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = "?"
    if not hasattr(obj, attr):
        raise StageError(
            f"{dist} {version} has no {where}, which qship replaces while it quantizes",
            path=f"{_owner(obj)}.{attr}",
            hint="install the versions in constraints.txt (llmcompressor 0.14.0.1, "
            "compressed-tensors 0.19.0); qship's patches are written for those",
        )
    current = obj.__dict__[attr] if attr in getattr(obj, "__dict__", {}) else getattr(obj, attr)
    if callable(getattr(obj, attr)):
        got = tuple(inspect.signature(getattr(obj, attr)).parameters)
        if got != params:
            raise StageError(
                f"{dist} {version}: {where} takes ({', '.join(got)}), qship's patch of it "
                f"expects ({', '.join(params)})",
                path=f"{_owner(obj)}.{attr}",
                hint="install the versions in constraints.txt (llmcompressor 0.14.0.1, "
                "compressed-tensors 0.19.0); qship's patches are written for those",
            )
    return current


@contextlib.contextmanager
def patched(obj: Any, attr: str, value: Any, *, params: tuple[str, ...]) -> Iterator[None]:
    """`obj.attr = value` inside the block, restored after; `params`: the parameters the
    replaced attribute takes in the pinned library (check_replaceable)."""
    old = check_replaceable(obj, attr, params)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


@contextlib.contextmanager
def without_accelerator() -> Iterator[bool]:
    """What in llm-compressor 0.14 / compressed-tensors 0.19 fails without an accelerator.
    Only then, and only inside this block:
    1. AWQ pins its cached activations ('Cannot access accelerator device when none is
       available'): the pinning is a no-op;
    2. distributed AWQ sends its sums to `torch.accelerator.current_accelerator()` (None)
       to all-reduce them: they are all-reduced on the CPU (gloo);
    3. distributed offloading keeps the weights in CPU memory shared by the ranks, and with
       the CPU as the onload device an onloaded weight *is* that shared tensor, so AWQ's
       in-place `weight.div_(scales)` ran once per rank (mean KL 0.069 instead of 0.031 on
       tiny-llama, 2 ranks): a CPU rank onloads a copy, as a GPU rank does.
    Yields True when it patched (the record's cpu_pin_memory_patch)."""
    if torch.accelerator.is_available():
        yield False
        return
    import torch.distributed as dist
    from compressed_tensors.distributed.utils import wait_for_comms
    from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache
    from llmcompressor.modifiers.transform.awq import base as awq_base
    from llmcompressor.pipelines.cache import IntermediatesCache

    def _no_pin(self, batch_index, input_names=None):
        return None

    def _allreduce_in_place(data: list[torch.Tensor]) -> list[torch.Tensor]:
        wait_for_comms([dist.all_reduce(d, op=dist.ReduceOp.SUM, async_op=True) for d in data])
        return data

    def _onload_copy(self, offloaded):
        return None if offloaded is None else offloaded.to(self.onload_device, copy=True)

    with (
        patched(
            IntermediatesCache, "pin_memory", _no_pin, params=("self", "batch_index", "input_names")
        ),
        patched(awq_base, "_allreduce_data_sum", _allreduce_in_place, params=("data",)),
        patched(DistributedCPUCache, "onload", _onload_copy, params=("self", "offloaded")),
    ):
        yield True


@contextlib.contextmanager
def rank_local_device() -> Iterator[None]:
    """llm-compressor 0.14 computes on `<accelerator>:<global rank>`, which on the second
    node of a multi-node run names a GPU that node does not have (rank 8 -> cuda:8 with 8
    GPUs a node). Under torch.distributed with an accelerator, inside this block, it is the
    device this rank selected (`torch.accelerator.current_device_index()`: LOCAL_RANK)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and torch.accelerator.is_available()):
        yield
        return
    from llmcompressor.pipelines.data_free import pipeline as data_free
    from llmcompressor.pipelines.sequential import pipeline as sequential
    from llmcompressor.utils import dev

    def local() -> torch.device:
        kind = torch.accelerator.current_accelerator()
        assert kind is not None
        return torch.device(kind.type, torch.accelerator.current_device_index())

    with contextlib.ExitStack() as stack:
        for mod in (dev, sequential, data_free):
            stack.enter_context(patched(mod, "get_main_device", local, params=()))
        yield


@contextlib.contextmanager
def awq_lean_grid_search() -> Iterator[None]:
    """AWQ's grid search with less alive at once; the same scales (tests/test_quantize.py).

    For each smoothing parent (the attention block) llm-compressor 0.14 runs the parent over
    every cached batch once unquantized and once per grid point, and keeps whole lists:
    1. under the eager attention it calibrates with, each output is the tuple (output,
       attention weights) and every batch's tuple lives until the list is built (268 MB at
       Gemma 3 270M's peak): here each output is cut to its first element as it is made;
    2. each grid point's quantized outputs are all built before `_compute_loss` compares
       them batch by batch with the unquantized ones (one full copy of the parent's output,
       537 MB for an 8B at 128 x 512 tokens): here, inside `_compute_best_scale`, they are
       made lazily, so the loss consumes each batch before the next exists.
    """
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.transform.awq import AWQModifier

    grid = AWQModifier.__dict__["_compute_best_scale"]
    in_grid = [0]

    def run_samples(self, module):
        cache = self._parent_args_cache[module]
        batches = cache.iter_prefetch() if active_session().state.sequential_prefetch else cache
        outs = (_first_output(module(**batch)) for batch in batches)
        return outs if in_grid[0] else list(outs)

    def compute_best_scale(self, *args, **kwargs):
        in_grid[0] += 1
        try:
            return grid(self, *args, **kwargs)
        finally:
            in_grid[0] -= 1

    with (
        patched(AWQModifier, "_run_samples", run_samples, params=("self", "module")),
        patched(
            AWQModifier,
            "_compute_best_scale",
            compute_best_scale,
            params=("self", "mapping", "fp16_outputs", "orig_layer_weights"),
        ),
    ):
        yield


@contextlib.contextmanager
def hooked_attention_stays_hooked() -> Iterator[None]:
    """llm-compressor 0.14 forces eager attention while it calibrates by setting
    `model.config._attn_implementation = "eager"` (utils/helpers.py:use_eager_attention: the
    sequential pipeline's traced graph needs eager's causal mask). On a model whose
    attention compressed-tensors hooked for attention quantization ("ct_hooked_attention")
    that bypasses the hook: the query is never observed and its q_scale is saved as
    uninitialized memory (1e-43 to 1e21 on the tiny Llama), while K and V, hooked through
    the cache, calibrate. Inside the block such a model keeps its hook (which runs the
    model's own attention function: compressed-tensors cannot wrap eager, which transformers
    does not register) and gets eager's causal mask, the tensor the trace expects."""
    import llmcompressor.utils.helpers as helpers
    from compressed_tensors.modeling import attention as ct_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks

    original = check_replaceable(helpers, "use_eager_attention", ("model",))
    hooked = ct_attention.HOOKED_ATTENTION_NAME

    @contextlib.contextmanager
    def use_eager_attention(model: Any) -> Iterator[None]:
        if getattr(getattr(model, "config", None), "_attn_implementation", None) != hooked:
            with original(model):
                yield
            return
        old_mask = masks[hooked]
        masks.register(hooked, masks["eager"])  # a mask tensor always, as the trace expects
        try:
            yield
        finally:
            masks.register(hooked, old_mask)

    with patched(helpers, "use_eager_attention", use_eager_attention, params=("model",)):
        yield


@contextlib.contextmanager
def pinned_cache_released_per_module() -> Iterator[None]:
    """With --offload cpu the weights are page-locked host copies. Saving compresses them
    module by module (compressed-tensors' compress_module, in place); each module's freed
    16-bit blocks would stay in torch's caching host allocator until the save ends -- host
    memory held beside the new compressed copy (the 8B's save was its run's peak, 1.43x
    the weights, H100 2026-12-05). Inside the block each module's compression hands them
    back at once (memory.release_pinned_cache)."""
    import compressed_tensors.compressors.model_compressors.model_compressor as mc

    from .memory import release_pinned_cache

    original = check_replaceable(mc, "compress_module", ("module", "format"))

    def compress_module(module: Any, format: Any = None) -> None:
        original(module, format)
        release_pinned_cache()

    with patched(mc, "compress_module", compress_module, params=("module", "format")):
        yield


@contextlib.contextmanager
def device_map_only_when_offloaded() -> Iterator[None]:
    """llm-compressor 0.14's pipelines put every module under compressed-tensors' offloading,
    with its weights kept where they are (on the GPU, or in host memory on a CPU run), and
    its compressed save converts that to accelerate's (`to_accelerate`), writing an
    `hf_device_map` that names each such module's weight device -- "cpu" on a CPU run -- and
    "cpu" for any module without offloading (the activation observers on a GPU). So on a
    model that is not offloaded at all transformers warned "Attempting to save a model with
    offloaded modules" and saved it as an offloaded one (weight renames reverted shard by
    shard). Inside the block the conversion runs as before, but a model none of whose
    weights live away from the device it computes on (no --offload cpu|disk) keeps no
    device map: transformers saves it as the model on one device it is."""
    import llmcompressor.transformers.compression.compressed_tensors_utils as ctu

    from ..model.loading import weights_elsewhere

    original = check_replaceable(ctu, "to_accelerate", ("model",))

    def to_accelerate(model: Any) -> dict[str, str]:
        elsewhere = weights_elsewhere(model)
        homes = original(model)
        if not elsewhere and hasattr(model, "hf_device_map"):
            del model.hf_device_map
        return homes

    with patched(ctu, "to_accelerate", to_accelerate, params=("model",)):
        yield


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def _stdout_is_stderr() -> Iterator[None]:
    old = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = old


def import_llmcompressor() -> None:
    """Import llm-compressor so that its loguru console handler (which it binds to
    sys.stdout at import, and which logs during import) writes to stderr: qship's
    stdout is reserved for `--json` results."""
    if "llmcompressor" not in sys.modules:
        with _stdout_is_stderr():
            import llmcompressor  # noqa: F401


@contextlib.contextmanager
def library_logs_to_stderr() -> Iterator[None]:
    """Inside this block llm-compressor's records go to sys.stderr as it is now (the run
    log while qship captures library output), WARNING and up (or LLM_COMPRESSOR_LOG_LEVEL);
    afterwards its default INFO console handler is put back, on stderr as well."""
    import importlib
    import os

    from loguru import logger

    import_llmcompressor()
    # `import llmcompressor.logger` would give the package's `logger` attribute (loguru)
    lcl = importlib.import_module("llmcompressor.logger")
    level = os.environ.get("LLM_COMPRESSOR_LOG_LEVEL", "WARNING").upper()

    def keep(record) -> bool:
        # In one sequential pass GPTQModifier's layer end re-runs update_qparams on the KV
        # observers that QuantizationModifier already consumed; llm-compressor then warns
        # "Attempted to calibrate a module k/v without statistics" and leaves the scale
        # as it was. Spurious here (verify_tensors checks the saved k/v scales instead).
        msg = record["message"]
        if msg.startswith(
            ("Attempted to calibrate a module k ", "Attempted to calibrate a module v ")
        ):
            return False
        return lcl.support_log_once(record)

    logger.remove()
    hid = logger.add(
        sys.stderr,
        level=level,
        format="{time:HH:mm:ss} | {function} | {level} - {message}",
        filter=keep,
    )
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            logger.remove(hid)
        with _stdout_is_stderr():
            lcl.configure_logger(lcl.LOGGER_CONFIG)
