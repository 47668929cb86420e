"""Which layers' FP8 KV cache costs the most KL: the candidate with the KV (and vLLM's FP8
query) rounding on one decoder layer only, against the reference, minus the KL with it on
none -- the evidence for a recipe's kv_cache.skip_layers (issue 31).

    python bench/studies/kv_layer_share.py REFERENCE CANDIDATE --sequences 4 --out kv_layers.json

REFERENCE is the 16-bit model folder, CANDIDATE a quantized checkpoint with an FP8 KV cache.
Text and KL: bench/studies/share_common.py.
"""

from __future__ import annotations

import json
import time

from share_common import arguments, mean_kl, reference_and_candidate

from pipeline.evaluate.numerics import served_attention
from pipeline.evaluate.scoring import kv_modules


def main() -> None:
    a = arguments(__doc__)
    ids, ref_logits, nxt, cand = reference_and_candidate(a)
    mods = kv_modules(cand)

    def kl(on: set[int]) -> float:
        for i, m in enumerate(mods):
            m.quantization_enabled = i in on
        with served_attention(cand, "vllm", mods):
            return mean_kl(ref_logits, cand, ids, nxt)

    t0 = time.perf_counter()
    every, none = kl(set(range(len(mods)))), kl(set())
    out = {"sequences": a.sequences, "seq_len": a.seq_len, "layers": len(mods),
           "kl_all_layers": every, "kl_no_layer": none, "added_by_layer": {}}  # fmt: skip
    print(f"KV on every layer {every:.5f}, on none {none:.5f}", flush=True)
    for i in range(len(mods)):
        out["added_by_layer"][str(i)] = kl({i}) - none
        print(f"layer {i}: +{out['added_by_layer'][str(i)]:.5f}", flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
