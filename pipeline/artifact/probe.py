"""The load probe: a fingerprint of one forward pass, stored in eval.json at package time and
compared by `qship verify --load` after loading the artifact the way a deployment would.

Format "qship-probe-v1": the model runs once on `prompt_ids` (float32, CPU, no KV cache);
for every position the ids and logits of its top-k tokens are kept (logits rounded to
1e-4). A reload matches when, at every position, the logits of the stored ids are within
`atol` and the top-1 token is the same, unless the stored top-1/top-2 gap was itself below
`atol` (a near tie may flip across machines).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..model.loading import load_model
from ..records.evaluation import Probe

PROBE_TEXT = "The capital of France is"


def probe_ids(model_dir: Path, vocab: int | None) -> list[int]:
    """The probe text's ids under the checkpoint's tokenizer, or fixed ids without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = list(tok(PROBE_TEXT)["input_ids"])
        if ids and (vocab is None or max(ids) < vocab):
            return ids
    except Exception:  # noqa: BLE001 - no usable tokenizer: fall back to fixed ids
        pass
    top = vocab or 32
    return [i % top for i in (1, 5, 17, 42, 99, 123, 7)]


def probe_logits(model_dir: Path, prompt_ids: list[int]) -> Any:
    """Logits [positions, vocab] (float32, CPU) of one forward pass over prompt_ids."""
    import torch

    model = load_model(model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        return model(torch.tensor([list(prompt_ids)]), use_cache=False).logits[0].float()


def fingerprint(model_dir: Path, prompt_ids: list[int], *, top_k: int = 5) -> Probe:
    import torch

    logits = probe_logits(model_dir, prompt_ids)
    vals, ids = torch.topk(logits, k=min(top_k, logits.shape[-1]), dim=-1)
    return Probe(
        prompt_ids=[int(i) for i in prompt_ids],
        top_k=int(ids.shape[-1]),
        top_ids=ids.tolist(),
        top_logits=[[round(float(v), 4) for v in row] for row in vals.tolist()],
    )


def compare_fingerprint(stored: Probe, actual_logits: Any, *, atol: float = 0.05) -> list[str]:
    """Problems between a stored fingerprint and fresh logits [positions, vocab]."""
    problems = []
    for p, (ids, vals) in enumerate(zip(stored.top_ids, stored.top_logits, strict=True)):
        row = actual_logits[p]
        got = [float(row[i]) for i in ids]
        diff = max(abs(a - b) for a, b in zip(got, vals, strict=True))
        if diff > atol:
            problems.append(f"position {p}: logits differ by {diff:.4f} > {atol}")
        top1 = int(row.argmax())
        gap = vals[0] - vals[1] if len(vals) > 1 else math.inf
        if top1 != ids[0] and gap >= atol:
            problems.append(f"position {p}: top-1 token {top1} != stored {ids[0]}")
    return problems
