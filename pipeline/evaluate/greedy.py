"""Greedy agreement, label-free: do both models write the same continuation?

The first `prompt_tokens` tokens of the first `greedy_prompts` held-out windows are
continued greedily for `greedy_tokens` tokens by the reference and by the candidate (as
served: evaluate runs it inside vLLM's simulated numerics). The figures are the share of
continuations identical token for token, and the mean position of the first token that
differs (`greedy_tokens` where none does): a drift that grows along a long output shows
here without any labels, where a per-position KL or top-1 agreement, each position fed
the reference's own text, cannot see it compound.

The reference's continuations are cached (`reference-greedy/<key>`, beside the reference
log-probs: key = model hash, prompts, tokens, dtype, device kind), so N recipes cost one
reference generation. End of text does not stop a continuation (`min_new_tokens`): both
models always write exactly N tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..data.tokens import tensor_hash
from ..io.cache import StageCache, stage_key
from ..model.devices import device_kind
from ..records.evaluation import GreedyAgreement

STAGE = "reference-greedy"
FILE = "continuations.safetensors"
PROMPT_TOKENS = 64  # the prompt: the window's first tokens (fewer when windows are shorter)
ENGINE = "transformers (qship's served-numerics simulation), greedy, batch of equal-length prompts"


def prompts(heldout_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` held-out windows cut to their first PROMPT_TOKENS tokens (at most
    half a window, so the continuation is text the model has not been shown)."""
    length = max(1, min(PROMPT_TOKENS, heldout_ids.shape[1] // 2))
    return heldout_ids[:n, :length].contiguous()


@torch.no_grad()
def continue_greedily(model: Any, ids: torch.Tensor, tokens: int, batch_size: int) -> torch.Tensor:
    """[prompts, tokens]: each prompt's greedy continuation, exactly `tokens` long."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, ids.shape[0], batch_size):
        batch = ids[s : s + batch_size].to(device)
        gen = model.generate(
            input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
            max_new_tokens=tokens, min_new_tokens=tokens, num_beams=1,
            pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None
            else model.config.pad_token_id,
            top_p=None, top_k=None, temperature=None,
        )  # fmt: skip
        out.append(gen[:, batch.shape[1] :].cpu())
    return torch.cat(out)


def agreement(reference: torch.Tensor, candidate: torch.Tensor) -> GreedyAgreement:
    """Share identical and mean first differing position of two [prompts, tokens] sets."""
    n, length = reference.shape
    same = reference == candidate
    # first False per row; rows with none count as `length`
    first = torch.where(same.all(1), length, (~same).int().argmax(1))
    return GreedyAgreement(
        prompts=n, tokens=length, identical=float(same.all(1).float().mean()),
        mean_first_difference=float(first.float().mean()),
        token_agreement=float(same.float().mean()), engine=ENGINE,
    )  # fmt: skip


def reference_continuations(
    cache_dir: Path, model_hash: str, ids: torch.Tensor, *, tokens: int, dtype: str,
    device: str, batch_size: int, load: Callable[[], Any],
) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """The reference's continuations of `ids`, from the cache or generated once. -> (them,
    cache hit)."""
    key = stage_key(STAGE, {"model_hash": model_hash, "prompts": tensor_hash(ids),
                            "tokens": tokens, "dtype": dtype, "device": device_kind(device)})  # fmt: skip

    def build(tmp: Path) -> dict[str, Any]:
        model = load()
        cont = continue_greedily(model, ids, tokens, batch_size)
        del model
        save_file({"continuations": cont.contiguous()}, str(tmp / FILE))
        return {"file": FILE, "prompts": int(ids.shape[0]), "tokens": tokens}

    entry = StageCache(Path(cache_dir)).get_or_build(STAGE, key, build)
    return load_file(str(entry.path / FILE))["continuations"], entry.hit
