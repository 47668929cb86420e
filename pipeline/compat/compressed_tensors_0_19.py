"""compressed-tensors 0.19's attributes as qship replaces or reads them (table.PATCHES)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .patching import original, patched


def cpu_rank_onloads_a_copy() -> contextlib.AbstractContextManager[None]:
    """Distributed offloading keeps the weights in CPU memory shared by the ranks, and with
    the CPU as the onload device an onloaded weight *is* that shared tensor, so AWQ's
    in-place `weight.div_(scales)` ran once per rank (mean KL 0.069 instead of 0.031 on
    tiny-llama, 2 ranks). Inside, a CPU rank onloads a copy, as a GPU rank does."""

    def onload_copy(self, offloaded):
        return None if offloaded is None else offloaded.to(self.onload_device, copy=True)

    return patched("compressed_tensors.offload.cache.dist_cpu:DistributedCPUCache.onload",
                   onload_copy)  # fmt: skip


@contextlib.contextmanager
def compress_module_then(after: Callable[[], None]) -> Iterator[None]:
    """Inside: the save's compression of each module (compress_module, in place) is
    followed by `after()`."""
    target = "compressed_tensors.compressors.model_compressors.model_compressor:compress_module"
    compress = original(target)

    def compress_module(module: Any, format: Any = None) -> None:
        compress(module, format)
        after()

    with patched(target, compress_module):
        yield


def hooked_attention_inner(impl: str) -> str:
    """The attention function compressed-tensors' hooked attention runs (its own name for
    it is private); any other implementation as it is."""
    from compressed_tensors.modeling import attention as ct_attention

    if impl == ct_attention.HOOKED_ATTENTION_NAME:
        return str(original("compressed_tensors.modeling.attention:"
                            "QuantizedAttentionImpl._original_impl"))  # fmt: skip
    return impl


def offload_caches(module: Any) -> list[Any]:
    """The module's parameter and buffer tables where compressed-tensors' offloading
    replaced them by an OffloadCache (it swaps torch's private tables); [] when not."""
    from compressed_tensors.offload.cache import OffloadCache

    return [c for c in (module._parameters, module._buffers) if isinstance(c, OffloadCache)]
