"""`qship run --gpus N`: quantize under torchrun, one process per GPU.

llm-compressor's distributed oneshot does the work: each rank calibrates on its share of
the calibration samples (its sampler partitions a dataset that is the same on every rank),
GPTQ's Hessians and AWQ's losses are reduced across ranks, GPTQ compresses each module on
one rank and broadcasts it. qship only launches and collects:

    parent (qship run)                      torchrun --nproc-per-node N [rendezvous flags]
      launch() ── spec.json, recipe.yaml ──►  rank r: main() -> engine.quantize(...)
      ◄── quantize_report.json (rank 0)        rank 0 writes and checks the checkpoint
      ◄── rank<r>.layer / rank<r>.error       each rank: last finished layer, its error

Fetch, tokens, evaluate, gate and package run once, in the parent. Multi-node: every node
runs the same `qship run` with torchrun's rendezvous flags (`--torchrun-args "--nnodes 2
--node-rank K --master-addr HOST --master-port PORT"`); the node holding rank 0 (node 0
with this static rendezvous) writes the checkpoint and carries on, the others end after
quantize.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .. import errors, log
from ..errors import StageError, UsageError
from ..recipe import Recipe
from ..records.checkpoint import QuantizedCheckpoint
from . import ranks

SPEC = "spec.json"


def launch(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    *,
    cache_dir: Path,
    gpus: int,
    device: str,
    offload: str = "none",
    torchrun_args: Sequence[str] = (),
    layers: int = 0,
    resume_dir: Path | None = None,
) -> QuantizedCheckpoint | None:
    """Quantize under torchrun; the record when this node holds rank 0 (else None). A
    failed rank raises with its rank, its last finished layer and its error; no output is
    left (rank 0 builds it atomically)."""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: need at least 1", path="--gpus", hint="pass 1 or more")
    out_dir = Path(out_dir)
    work = out_dir.with_name(f".{out_dir.name}.ranks-{os.getpid()}")
    work.mkdir(parents=True)
    try:
        (work / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
        spec = {"model_dir": str(model_dir), "recipe": str(work / "recipe.yaml"),
                "out_dir": str(out_dir), "cache_dir": str(cache_dir),
                "device": device, "offload": offload,
                "resume_dir": str(resume_dir) if resume_dir else None}  # fmt: skip
        (work / SPEC).write_text(json.dumps(spec), encoding="utf-8")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
        if not any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in torchrun_args):
            cmd.append("--standalone")  # one host: a free port on localhost
        cmd += [*torchrun_args, "-m", __name__, str(work / SPEC)]
        log.detail("launching: " + shlex.join(cmd))
        rc, output = _run(cmd, work, layers)
        if rc != 0:
            raise _failure(rc, output, work, gpus)
        return QuantizedCheckpoint.read(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(cmd: list[str], work: Path, layers: int) -> tuple[int, str]:
    """Run torchrun with its output in a file (copied to the run log after), a progress bar
    driven by rank 0's finished layers."""
    out_file = work / "torchrun.log"
    env = {**os.environ, ranks.PROGRESS_ENV: str(work), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")) if p
    )
    with open(out_file, "w") as fh, log.Progress("calibrate (rank 0)", layers or None,
                                                  unit="layers") as bar:  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                done = ranks.progress(work, 0)
                if done is not None and done[0] != bar.done:
                    bar.update(*done)
        finally:  # interrupted here (Ctrl-C, a timeout): the ranks go too
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    output = out_file.read_text(errors="replace")
    sys.stderr.write(output)  # the run log (log.third_party_to)
    return proc.returncode, output


# a rank's error that only says another rank went away
_LOST_PEER = re.compile(
    r"closed by peer|Connection reset|Broken pipe|remote worker|NCCL.*(abort|remote)|timed? ?out",
    re.I,
)


def _failure(rc: int, output: str, work: Path, gpus: int) -> errors.QshipError:
    """The failure at the origin, re-raised with its own exit code, naming the rank and its
    last finished decoder layer: a rank killed by a signal (out of memory, a lost node),
    else the first error that is not merely a lost peer, else torchrun's own report."""
    died = [(int(r), int(c)) for r, c in
            re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", output, re.S)]  # fmt: skip
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in work.glob("rank*.error")}
    for r, code in died:  # torchrun stops the others with SIGTERM
        if code < 0 and -code != signal.SIGTERM and r not in reports:
            return StageError(
                f"rank {r} of {gpus} was killed by signal {-code}{_after(work, r)}; torchrun "
                "stopped the other ranks",
                hint="out of host memory kills a rank: use --offload disk or fewer --gpus per "
                "host; rerun after fixing (finished stages are cached)",
            )
    if reports:
        order = sorted(reports, key=lambda r: (bool(_LOST_PEER.search(reports[r]["message"])),
                                               (work / f"rank{r}.error").stat().st_mtime))  # fmt: skip
        r = order[0]
        err = reports[r]
        cls = getattr(errors, err["error"], StageError)
        if not (isinstance(cls, type) and issubclass(cls, errors.QshipError)):
            cls = StageError
        return cls(f"rank {r} of {gpus}{_after(work, r)}: {err['message']}",
                   path=err.get("path"), hint=err.get("hint"))  # fmt: skip
    if died:
        r, code = died[-1]  # torchrun lists the root cause last
        return StageError(f"rank {r} of {gpus} exited with {code}{_after(work, r)}",
                          hint="see the run log for torchrun's output")  # fmt: skip
    return StageError(f"torchrun exited with {rc}: {output.strip()[-800:]}",
                      hint="see the run log for torchrun's output")  # fmt: skip


def _after(work: Path, r: int) -> str:
    done = ranks.progress(work, r)
    return f" (after {done[1]})" if done else " (before its first layer finished)"


# ------------------------------------------------------------------ one rank


def main(spec_path: str) -> int:
    """One rank: join the process group, quantize, report an error where the launcher reads it."""
    import torch
    import torch.distributed as dist

    from ..data.tokens import build_token_sets
    from ..model.devices import device_kind
    from ..recipe import load_recipe
    from .engine import quantize

    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec_path).parent
    local = int(os.environ["LOCAL_RANK"])
    device = spec["device"]
    try:
        # compressed-tensors' init_dist() wants an accelerator; gloo serves CPU processes
        if device_kind(device) == "cuda":
            device = f"cuda:{local}"
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device(device))
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
            dist.init_process_group("gloo")
        recipe = load_recipe(Path(spec["recipe"]))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec["model_dir"])
        tokens = build_token_sets(tok, recipe.calibration, recipe.evaluation,
                                  cache_dir=Path(spec["cache_dir"]))  # fmt: skip
        quantize(Path(spec["model_dir"]), recipe, Path(spec["out_dir"]), tokens=tokens,
                 device=device, offload=spec["offload"],
                 resume_dir=Path(spec["resume_dir"]) if spec["resume_dir"] else None)  # fmt: skip
        dist.destroy_process_group()
    except BaseException as e:
        r = int(os.environ.get("RANK", "0"))
        info = (e.to_json() if isinstance(e, errors.QshipError)
                else {"error": type(e).__name__, "message": f"{type(e).__name__}: {e}"})  # fmt: skip
        (work / f"rank{r}.error").write_text(json.dumps({**info, "rank": r}))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
