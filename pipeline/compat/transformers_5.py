"""transformers 5's private state as qship reads or writes it (table.PATCHES)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .patching import check


def attn_implementation(model: Any) -> str:
    """The attention implementation a model runs (its config's, which transformers keeps
    private); "" for an object without one."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "")


@contextlib.contextmanager
def attention_function(impl: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Inside: this process's attention registry runs `fn` for `impl` (transformers'
    per-process override: AttentionInterface's item assignment); after, the override that
    was there before, or none."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    check("transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS._local_mapping")
    local = registry._local_mapping
    had, old = impl in local, local.get(impl)
    registry[impl] = fn
    try:
        yield
    finally:
        if had:
            registry[impl] = old
        else:
            local.pop(impl, None)


@contextlib.contextmanager
def conversion_mapping_restored(model_type: str | None) -> Iterator[None]:
    """transformers' checkpoint conversion table for `model_type` (and whether a user
    registered one) as it is now, put back on exit: llm-compressor's MoE loading leaves
    its save mapping registered, with which a later load of the fused model in this
    process would find none of its expert tensors."""
    import transformers.conversion_mapping as cm

    cm.get_checkpoint_conversion_mapping(model_type)  # the table built
    check("transformers.conversion_mapping:_checkpoint_conversion_mapping_cache")
    table, users = cm._checkpoint_conversion_mapping_cache, cm.USER_REGISTERED_MAPPINGS
    before, registered = table.get(model_type), model_type in users
    try:
        yield
    finally:
        if before is None:
            table.pop(model_type, None)
        else:
            table[model_type] = before
        if not registered:
            users.discard(model_type)
