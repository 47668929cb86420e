"""Where a W8A8 / W4A8 checkpoint's activation rounding costs KL: the candidate computed as
vLLM serves it (`evaluate.numerics.serve_linears`) with the input rounding left on only for
one kind of fused set (q/k/v, o, gate/up, down) or one decoder layer, against the
reference, minus the KL with it on nowhere (the quantized weights alone) -- the evidence for
keeping chosen sets' activations 16-bit (issue 29's per-set formats).

    python bench/act_share.py REFERENCE CANDIDATE --sequences 4 [--by kind|layer] --out F.json

A W4A8 candidate's "weights only" figure keeps vLLM's FP8 group scales (set when loaded).

Text and KL: bench/share_common.py.
"""

from __future__ import annotations

import json
import re
import time

from share_common import arguments, reference_and_candidate

from pipeline.evaluate import kl_stats
from pipeline.evaluate.numerics import serve_linears
from pipeline.evaluate.scoring import forward_logits

KINDS = {"qkv": r"\.(q|k|v)_proj$", "o": r"\.o_proj$", "gate_up": r"\.(gate|up)_proj$",
         "down": r"\.down_proj$"}  # fmt: skip


def main() -> None:
    a = arguments(
        __doc__,
        lambda ap: ap.add_argument("--by", choices=["kind", "layer", "both"], default="both"),
    )
    ids, ref_logits, nxt, cand = reference_and_candidate(a)
    serve_linears(cand)
    # each served Linear's pre-hooks (the activation rounding), to switch on and off
    hooks = {n: dict(m._forward_pre_hooks) for n, m in cand.named_modules()
             if getattr(m, "_qship_served", False)}  # fmt: skip
    mods = dict(cand.named_modules())

    def kl(on) -> float:
        for n, h in hooks.items():
            mods[n]._forward_pre_hooks.clear()
            if on(n):
                mods[n]._forward_pre_hooks.update(h)
        logits, _ = forward_logits(cand, ids)
        return float(kl_stats.exact_token_stats_fast(ref_logits, logits, nxt)["kl"].mean())

    def layer(n: str) -> int:
        return int(re.search(r"\.layers\.(\d+)\.", n).group(1))  # type: ignore[union-attr]

    t0 = time.perf_counter()
    every, none = kl(lambda n: True), kl(lambda n: False)
    out = {"sequences": a.sequences, "seq_len": a.seq_len, "served_linears": len(hooks),
           "kl_all": every, "kl_weights_only": none, "added_by_kind": {},
           "added_by_layer": {}}  # fmt: skip
    print(f"activations rounded everywhere {every:.5f}, nowhere {none:.5f}", flush=True)
    for kind, rx in KINDS.items() if a.by != "layer" else ():
        out["added_by_kind"][kind] = kl(lambda n, rx=rx: re.search(rx, n) is not None) - none
        print(f"{kind}: +{out['added_by_kind'][kind]:.5f}", flush=True)
    for i in sorted({layer(n) for n in hooks}) if a.by != "kind" else ():
        out["added_by_layer"][str(i)] = kl(lambda n, i=i: layer(n) == i) - none
        print(f"layer {i}: +{out['added_by_layer'][str(i)]:.5f}", flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
