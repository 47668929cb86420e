"""Resume benchmark: quantize uninterrupted, then killed (SIGKILL) after a decoder layer and
rerun; the rerun's time against the whole run's, and whether the checkpoints are identical.

    python bench/resume_bench.py --model DIR --recipe R.yaml --kill-after model.layers.8 \\
        --work W --out resume.json [--device cpu]

Each run is its own process (`RUN` below, one CPU thread per run: deterministic); the kill
comes from a sitecustomize hook on qship's per-layer progress callback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import sys, torch
from pathlib import Path
from transformers import AutoTokenizer
from pipeline.data.tokens import build_token_sets
from pipeline.quantize import quantize
from pipeline.recipe import load_recipe
model, recipe, out, cache, layers, device = sys.argv[1:7]
if device == "cpu":
    torch.set_num_threads(int(sys.argv[7]))
r = load_recipe(Path(recipe))
tokens = build_token_sets(AutoTokenizer.from_pretrained(model), r.calibration, r.evaluation,
                          cache_dir=Path(cache))
quantize(Path(model), r, Path(out), tokens=tokens, device=device, resume_dir=Path(layers))
"""

HOOK = """
import os
if os.environ.get("KILL_AFTER"):
    import pipeline.quantize.ranks as ranks
    def layer_done(layer, count):
        if layer == os.environ["KILL_AFTER"]:
            os.kill(os.getpid(), 9)
    ranks.layer_done = layer_done
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--kill-after", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default="resume_bench.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "hook").mkdir(parents=True)
    (work / "hook" / "sitecustomize.py").write_text(HOOK)

    def run(name: str, kill: str = "") -> tuple[int, float]:
        env = {**os.environ, "PYTHONPATH": f"{work / 'hook'}{os.pathsep}{ROOT}", "KILL_AFTER": kill}
        args = [
            a.model,
            a.recipe,
            str(work / name),
            str(work / "cache"),
            str(work / f"layers-{name}"),
            a.device,
            str(a.threads),
        ]
        t = time.perf_counter()
        rc = subprocess.run(
            [sys.executable, "-c", RUN, *args], env=env, stderr=subprocess.DEVNULL
        ).returncode
        return rc, round(time.perf_counter() - t, 1)

    from pipeline.records.checkpoint import QuantizedCheckpoint

    rc_w, t_whole = run("whole")
    rc_k, t_killed = run("resumed", kill=a.kill_after)
    assert rc_w == 0 and rc_k == -signal.SIGKILL, (rc_w, rc_k)
    rc_r, t_rerun = run("resumed")
    whole, resumed = (
        QuantizedCheckpoint.read(work / "whole"),
        QuantizedCheckpoint.read(work / "resumed"),
    )
    assert rc_r == 0 and whole and resumed
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "recipe": a.recipe,
        "device": a.device, "threads": a.threads, "kill_after": a.kill_after,
        "layers": len(whole.plan.decoder_layers), "resumed_layers": resumed.resumed_layers,
        "whole_s": t_whole, "killed_s": t_killed, "rerun_s": t_rerun,
        "identical": resumed.model_hash == whole.model_hash,
    }  # fmt: skip
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
