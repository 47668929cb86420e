"""How far two correct computations of the same served checkpoint differ: the candidate as
vLLM's kernels compute it (`numerics.serve_linears`), once in float32 and once in bfloat16
(as a GPU computes it), each against the float32 reference and against each other (KL and
top-1 agreement, as the served check compares vLLM with qship's measured figures). Where
activations are rounded per token, a small difference in a Linear's input moves values
across rounding boundaries, so the two disagree by more than for a weight-only checkpoint
-- the floor under the served check's served-vs-measured figures.

    python bench/studies/served_noise.py REFERENCE CANDIDATE --sequences 4 --out F.json

Text and reference: bench/studies/share_common.py.
"""

from __future__ import annotations

import json

import torch
from share_common import arguments, reference_and_candidate

from pipeline.evaluate import kl_stats
from pipeline.evaluate.numerics import serve_linears
from pipeline.evaluate.scoring import forward_logits
from pipeline.model.loading import load_model


def _vs(p_logits: torch.Tensor, q_logits: torch.Tensor, nxt: torch.Tensor) -> dict:
    kl = kl_stats.exact_token_stats_fast(p_logits, q_logits, nxt)["kl"]
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean()
    return {"kl_mean": float(kl.mean()), "top1": float(top1)}


def main() -> None:
    a = arguments(__doc__)
    ids, ref_logits, nxt, cand = reference_and_candidate(a)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        if dtype != "float32":
            del cand
            cand = load_model(a.candidate, device="cpu", dtype=dtype)  # the same load, 16-bit
        out_n = serve_linears(cand)
        logits[dtype] = forward_logits(cand, ids)[0].float()
    out = {"sequences": a.sequences, "seq_len": a.seq_len, "served_linears": out_n,
           "float32_vs_reference": _vs(ref_logits, logits["float32"], nxt),
           "bfloat16_vs_reference": _vs(ref_logits, logits["bfloat16"], nxt),
           "bfloat16_vs_float32": _vs(logits["float32"], logits["bfloat16"], nxt)}  # fmt: skip
    print(json.dumps(out, indent=1), flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
