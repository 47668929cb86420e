"""llm-compressor 0.14's attributes as qship replaces them, each inside a block and put back
after (patching.patched; why each exists is in its docstring and in table.PATCHES), and the
routing of its log records. The callers hand in what qship does at each point; the
library's names and signatures stay here."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .compressed_tensors_0_19 import cpu_rank_onloads_a_copy
from .patching import original, patched

if TYPE_CHECKING:
    import torch

_AWQ = "llmcompressor.modifiers.transform.awq:AWQModifier"
_GPTQ = "llmcompressor.modifiers.gptq"


@contextlib.contextmanager
def without_accelerator() -> Iterator[bool]:
    """What in llm-compressor 0.14 / compressed-tensors 0.19 fails without an accelerator.
    Only then, and only inside this block:
    1. AWQ pins its cached activations ('Cannot access accelerator device when none is
       available'): the pinning is a no-op;
    2. distributed AWQ sends its sums to `torch.accelerator.current_accelerator()` (None)
       to all-reduce them: they are all-reduced on the CPU (gloo);
    3. a CPU rank onloads a copy of an offloaded weight (cpu_rank_onloads_a_copy).
    Yields True when it patched (the record's cpu_pin_memory_patch)."""
    import torch

    if torch.accelerator.is_available():
        yield False
        return
    import torch.distributed as dist
    from compressed_tensors.distributed.utils import wait_for_comms

    def _no_pin(self, batch_index, input_names=None):
        return None

    def _allreduce_in_place(data: list[torch.Tensor]) -> list[torch.Tensor]:
        wait_for_comms([dist.all_reduce(d, op=dist.ReduceOp.SUM, async_op=True) for d in data])
        return data

    with (
        patched("llmcompressor.pipelines.cache:IntermediatesCache.pin_memory", _no_pin),
        patched(
            "llmcompressor.modifiers.transform.awq.base:_allreduce_data_sum", _allreduce_in_place
        ),  # fmt: skip
        cpu_rank_onloads_a_copy(),
    ):
        yield True


@contextlib.contextmanager
def rank_local_device() -> Iterator[None]:
    """llm-compressor 0.14 computes on `<accelerator>:<global rank>`, which on the second
    node of a multi-node run names a GPU that node does not have (rank 8 -> cuda:8 with 8
    GPUs a node). Under torch.distributed with an accelerator, inside this block, it is the
    device this rank selected (`torch.accelerator.current_device_index()`: LOCAL_RANK)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and torch.accelerator.is_available()):
        yield
        return

    def local() -> torch.device:
        kind = torch.accelerator.current_accelerator()
        assert kind is not None
        return torch.device(kind.type, torch.accelerator.current_device_index())

    with contextlib.ExitStack() as stack:
        for mod in ("utils.dev", "pipelines.sequential.pipeline", "pipelines.data_free.pipeline"):
            stack.enter_context(patched(f"llmcompressor.{mod}:get_main_device", local))
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

    grid = original(f"{_AWQ}._compute_best_scale")
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
        patched(f"{_AWQ}._run_samples", run_samples),
        patched(f"{_AWQ}._compute_best_scale", compute_best_scale),
    ):
        yield


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


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
    from compressed_tensors.modeling import attention as ct_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks

    from .transformers_5 import attn_implementation

    target = "llmcompressor.utils.helpers:use_eager_attention"
    library_eager = original(target)
    hooked = ct_attention.HOOKED_ATTENTION_NAME

    @contextlib.contextmanager
    def use_eager_attention(model: Any) -> Iterator[None]:
        if attn_implementation(model) != hooked:
            with library_eager(model):
                yield
            return
        old_mask = masks[hooked]
        masks.register(hooked, masks["eager"])  # a mask tensor always, as the trace expects
        try:
            yield
        finally:
            masks.register(hooked, old_mask)

    with patched(target, use_eager_attention):
        yield


@contextlib.contextmanager
def observing_calibration(
    on_gptq_loss: Callable[[Any, float], None],
    on_awq_results: Callable[[list[dict[str, Any]]], None],
    on_layer_end: Callable[[list[Any], Callable[[], Any]], Any],
) -> Iterator[None]:
    """Inside: `on_gptq_loss(module, loss)` as GPTQ logs a module's error;
    `on_awq_results(metrics)` as AWQ logs its per-mapping results; the sequential
    pipeline's end of a subgraph calls `on_layer_end(modules, run)`, which decides whether
    the library's own epoch end runs (`run()`) and returns what it returns."""
    set_results = original("llmcompressor.utils.metric_logging:CompressionLogger.set_results")
    log_error_metrics = original(f"{_AWQ}._log_error_metrics")
    epoch_end = original("llmcompressor.core:LifecycleCallbacks.sequential_epoch_end")

    def logged(self, name=None, loss=None):
        if loss is not None:
            on_gptq_loss(self.module, float(loss))
        return set_results(self, name=name, loss=loss)

    def awq_logged(self):
        on_awq_results(list(self._error_metrics))
        return log_error_metrics(self)

    def layer_end(cls, modules, **kwargs):
        modules = list(modules)
        return on_layer_end(modules, lambda: epoch_end.__func__(cls, modules, **kwargs))

    with (
        patched("llmcompressor.utils.metric_logging:CompressionLogger.set_results", logged),
        patched(f"{_AWQ}._log_error_metrics", awq_logged),
        patched(
            "llmcompressor.core:LifecycleCallbacks.sequential_epoch_end", classmethod(layer_end)
        ),  # fmt: skip
    ):
        yield


def awq_results(modifier: Any) -> list[dict[str, Any]]:
    """AWQ's per-mapping results so far (it logs them only when it finishes)."""
    return list(modifier._error_metrics)


@contextlib.contextmanager
def subgraph_forward_wrapped(wrap: Callable[[Any, Any, Callable[[], Any]], Any]) -> Iterator[None]:
    """Inside: each call of a sequential-pipeline subgraph is `wrap(subgraph, model, run)`,
    `run()` the library's own forward of it."""
    target = "llmcompressor.pipelines.sequential.helpers:Subgraph.forward"
    forward = original(target)

    def subgraph_forward(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        return wrap(self, model, lambda: forward(self, model, *args, **kwargs))

    with patched(target, subgraph_forward):
        yield


@contextlib.contextmanager
def gptq_block_update_for(
    selected: Callable[[Any], bool], update: Callable[..., None]
) -> Iterator[list[int]]:
    """GPTQ's block update, for the modules `selected(module)` picks, is `update(W1, Hinv1,
    Q1, Err1, losses1, scale=, eff=)` (`eff`: each column's effective scale), and the
    library's own (its Triton kernel on a GPU) for the rest. llm-compressor 0.14 quantizes
    modules in batches of one weight scheme and hands the block update neither module nor
    activation scheme, so batches are split into selected and other modules and
    `prepare_batch` notes which kind is running. Yields a one-item list: how many modules
    went through `update`, once the block ends."""
    assign = original(f"{_GPTQ}.base:assign_batches")
    prepare = original(f"{_GPTQ}.base:prepare_batch")
    library_update = original(f"{_GPTQ}.gptq_quantize:gptq_block_update")
    window = original(f"{_GPTQ}.gptq_quantize:column_scale_window")
    chosen = [False]
    count = [0]

    def assign_batches(module_list: Any, batched_quantization: Any, block_size: int) -> Any:
        out = []
        for batch in assign(module_list, batched_quantization, block_size):
            for kind in (True, False):
                part = [m for m in batch if selected(m) is kind]
                out += [part] if part else []
        return out

    def prepare_batch(batch: Any, batch_qparams: Any, hessians_by_module: Any,
                      num_samples_by_module: Any) -> Any:  # fmt: skip
        chosen[0] = selected(batch[0])
        count[0] += len(batch) if chosen[0] else 0
        return prepare(batch, batch_qparams, hessians_by_module, num_samples_by_module)

    def block_update(W1: Any, Hinv1: Any, Q1: Any, Err1: Any, losses1: Any, *, scale: Any,
                     zero_point: Any, global_scale: Any, g_idx: Any, quant_args: Any,
                     i1: int) -> None:  # fmt: skip
        if not chosen[0]:
            return library_update(W1, Hinv1, Q1, Err1, losses1, scale=scale,
                                  zero_point=zero_point, global_scale=global_scale,
                                  g_idx=g_idx, quant_args=quant_args, i1=i1)  # fmt: skip
        eff, _ = window(scale, zero_point, global_scale, g_idx, quant_args,
                        num_rows=W1.shape[-2], i1=i1, i2=i1 + W1.shape[-1])  # fmt: skip
        update(W1, Hinv1, Q1, Err1, losses1, scale=scale, eff=eff)
        return None

    with (
        patched(f"{_GPTQ}.base:assign_batches", assign_batches),
        patched(f"{_GPTQ}.base:prepare_batch", prepare_batch),
        patched(f"{_GPTQ}.gptq_quantize:gptq_block_update", block_update),
    ):
        yield count


def embeddings_stay_tied() -> contextlib.AbstractContextManager[None]:
    """AutoRound's start unties the word embeddings; inside, it leaves them as they are
    (for a recipe that quantizes neither embedding nor head)."""
    return patched("llmcompressor.modifiers.autoround.base:untie_word_embeddings",
                   lambda model: None)  # fmt: skip


@contextlib.contextmanager
def save_mapping_set_on_loaded_model() -> Iterator[None]:
    """load_quantizable_moe sets the save mapping on what from_pretrained returned, which is
    (model, loading info) when the info is asked for (qship's check that nothing loaded
    from nothing needs it): set it on the model."""
    target = "llmcompressor.modeling.moe.linearize:set_save_conversion_mapping"
    library_set = original(target)

    def on_model(loaded: Any, mappings: Any) -> Any:
        return library_set(loaded[0] if isinstance(loaded, tuple) else loaded, mappings)

    with patched(target, on_model):
        yield


@contextlib.contextmanager
def device_map_only_when_offloaded(offloaded: Callable[[Any], bool]) -> Iterator[None]:
    """llm-compressor 0.14's pipelines put every module under compressed-tensors' offloading,
    with its weights kept where they are, and its compressed save converts that to
    accelerate's (`to_accelerate`), writing an `hf_device_map` that names each module's
    weight device -- "cpu" on a CPU run, and "cpu" for any module without offloading (the
    activation observers on a GPU). So on a model that is not offloaded at all transformers
    warned "Attempting to save a model with offloaded modules" and saved it as an offloaded
    one (weight renames reverted shard by shard). Inside the block the conversion runs as
    before, but a model for which `offloaded(model)` is false (no weight lives away from the
    device it computes on) keeps no device map: transformers saves it as the model on one
    device it is."""
    target = "llmcompressor.transformers.compression.compressed_tensors_utils:to_accelerate"
    library_convert = original(target)

    def to_accelerate(model: Any) -> Any:
        elsewhere = offloaded(model)
        homes = library_convert(model)
        if not elsewhere and hasattr(model, "hf_device_map"):
            del model.hf_device_map
        return homes

    with patched(target, to_accelerate):
        yield


# ------------------------------------------------------------------ llm-compressor's logs


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
