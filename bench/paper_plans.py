"""`qship plan` on paper for models no lent machine holds (issue 32, item 4): Llama-3-70B and
Qwen3-235B-A22B dimensions (bench/configs, config.json only) with the default mixed recipe
on 1, 2, 4 and 8 H200s, each with the host memory and disk of the lent machine of that size.

    python bench/paper_plans.py OUT_DIR     # OUT_DIR/<model>-<n>gpu.json + table.md

The figures are the estimate's (quantize/estimate.py), from the per-layer costs measured on
Gemma 3 270M, an 8B-dims Llama and 2 layers of Qwen3-30B-A3B dims; several GPUs assume an
even split of the calibration tokens (not yet measured).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"llama3-70b": "Llama-3-70B", "qwen3-235b-a22b": "Qwen3-235B-A22B"}
# the lent kinds: GPUs -> (host memory, disk), from the device tool's table
PER_MODULE = ("modules", "mappings", "smoothquant", "decoder_layers")
MACHINES = {1: ("128GiB", 64), 2: ("256GiB", 128), 4: ("512GiB", 235), 8: ("560GiB", 235)}


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| model | H200s | offload (auto) | GPU per GPU | host | disk needed / machine's | "
            "quantize | fits |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, name in MODELS.items():
        for n, (host, disk_gib) in MACHINES.items():
            cmd = [sys.executable, "-m", "pipeline.cli", "plan", "--model", str(ROOT / "bench/configs" / key),
                   "--recipe", str(ROOT / "recipes/gemma-mixed-w4.yaml"), "--device", "cuda",
                   "--offload", "auto", "--gpu-memory", "139GiB", "--host-memory", host,
                   "--gpus", str(n), "--json"]  # fmt: skip
            p = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            plan = json.loads(p.stdout)
            # the plan without its per-module lists (235B dims: 36k modules, 20 MB a file)
            kept = {k: v for k, v in plan.items() if k not in PER_MODULE}
            kept.update(modules=len(plan["modules"]), decoder_layers=len(plan["decoder_layers"]))
            shown = " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                             for c in cmd[3:])  # fmt: skip
            (out / f"{key}-{n}gpu.json").write_text(
                json.dumps({"command": f"qship {shown}", **kept}, indent=1) + "\n"
            )
            e = plan["estimate"]
            gpu, cpu, dsk = (
                e["quantize_gpu_bytes"] / 1e9,
                e["quantize_cpu_bytes"] / 1e9,
                e["disk_bytes"] / 1e9,
            )
            fits = dsk <= disk_gib * 2**30 / 1e9 and gpu <= 139 * 2**30 / 1e9
            rows.append(f"| {name} | {n} | {e['offload']} | {gpu:.1f} GB | {cpu:.0f} GB of {host} | "
                        f"{dsk:.0f} GB / {disk_gib} GiB | {e['quantize_s'] / 60:.0f} min | "
                        f"{'yes' if fits else 'no: disk' if gpu <= 149 else 'no'} |")  # fmt: skip
            print(rows[-1], flush=True)
    (out / "table.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
