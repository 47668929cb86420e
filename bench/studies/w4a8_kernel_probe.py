"""Is qship's W4A8 simulation what vLLM's CUTLASS W4A8 kernel computes? One Linear at a time,
on the same inputs: vLLM served W4A8 8.8 % (Gemma) / 13.7 % (Qwen) worse than qship measured
it, and the FP8 product table explains only 38-44 % of that (bench/studies/w4a8_table_ab.py).

    # in vLLM's environment, on the GPU: each probed Linear's input and vLLM's output
    $QSHIP_VLLM_PYTHON bench/studies/w4a8_kernel_probe.py serve ART DUMP.safetensors [--layers 0 11]
    # in qship's: the same inputs through qship's simulation and its variants
    python bench/studies/w4a8_kernel_probe.py compare ART DUMP.safetensors --json OUT.json

`serve` loads ART in vLLM (eager), draws heavy-tailed bf16 inputs (a few outlier channels, as
real activations have) and calls each probed Linear's quant method, which is the kernel vLLM
serves with (`CutlassW4A8LinearKernel.apply_weights`: per-token FP8 input, int4 x FP8 table,
channel and token scales). `compare` loads ART as evaluate does and reports, per Linear, the
relative error of vLLM's output against: qship's simulation (`numerics.serve_linears`: per-
token FP8 input, FP8-rounded products q * s8), the same without the product rounding, and the
W4A16 weights with bf16 inputs -- with the bf16 output rounding as the floor to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROBED = ("self_attn.o_proj", "mlp.down_proj")  # not fused in vLLM: one module, one name


def _names(names: list[str], layers: list[int]) -> list[str]:
    return [n for n in names if any(n.endswith(f"layers.{i}.{p}") for i in layers for p in PROBED)]


def serve(art: Path, dump: Path, layers: list[int]) -> None:
    from safetensors.torch import save_file

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model in-process
    from vllm import LLM

    llm = LLM(model=str(art), enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3)

    def grab(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        mods = dict(model.named_modules())
        g = torch.Generator(device="cuda").manual_seed(0)
        out = {}
        for name in _names(list(mods), layers):
            m = mods[name]
            k = int(m.input_size_per_partition)
            x = torch.randn(64, k, generator=g, device="cuda")
            x[:, :4] *= 30.0  # outlier channels: the per-token FP8 scale is set by them
            x = x.to(torch.bfloat16)
            out[f"{name}.x"] = x.cpu()
            out[f"{name}.y"] = m.quant_method.apply(m, x).float().cpu()
            kernel = type(getattr(getattr(m, "scheme", None), "kernel", None)).__name__
            out[f"{name}.kernel"] = torch.tensor(list(kernel.encode()), dtype=torch.uint8)
        return out

    got = llm.apply_model(grab)[0]
    save_file(got, str(dump))
    print(f"{dump}: {len(got) // 3} Linears")


def compare(art: Path, dump: Path, out_json: Path | None) -> dict:
    from safetensors.torch import load_file

    from pipeline.evaluate.numerics import fp8_token_quant, serve_linears
    from pipeline.model.loading import load_model
    from pipeline.model.w4a8 import int4_levels, w4a8_scales

    d = load_file(str(dump))
    names = sorted({k.rsplit(".", 1)[0] for k in d if k.endswith(".x")})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(art, device=dev, dtype="float32")
    mods = dict(model.named_modules())
    orig = {n: (mods[n].weight.detach().clone(), mods[n].weight_scale.float()) for n in names}
    serve_linears(model)  # W4A8: table-rounded weights, inputs rounded per token to FP8
    rows = {}
    with torch.inference_mode():
        for n in names:
            x, y = d[f"{n}.x"].to(dev), d[f"{n}.y"].to(dev).double()
            w0, s = orig[n]
            q = int4_levels(w0, s)
            s8, chan = w4a8_scales(s)
            xq = fp8_token_quant(x.float()).double()
            w_exact = (q * s8.unsqueeze(-1) * chan.unsqueeze(-1)).reshape(w0.shape).double()
            variants = {
                "qship_simulation": mods[n](x.float()).double(),
                "no_product_rounding": xq @ w_exact.T,
                "w4a16_bf16_inputs": x.double() @ w0.double().T,
            }
            best = variants["qship_simulation"]
            err = {k: float((y - v).norm() / y.norm()) for k, v in variants.items()}
            floor = best.to(torch.bfloat16).double() - best
            err["bf16_output_floor"] = float(floor.norm() / best.norm())
            rows[n] = {"kernel": bytes(d[f"{n}.kernel"].tolist()).decode(), "relative_error": err}
            print(n, rows[n]["kernel"], " ".join(f"{k} {v:.2e}" for k, v in err.items()))
    if out_json:
        out_json.write_text(json.dumps({"artifact": str(art), "rows": rows}, indent=1) + "\n")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("art", type=Path)
    s.add_argument("dump", type=Path)
    s.add_argument("--layers", type=int, nargs="+", default=[0, 11])
    c = sub.add_parser("compare")
    c.add_argument("art", type=Path)
    c.add_argument("dump", type=Path)
    c.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cmd == "serve":
        serve(a.art, a.dump, a.layers)
    else:
        compare(a.art, a.dump, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
