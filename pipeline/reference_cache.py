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

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import kl_stats
from .cache import StageCache, canonical_json, stage_key
from .hashing import hash_files, list_files
from .progress import Every

STAGE = "reference"
FILE = "reference.safetensors"
# Measured on Gemma 3 270M (262k vocabulary, bench/RESULTS.md): the cached mean KL is
# below the exact one by 9.8 % at k = 128, 6.4 % at 256, 2.3 % at 1024, 0.54 % at 4096.
DEFAULT_TOPK = 4096


def model_hash(model_dir: Path) -> str:
    """sha256 over the digests of the files that determine the logits (config + weights)."""
    model_dir = Path(model_dir)
    rels = [
        r
        for r in list_files(model_dir)
        if r == "config.json" or r.endswith(".safetensors") or r.endswith(".safetensors.index.json")
    ]
    digests = hash_files(model_dir, rels)
    payload = {r: d.sha256 for r, d in digests.items()}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def ids_digest(ids: torch.Tensor) -> str:
    """Content hash of the token tensor itself (guards against a stale heldout_hash)."""
    t = ids.detach().to(torch.int64).contiguous().cpu()
    return hashlib.sha256(str(tuple(t.shape)).encode() + t.numpy().tobytes()).hexdigest()


@dataclass
class ReferenceEntry:
    path: Path
    key: str
    hit: bool
    record: dict

    def load(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / self.record["file"]))

    def to_json(self) -> dict:
        return {"key": self.key, "hit": self.hit, "path": str(self.path), **self.record}


def reference_key(
    ref_hash: str, heldout_hash: str, ids: torch.Tensor, *, topk: int, dtype: str
) -> str:
    return stage_key(
        STAGE,
        {
            "model_hash": ref_hash,
            "heldout_hash": heldout_hash,
            "ids_sha256": ids_digest(ids),
            "sequences": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]),
            "mode": f"topk{topk}+tail",
            "dtype": dtype,
        },
    )


def get_or_build(
    cache_dir: Path,
    reference_dir: Path,
    ids: torch.Tensor,
    *,
    heldout_hash: str,
    ref_hash: str,
    topk: int,
    forward,  # callable(model, batch_ids) -> (logits [n, V], next_ids [n])
    load_model,  # callable(path) -> model
    batch_size: int,
    dtype: str,
    device: str,
) -> ReferenceEntry:
    """Cached reference entry; builds it (one reference pass) when absent."""
    key = reference_key(ref_hash, heldout_hash, ids, topk=topk, dtype=dtype)
    cache = StageCache(Path(cache_dir))

    def build(tmp: Path) -> dict:
        t0 = time.perf_counter()
        model = load_model(reference_dir)
        t_load = time.perf_counter() - t0
        parts: dict[str, list[torch.Tensor]] = {}
        t1 = time.perf_counter()
        n = ids.shape[0]
        bar = Every("qship evaluate: reference", n)
        for s in range(0, n, batch_size):
            logits, nxt = forward(model, ids[s : s + batch_size])
            for k, v in kl_stats.reference_topk(logits, nxt, topk).items():
                parts.setdefault(k, []).append(v)
            del logits
            bar.step(min(s + batch_size, n))
        t_pass = time.perf_counter() - t1
        del model
        tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
        save_file(tensors, str(tmp / FILE))
        return {
            "file": FILE,
            "tokens": int(tensors["next_logp"].shape[0]),
            "topk": int(tensors["topk_ids"].shape[1]),
            "model_hash": ref_hash,
            "heldout_hash": heldout_hash,
            "sequences": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]),
            "dtype": dtype,
            "device": device,
            "load_s": round(t_load, 3),
            "forward_s": round(t_pass, 3),
            "bytes": (tmp / FILE).stat().st_size,
        }

    entry = cache.get_or_build(STAGE, key, build)
    return ReferenceEntry(entry.path, key, entry.hit, entry.record)
