"""How much of a W4A8 checkpoint's served KL comes from the FP8 product table of vLLM's
CUTLASS W4A8 kernel: the candidate as qship simulates it (`numerics.serve_linears`: FP8
group scales, each weight fp8(q * s8) * c, FP8 per-token activations), then the same with
the exact products q * s8 * c, both against the reference on the CPU.

    python bench/studies/w4a8_table_ab.py REFERENCE CANDIDATE --sequences 2 [--dtype bfloat16] --out F.json

Text and reference: bench/studies/share_common.py.
"""

from __future__ import annotations

import json
import time

from share_common import arguments, mean_kl, reference_and_candidate

from pipeline.evaluate.numerics import serve_linears
from pipeline.model.w4a8 import int4_levels, w4a8_scales


def main() -> None:
    a = arguments(__doc__, lambda ap: ap.add_argument("--dtype", default="float32"))
    ids, ref_logits, nxt, cand = reference_and_candidate(a, a.dtype)
    lin = [m for m in cand.modules() if getattr(m, "weight_scale", None) is not None
           and getattr(getattr(m, "quantization_scheme", None), "input_activations", None)]  # fmt: skip
    stored = {id(m): m.weight.detach().clone() for m in lin}  # q * s, as decompressed
    serve_linears(cand)

    t0 = time.perf_counter()
    table = mean_kl(ref_logits, cand, ids, nxt)
    for m in lin:
        w, s = stored[id(m)], m.weight_scale.data
        s8, chan = w4a8_scales(s)
        m.weight.data = (int4_levels(w, s) * (s8 * chan).unsqueeze(-1)).reshape(w.shape).to(w.dtype)
    exact = mean_kl(ref_logits, cand, ids, nxt)
    out = {"dtype": a.dtype, "sequences": a.sequences, "seq_len": a.seq_len, "linears": len(lin),
           "kl_fp8_table": table, "kl_exact_products": exact, "table_adds": table / exact - 1,
           "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    print(out, flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
