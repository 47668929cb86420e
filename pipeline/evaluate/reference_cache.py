"""Reference log-probs computed once per (model, held-out tokens, length, mode) and stored.

Entry: `<cache_dir>/reference/<key>/` (pipeline.cache.StageCache, atomic) with
`reference.safetensors` holding, for each of the N = sequences x (seq_len - 1) scored
positions (row-major: sequence, then position):

    topk_ids   int32   [N, k]  the reference's k most likely next tokens, sorted
    top1_id    int32   [N]     its argmax (for top-1 agreement; argmax, so ties break
                               as in the exact mode)
    topk_logp  float32 [N, k]  their log-probabilities
    tail_logp  float64 [N]     log of the mass of all other tokens (one bucket)
    next_logp  float64 [N]     log p_ref(actual next token); -next_logp is the NLL

32 x 512 positions at k = 4096 take 0.54 GB instead of 17 GB for the full 262k-vocab
distribution (8 bytes a stored token). The KL computed from it (kl_stats.kl_topk_tail) is a lower bound of the
exact KL; everything else (top-1, perplexity, Δp) is exact. `evaluate(..., exact=True)`
runs reference and candidate in lockstep over the full vocabulary instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .. import log
from ..data.tokens import tensor_hash
from ..io.cache import StageCache, stage_key
from ..records.evaluation import ModelRef, ReferenceCacheInfo
from . import kl_stats

STAGE = "reference"
FILE = "reference.safetensors"
# Measured on Gemma 3 270M (262k vocabulary, bench/RESULTS.md): the cached mean KL is
# below the exact one by 9.8 % at k = 128, 6.4 % at 256, 2.3 % at 1024, 0.54 % at 4096.
DEFAULT_TOPK = 4096


@dataclass(frozen=True)
class ReferenceEntry:
    path: Path
    key: str
    hit: bool
    record: dict[str, Any]

    def load(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / FILE))

    def info(self) -> ReferenceCacheInfo:
        return ReferenceCacheInfo(key=self.key, hit=self.hit, path=self.path, **self.record)


def reference_key(ref_hash: str, ids: torch.Tensor, *, topk: int, dtype: str) -> str:
    return stage_key(
        STAGE,
        {
            "model_hash": ref_hash,
            "ids_sha256": tensor_hash(ids),
            "mode": f"topk{topk}+tail",
            "dtype": dtype,
        },
    )


@dataclass(frozen=True)
class ReferencePass:
    """How the reference pass runs when the entry is absent (none of it is in the key)."""

    forward: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """(model, ids) -> (logits, next ids): evaluate.scoring.forward_logits."""
    load_model: Callable[[Path], Any]
    batch_size: int
    device: str


def get_or_build(
    cache_dir: Path,
    reference: ModelRef,
    ids: torch.Tensor,
    *,
    topk: int,
    dtype: str,
    run: ReferencePass,
) -> ReferenceEntry:
    """Cached reference entry; builds it (one reference pass, as `run` says) when absent."""
    key = reference_key(reference.model_hash, ids, topk=topk, dtype=dtype)
    forward, batch_size, device = run.forward, run.batch_size, run.device

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        model = run.load_model(reference.path)
        t_load = time.perf_counter() - t0
        parts: dict[str, list[torch.Tensor]] = {}
        t1 = time.perf_counter()
        n = ids.shape[0]
        with log.Progress("reference", n, unit="sequences") as bar:
            for s in range(0, n, batch_size):
                logits, nxt = forward(model, ids[s : s + batch_size])
                for k, v in kl_stats.reference_topk(logits, nxt, topk).items():
                    parts.setdefault(k, []).append(v)
                del logits
                bar.update(min(s + batch_size, n))
        t_pass = time.perf_counter() - t1
        del model
        tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
        save_file(tensors, str(tmp / FILE))
        return {
            "file": FILE,
            "tokens": int(tensors["next_logp"].shape[0]),
            "topk": int(tensors["topk_ids"].shape[1]),
            "model_hash": reference.model_hash,
            "heldout_hash": tensor_hash(ids),
            "sequences": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]),
            "dtype": dtype,
            "device": device,
            "load_s": round(t_load, 3),
            "forward_s": round(t_pass, 3),
            "bytes": (tmp / FILE).stat().st_size,
        }

    entry = StageCache(Path(cache_dir)).get_or_build(STAGE, key, build)
    return ReferenceEntry(entry.path, key, entry.hit, entry.record)
