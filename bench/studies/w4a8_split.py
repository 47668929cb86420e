"""Where W4A8's KL above its W4A16 twin comes from: one W4A8 checkpoint computed four ways
(its int4 weights exact or as vLLM's CUTLASS W4A8 kernel reads them, `numerics.w4a8_weight`;
its inputs 16-bit or FP8-rounded per token) beside the twin (the same GPTQ recipe without
activation quantization), exact full-vocabulary KL on the same rows.

    python bench/studies/w4a8_split.py REFERENCE W4A8_CKPT --twin W4A16_CKPT --sequences 8 --out F.json

The twin against "exact weights, 16-bit inputs" is what calibrating with the activation
scheme changed in GPTQ's weights; the other two steps are the served weights' and the FP8
activations' shares. Text and KL: bench/studies/share_common.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from unittest import mock

from share_common import arguments, mean_kl, reference_and_candidate

from pipeline.evaluate import numerics
from pipeline.model.loading import load_model


def main() -> None:
    a = arguments(__doc__, lambda ap: ap.add_argument("--twin", type=Path, required=True))
    t0 = time.perf_counter()
    ids, ref_logits, nxt, served = reference_and_candidate(a)
    out: dict = {"sequences": a.sequences, "seq_len": a.seq_len}

    def row(key: str, model) -> None:
        out[key] = mean_kl(ref_logits, model, ids, nxt)
        print(f"{key}: {out[key]:.5f}", flush=True)

    def both_inputs(model, weights: str) -> None:  # inputs 16-bit, then FP8-rounded
        for on in (False, True):
            for m in model.modules():
                if getattr(m, "_qship_served", False):
                    m.qship_round_activations = on
            row(f"{weights}_weights_{'fp8' if on else '16bit'}_inputs", model)

    twin = load_model(a.twin, device="cpu")
    row("twin_w4a16", twin)
    del twin
    exact = load_model(a.candidate, device="cpu")
    with mock.patch.object(numerics, "_w4a8", lambda module: None):  # int4 weights as stored
        numerics.serve_linears(exact)
    both_inputs(exact, "exact")
    del exact
    numerics.serve_linears(served)
    both_inputs(served, "served")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
