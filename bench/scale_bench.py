"""Scale benchmark: one recipe on one model, the weights on the GPU vs offloaded, and
`--gpus N` through torchrun; peak GPU / host memory, time, and the KL of each checkpoint.

    python bench/scale_bench.py quantize --model DIR --recipe R.yaml --work W --variant none
    python bench/scale_bench.py quantize ... --variant cpu        # --offload cpu
    python bench/scale_bench.py quantize ... --variant gpus2      # qship run's launcher, 2 ranks
    python bench/scale_bench.py kl --model DIR --recipe R.yaml --work W --out results.json

Each `quantize` is its own process (clean peaks) and writes W/<variant>.json; `kl` runs
qship's evaluate (cached mode: the reference's log-probs computed once) on every checkpoint
in W and writes one table with the predicted estimate beside the measured figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def quantize(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.fetch import read_config
    from pipeline.quantize import plan_for_config, quantize
    from pipeline.quantize.distributed import launch
    from pipeline.quantize.estimate import estimate
    from pipeline.recipe import load_recipe

    r = load_recipe(Path(a.recipe))
    work = Path(a.work)
    cache = work / "cache"
    tokens = build_token_sets(AutoTokenizer.from_pretrained(a.model), r.calibration,
                              r.evaluation, cache_dir=cache)  # fmt: skip
    offload = "none" if a.variant.startswith("gpus") else a.variant
    config = read_config(a.model, cache_dir=cache)
    plan = plan_for_config(config, r)
    est = estimate(plan, config, r, a.device, offload=offload)
    out = work / f"q-{a.variant}"
    t0 = time.perf_counter()
    if a.variant.startswith("gpus"):
        qc = launch(Path(a.model), r, out, cache_dir=cache, gpus=int(a.variant[4:]),
                    device=a.device, layers=len(plan.decoder_layers))  # fmt: skip
    else:
        qc = quantize(Path(a.model), r, out, tokens=tokens, device=a.device, offload=offload)
    wall = time.perf_counter() - t0
    assert qc is not None
    pm = qc.peak_memory
    row = {
        "variant": a.variant, "offload": qc.offload, "processes": qc.processes,
        "wall_s": round(wall, 1), "timings": qc.timings.to_json(),
        "cuda_max_allocated_gb": (pm.cuda_max_allocated_bytes or 0) / 1e9,
        "cuda_phases_gb": {k: v.max_allocated_bytes / 1e9 for k, v in (pm.cuda_phases or {}).items()},
        "rank_cuda_max_allocated_gb": [(p.cuda_max_allocated_bytes or 0) / 1e9 for p in qc.rank_peak_memory],
        "peak_rss_gb": pm.peak_rss_bytes / 1e9,
        "host_phases": {k: v.to_json() for k, v in pm.host_phases.items()},
        "self_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "predicted": est.to_json(),
        "bits_per_weight": qc.checkpoint.bits_per_weight_quantized,
        "checkpoint": str(out),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
    }  # fmt: skip
    (work / f"{a.variant}.json").write_text(json.dumps(row, indent=2))
    print(json.dumps({k: row[k] for k in ("variant", "wall_s", "cuda_max_allocated_gb",
                                          "peak_rss_gb", "rank_cuda_max_allocated_gb")}))  # fmt: skip


def kl(a: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.evaluate import evaluate
    from pipeline.recipe import load_recipe
    from pipeline.records.evaluation import EvalOptions, ModelRef

    r = load_recipe(Path(a.recipe))
    work = Path(a.work)
    tokens = build_token_sets(AutoTokenizer.from_pretrained(a.model), r.calibration,
                              r.evaluation, cache_dir=work / "cache")  # fmt: skip
    rows = []
    for f in sorted(work.glob("*.json")):
        row = json.loads(f.read_text())
        t0 = time.perf_counter()
        rep = evaluate(ModelRef(path=Path(a.model), model_hash="reference"),
                       ModelRef(path=Path(row["checkpoint"]), model_hash=row["variant"]),
                       heldout_ids=tokens.heldout_ids, cache_dir=work / "cache",
                       options=EvalOptions(batch_size=r.evaluation.batch_size, device=a.device))  # fmt: skip
        m = rep.metrics
        row.update(kl_mean=m.kl.mean, kl_se=m.kl.stderr, top1=m.top1_agreement, kl_mode=m.kl_mode,
                   eval_s=round(time.perf_counter() - t0, 1))  # fmt: skip
        rows.append(row)
        print(f"{row['variant']:8s} wall {row['wall_s']:7.1f} s  GPU {row['cuda_max_allocated_gb']:6.2f} GB  "
              f"RSS {row['peak_rss_gb']:6.1f} GB  KL {m.kl.mean:.5f} ± {m.kl.stderr:.5f}  top1 {m.top1_agreement:.4f}")  # fmt: skip
        # after every row: a machine lost during the next one keeps this one's KL
        Path(a.out).write_text(
            json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2)
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["quantize", "kl"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--variant", default="none", help="none | cpu | disk | gpusN")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="scale_bench.json")
    a = ap.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    {"quantize": quantize, "kl": kl}[a.what](a)


if __name__ == "__main__":
    main()
