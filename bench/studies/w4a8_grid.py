"""How far vLLM's CUTLASS W4A8 grid is from int4's uniform one, in weight space: each group of
128 weights of chosen Linears rounded (round to nearest, no GPTQ) to

    uniform           q * s, s = absmax / 7.5 (minmax, what the twin W4A16 stores)
    uniform_mse       q * s, s searched over 0.70..1.05 x absmax / 7.5 for the least error
    served            the minmax q read as the kernel reads it, fp8(q * s8) * chan
                      (`evaluate.numerics.w4a8_weight`)
    served_nearest    the nearest of the group's 16 served levels, same scales
    served_mse        the MSE-searched scale, q read as served
    served_search     s8 searched over FP8 values for the least error on the served levels

and each method's summed squared error relative to `uniform`.

    python bench/studies/w4a8_grid.py MODEL_DIR --layers 0 5 11 17 --out F.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.model.w4a8 import int4_levels, w4a8_scales, w4a8_weight

FP8 = torch.float8_e4m3fn
GROUP = 128


def levels(s8: torch.Tensor, chan: torch.Tensor) -> torch.Tensor:
    """The 16 values per group [G, 16] the kernel can serve."""
    q = torch.arange(-8, 8).float()
    return (q[None] * s8[:, None]).to(FP8).float() * chan[:, None]


def nearest(x: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
    return lv.gather(1, (x[:, :, None] - lv[:, None, :]).abs().argmin(-1))


def served(w: torch.Tensor, s: torch.Tensor, rows: int) -> torch.Tensor:
    """Minmax-style q from group scales s, read as the kernel reads it [G, GROUP]."""
    s = s.reshape(rows, -1)
    return w4a8_weight(int4_levels(w, s), s).reshape(-1, GROUP)


def errors(w: torch.Tensor) -> dict[str, float]:
    rows = w.shape[0]
    g = w.float().reshape(-1, GROUP)
    s = g.abs().amax(1).clamp(min=1e-12) / 7.5

    def sq(x: torch.Tensor) -> torch.Tensor:
        return (x - g).pow(2).sum(1)

    out = {"uniform": sq(torch.round(g / s[:, None]).clamp(-8, 7) * s[:, None])}
    best, sm = torch.full_like(s, float("inf")), s.clone()
    for r in torch.linspace(0.70, 1.05, 36):
        e = sq(torch.round(g / (s * r)[:, None]).clamp(-8, 7) * (s * r)[:, None])
        sm, best = torch.where(e < best, s * r, sm), torch.minimum(best, e)
    out["uniform_mse"] = best
    out["served"] = sq(served(w, s, rows))
    s8, chan = w4a8_scales(s.reshape(rows, -1))
    s8, chan = s8.reshape(-1), chan.expand(rows, s8.shape[1]).reshape(-1)
    out["served_nearest"] = sq(nearest(g, levels(s8, chan)))
    out["served_mse"] = sq(served(w, sm, rows))
    ideal = s / chan  # the s8 that would make the served scale equal s
    fp8 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    fp8 = fp8[torch.isfinite(fp8) & (fp8 > 0)].unique()
    search = torch.full_like(s, float("inf"))
    for v in fp8[(fp8 >= 0.6 * ideal.min()) & (fp8 <= 1.1 * ideal.max())]:
        m = (v >= 0.6 * ideal) & (v <= 1.1 * ideal)
        if m.any():
            lv = levels(torch.full((int(m.sum()),), float(v)), chan[m])
            search[m] = torch.minimum(search[m], (nearest(g[m], lv) - g[m]).pow(2).sum(1))
    out["served_search"] = search
    return {k: float(v.sum()) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 5, 11, 17])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    total: dict[str, float] = {}
    per: dict[str, dict[str, float]] = {}
    for f in sorted(a.model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                if not (n.endswith("proj.weight") and any(f".layers.{i}." in n for i in a.layers)):
                    continue
                e = errors(h.get_tensor(n))
                per[n] = {k: v / e["uniform"] for k, v in e.items()}
                for k, v in e.items():
                    total[k] = total.get(k, 0.0) + v
                print(n, {k: round(v, 3) for k, v in per[n].items()}, flush=True)
    summary = {k: v / total["uniform"] for k, v in total.items()}
    print("relative to uniform (minmax):", {k: round(v, 3) for k, v in summary.items()})
    a.out.write_text(
        json.dumps({"layers": a.layers, "summary": summary, "modules": per}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
