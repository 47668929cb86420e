"""Quantize benchmark: every recipe on one model dir, through qship's Python API.

Records per run: wall time (total and oneshot), time per layer, peak RSS, peak CUDA
memory (on GPU), bits per weight, checkpoint size, and -- unless --no-kl -- the mean
KL(ref‖quant) over the recipe's held-out tokens (computed here with torch, so that runs
can be compared "at equal quality").

`--bare` adds a run of the mixed recipe with llm-compressor's defaults (same modifiers,
but the independent pipeline -- one calibration pass per modifier -- and batch size 1,
as a bare `oneshot(...)` call would use): the issue's target is that qship's defaults take
at most half the bare default time at equal quality. Each run is a fresh subprocess so
that peak memory is per run.

    python bench/studies/quantize_bench.py --model DIR [--recipes gemma-mixed-w4 rtn-w4 ...]
        [--bare] [--out results.json] [--device cuda] [--num-samples N --seq-len L]

Runs without qship being installed (the repo root is put on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ALL = ["gemma-mixed-w4", "awq-w4", "gptq-w4", "rtn-w4", "mixed-w4-nokv", "w8-int8"]
MIXED = "gemma-mixed-w4"


def _recipe_path(name: str) -> Path:
    p = Path(name)
    return p if p.suffix in (".yaml", ".yml") and p.exists() else ROOT / "recipes" / f"{name}.yaml"


def _mean_kl(ref_dir: Path, q_dir: Path, ids, device: str, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    def logps(d):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
        outs = []
        with torch.no_grad():
            for i in range(0, ids.shape[0], batch):
                lg = m(input_ids=ids[i : i + batch].to(device)).logits.float()
                outs.append(torch.log_softmax(lg, -1).cpu())
        del m
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return outs

    ref = logps(ref_dir)
    qs = logps(q_dir)
    kls = [(p.exp() * (p - q)).sum(-1).flatten() for p, q in zip(ref, qs, strict=True)]
    kl = torch.cat(kls)
    top1 = torch.cat(
        [(p.argmax(-1) == q.argmax(-1)).flatten() for p, q in zip(ref, qs, strict=True)]
    )
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(kl.quantile(0.99)),
        "top1": float(top1.float().mean()),
        "tokens": int(kl.numel()),
    }


def run_one(args) -> dict:
    """Child process: one quantize run; prints one JSON line."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.quantize import quantize
    from pipeline.recipe import load_recipe

    r = load_recipe(_recipe_path(args.one))
    if args.num_samples:
        r.calibration.num_samples = args.num_samples
    if args.seq_len:
        r.calibration.seq_len = args.seq_len
    if args.batch_size:
        r.calibration.batch_size = args.batch_size
    if args.eval_sequences:
        r.evaluation.sequences = args.eval_sequences
    if args.eval_seq_len:
        r.evaluation.seq_len = args.eval_seq_len
    if args.awq_offload and args.mode != "bare":
        for g in r.groups:
            if g.method == "awq":
                g.options.offload_cache = args.awq_offload == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    ts = build_token_sets(tok, r.calibration, r.evaluation, cache_dir=Path(args.work) / "cache")
    out = Path(args.work) / f"{r.name}--{args.mode}"
    if out.exists():
        shutil.rmtree(out)
    breakdown = None
    record = args.memory_breakdown and torch.cuda.is_available()
    if record:
        sys.path.insert(0, str(ROOT / "bench"))
        import cuda_peak
    t0 = time.perf_counter()
    with cuda_peak.recording() if record else contextlib.nullcontext():
        res = quantize(model, r, out, tokens=ts, device=args.device, bare=args.mode == "bare")
    wall = time.perf_counter() - t0
    if record:
        breakdown = cuda_peak.breakdown()
        print(cuda_peak.breakdown_text(breakdown), file=sys.stderr)
    rep = res
    row = {
        "recipe": r.name,
        "mode": args.mode,
        "device": rep.device,
        "calibration": f"{r.calibration.num_samples}x{r.calibration.seq_len}",
        "batch_size": 1 if args.mode == "bare" else r.calibration.batch_size,
        "awq_offload_cache": [g.options.offload_cache for g in r.groups if g.method == "awq"],
        "wall_s": wall,
        "oneshot_s": rep.timings.oneshot,
        "save_s": rep.timings.save,
        "layers_s": [x.seconds for x in rep.layers],
        "peak_rss_bytes": rep.peak_memory.peak_rss_bytes,
        "cuda_max_allocated_bytes": rep.peak_memory.cuda_max_allocated_bytes,
        # per phase (oneshot = what the bare call is compared on; save; verify = reload
        # check) and the running peak after each layer of the sequential pass
        "cuda_phase_peak_bytes": {
            k: v.max_allocated_bytes for k, v in rep.peak_memory.cuda_phases.items()
        },
        "cuda_layer_peak_bytes": [x.cuda_max_allocated_bytes for x in rep.layers],
        "bits_per_weight": rep.checkpoint.bits_per_weight_quantized,
        "checkpoint_bytes": rep.checkpoint.bytes,
        "cuda_peak_breakdown": breakdown,
        "awq_mean_loss_reduction": (
            sum(a.loss_reduction for a in rep.awq) / len(rep.awq) if rep.awq else None
        ),
    }
    if not args.no_kl:
        dev = rep.device
        row.update(_mean_kl(model, out, ts.heldout_ids, dev, args.kl_batch))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="local checkpoint dir")
    ap.add_argument("--recipes", nargs="*", default=ALL, help="recipe names or YAML paths")
    ap.add_argument(
        "--bare", action="store_true", help="also run the mixed recipe with llm-compressor defaults"
    )
    ap.add_argument(
        "--bare-only", action="store_true", help="only the qship-vs-bare pair for the mixed recipe"
    )
    ap.add_argument(
        "--skip-qship", action="store_true", help="with --bare(-only): the bare run alone"
    )
    ap.add_argument("--out", default="quantize_bench.json")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: GPU if present)")
    ap.add_argument("--num-samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument(
        "--batch-size", type=int, default=None, help="qship runs' calibration batch size"
    )
    ap.add_argument(
        "--awq-offload", choices=["on", "off"], default=None,
        help="qship runs: AWQ's calibration cache in CPU memory or not (default: the recipe's)",
    )  # fmt: skip
    ap.add_argument("--eval-sequences", type=int, default=None)
    ap.add_argument("--eval-seq-len", type=int, default=None)
    ap.add_argument("--kl-batch", type=int, default=4)
    ap.add_argument("--no-kl", action="store_true", help="skip the KL measurement")
    ap.add_argument(
        "--memory-breakdown", action="store_true",
        help="CUDA: record the allocator history and list what is live at the peak (slower)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--keep", action="store_true", help="keep the quantized checkpoints")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="qship", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        row = run_one(args)
        sys.stdout.write("BENCH_ROW " + json.dumps(row) + "\n")
        return 0

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="qship-qbench-"))
    # the mixed recipe as given on the command line (a path keeps its calibration source)
    mixed = next((r for r in args.recipes if Path(r).stem == MIXED), MIXED)
    runs = (
        [(mixed, "qship"), (mixed, "bare")]
        if args.bare_only
        else [(r, "qship") for r in args.recipes]
    )
    if args.bare and not args.bare_only:
        runs.append((mixed, "bare"))
    if args.skip_qship:  # e.g. the bare run alone, in its own process and time limit
        runs = [run for run in runs if run[1] != "qship"]
    passthrough = []
    for flag in (
        "device",
        "num_samples",
        "seq_len",
        "batch_size",
        "awq_offload",
        "eval_sequences",
        "eval_seq_len",
        "kl_batch",
        "threads",
    ):
        v = getattr(args, flag)
        if v is not None:
            passthrough += [f"--{flag.replace('_', '-')}", str(v)]
    for flag in ("no_kl", "keep", "memory_breakdown"):
        if getattr(args, flag):
            passthrough.append(f"--{flag.replace('_', '-')}")
    rows = []
    for recipe, mode in runs:
        print(f"== {recipe} ({mode})", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--one",
            recipe,
            "--mode",
            mode,
            "--work",
            str(work),
            *passthrough,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_ROW ")), None)
        if proc.returncode or line is None:
            rows.append(
                {
                    "recipe": recipe,
                    "mode": mode,
                    "error": f"exit {proc.returncode}",
                    "process_s": time.perf_counter() - t0,
                }
            )
            print(f"   failed (exit {proc.returncode})", file=sys.stderr)
            continue
        row = json.loads(line[len("BENCH_ROW ") :])
        row["process_s"] = time.perf_counter() - t0
        rows.append(row)
        kl = f", mean KL {row['kl_mean']:.4f}" if "kl_mean" in row else ""
        if row.get("cuda_phase_peak_bytes"):
            kl += ", peak CUDA " + ", ".join(
                f"{k} {v / 1e9:.3f} GB" for k, v in row["cuda_phase_peak_bytes"].items()
            )
        print(
            f"   oneshot {row['oneshot_s']:.1f} s, total {row['wall_s']:.1f} s, peak RSS "
            f"{row['peak_rss_bytes'] / 2**30:.2f} GiB, {row['bits_per_weight']:.3f} bits/weight{kl}",
            file=sys.stderr,
        )
    summary = {}
    q = next(
        (
            r
            for r in rows
            if r.get("recipe") == MIXED and r.get("mode") == "qship" and "error" not in r
        ),
        None,
    )
    b = next(
        (
            r
            for r in rows
            if r.get("recipe") == MIXED and r.get("mode") == "bare" and "error" not in r
        ),
        None,
    )
    if q and b:
        summary = {
            "mixed_oneshot_ratio_qship_over_bare": q["oneshot_s"] / b["oneshot_s"],
            "mixed_wall_ratio_qship_over_bare": q["wall_s"] / b["wall_s"],
            "target": "<= 0.5 at equal quality",
        }
        qp, bp = q.get("cuda_phase_peak_bytes") or {}, b.get("cuda_phase_peak_bytes") or {}
        if "oneshot" in qp and "oneshot" in bp:
            summary["oneshot_peak_ratio_qship_over_bare"] = qp["oneshot"] / bp["oneshot"]
            summary["peak_ratio_qship_over_bare"] = (
                q["cuda_max_allocated_bytes"] / b["cuda_max_allocated_bytes"]
            )
            print(
                "qship / bare peak CUDA allocated: oneshot "
                f"{summary['oneshot_peak_ratio_qship_over_bare']:.4f}, whole quantize "
                f"{summary['peak_ratio_qship_over_bare']:.4f}",
                file=sys.stderr,
            )
        if "kl_mean" in q and "kl_mean" in b:
            summary["kl_mean_qship"] = q["kl_mean"]
            summary["kl_mean_bare"] = b["kl_mean"]
        print(
            f"qship / bare oneshot time (mixed): {summary['mixed_oneshot_ratio_qship_over_bare']:.2f}",
            file=sys.stderr,
        )
    result = {
        "model": str(args.model),
        "host": platform.node(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": rows,
        "summary": summary,
    }
    try:
        import torch

        result["torch"] = torch.__version__
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
