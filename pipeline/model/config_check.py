"""A source checkpoint's config.json, checked before any model is built from it: against
bounds no real model exceeds, and against its own safetensors headers (exit 3 either way).
A config that claims 100,000 layers over tiny weights otherwise has transformers build an
absurd meta model for minutes before anything fails."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import IntegrityError
from ..io.problems import Problems
from .checkpoint import check_layers, read_headers, stored_tensors, text_config
from .files import collect_config_json

# Far above any causal LM there is (the largest vocabularies are ~260k, the deepest models
# ~120 layers): a config beyond these describes no real model and would make transformers
# build an absurd meta model for minutes or hours before anything else fails.
CONFIG_BOUNDS = {"num_hidden_layers": 1024, "vocab_size": 4_194_304, "hidden_size": 131_072,
                 "intermediate_size": 1_048_576, "num_attention_heads": 4096,
                 "num_experts": 16_384, "num_local_experts": 16_384}  # fmt: skip


def check_config_bounds(config: dict, *, where: str) -> None:
    """Exit 3 for a config.json that describes no real model (CONFIG_BOUNDS)."""
    cfg = text_config(config)
    bad = [f"{k} {cfg[k]:,} (at most {limit:,})" for k, limit in CONFIG_BOUNDS.items()
           if isinstance(cfg.get(k), int) and not 0 < cfg[k] <= limit]  # fmt: skip
    if bad:
        raise IntegrityError(
            "config.json describes no real model: " + "; ".join(bad),
            path=where,
            hint="the model's config.json is corrupt or hostile; fetch it again from a "
            "trusted source",
        )


def check_source_weights(root: Path) -> None:
    """An unquantized checkpoint's config.json against its safetensors headers, before any
    model is built from it: the decoder layers stored, the embedding's (vocab_size,
    hidden_size) and a dense MLP's intermediate_size. Any disagreement is exit 3."""
    root = Path(root)
    p = Problems(root, hint="config.json does not describe these weights: the checkpoint "
                 "is corrupt or altered; fetch it again from a trusted source")  # fmt: skip
    config = collect_config_json(root, p)
    p.raise_if_any("config check")
    assert config is not None
    check_config_bounds(config, where=str(root / "config.json"))
    headers = read_headers(root, p)
    p.raise_if_any("safetensors header check")
    tensors = stored_tensors(root, headers, p)
    p.raise_if_any("safetensors index check")
    cfg = text_config(config)
    check_layers(cfg, tensors, p)
    vocab, hidden, inter = (cfg.get(k) for k in ("vocab_size", "hidden_size", "intermediate_size"))
    for name, (rel, info) in sorted(tensors.items()):
        if name.endswith("embed_tokens.weight") and isinstance(vocab, int) \
                and isinstance(hidden, int) and tuple(info.shape) != (vocab, hidden):  # fmt: skip
            p.add(rel, f"{name} is {tuple(info.shape)}, config.json says (vocab_size {vocab}, "
                       f"hidden_size {hidden})")  # fmt: skip
        if re.search(r"\.mlp\.(gate|up)_proj\.weight$", name) and isinstance(inter, int) \
                and info.shape and info.shape[0] != inter:  # fmt: skip
            p.add(rel, f"{name} has {info.shape[0]} rows, config.json says intermediate_size "
                       f"{inter}")  # fmt: skip
    p.raise_if_any("weights vs config.json check")
