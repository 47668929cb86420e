"""Where a W8A8 / W4A8 checkpoint's activation rounding costs KL: the candidate computed as
vLLM serves it (`evaluate.numerics.serve_linears`) with the input rounding left on only for
one kind of fused set (q/k/v, o, gate/up, down) or one decoder layer, against the
reference, minus the KL with it on nowhere (the quantized weights alone) -- the evidence for
keeping chosen sets' activations 16-bit (issue 29's per-set formats).

    python bench/studies/act_share.py REFERENCE CANDIDATE --sequences 4 [--by kind|layer] --out F.json

A W4A8 candidate's "weights only" figure keeps vLLM's FP8 group scales (set when loaded).

Text and KL: bench/studies/share_common.py.
"""

from __future__ import annotations

import json
import re
import time

from share_common import arguments, mean_kl, reference_and_candidate

from pipeline.evaluate.numerics import serve_linears
from pipeline.model.roles import decoder_layer_list

KINDS = {"qkv": r"\.(q|k|v)_proj$", "o": r"\.o_proj$", "gate_up": r"\.(gate|up)_proj$",
         "down": r"\.down_proj$"}  # fmt: skip


def main() -> None:
    a = arguments(
        __doc__,
        lambda ap: ap.add_argument("--by", choices=["kind", "layer", "both"], default="both"),
    )
    ids, ref_logits, nxt, cand = reference_and_candidate(a)
    serve_linears(cand)
    _, blocks = decoder_layer_list(cand)  # type: ignore[misc]
    layer_of = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    # each served Linear: (name, decoder layer, module); its activation rounding has a switch
    served = [(n, layer_of[id(m)], m) for n, m in cand.named_modules()
              if getattr(m, "_qship_served", False)]  # fmt: skip

    def kl(on) -> float:
        for n, i, m in served:
            m.qship_round_activations = on(n, i)
        return mean_kl(ref_logits, cand, ids, nxt)

    t0 = time.perf_counter()
    every, none = kl(lambda n, i: True), kl(lambda n, i: False)
    out = {"sequences": a.sequences, "seq_len": a.seq_len, "served_linears": len(served),
           "kl_all": every, "kl_weights_only": none, "added_by_kind": {},
           "added_by_layer": {}}  # fmt: skip
    print(f"activations rounded everywhere {every:.5f}, nowhere {none:.5f}", flush=True)
    for kind, rx in KINDS.items() if a.by != "layer" else ():
        out["added_by_kind"][kind] = kl(lambda n, i, rx=rx: re.search(rx, n) is not None) - none
        print(f"{kind}: +{out['added_by_kind'][kind]:.5f}", flush=True)
    for j in sorted({i for _, i, _ in served}) if a.by != "kind" else ():
        out["added_by_layer"][str(j)] = kl(lambda n, i, j=j: i == j) - none
        print(f"layer {j}: +{out['added_by_layer'][str(j)]:.5f}", flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
