"""qship run"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from .. import log
from ..errors import QshipError
from ..records.run import RunRecord
from .common import (
    CacheOpt,
    ChecksumsOpt,
    DeviceOpt,
    GpuMemoryOpt,
    GpusOpt,
    JsonOpt,
    OffloadOpt,
    RequirePinOpt,
    TorchrunOpt,
    VerboseOpt,
    cache_root,
    check_offload,
    gpu_cap,
)


def run_cmd(
    model: Annotated[
        str, typer.Option("--model", help="hf://org/name[@rev], a dir, a .gguf or gguf-pkg://NAME.")
    ],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Artifact directory: a new one, or the one this same "
            "command built (verified and reused, e.g. to publish after exit 5).",
        ),
    ],
    publish_to: Annotated[
        str | None,
        typer.Option(
            "--publish-to",
            help="file:///registry, hf://org/name or oci://HOST/REPO:TAG, if the gate passes.",
        ),
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="PEM private key to sign with.")
    ] = None,
    device: DeviceOpt = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept .bin/.pt weights.")
    ] = False,
    require_pin: RequirePinOpt = False,
    offload: OffloadOpt = "auto",
    gpu_memory: GpuMemoryOpt = None,
    gpus: GpusOpt = 0,
    torchrun_args: TorchrunOpt = "",
    checksums: ChecksumsOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> RunRecord:
    """recipe → fetch → tokens → quantize → evaluate → gate → package (→ publish), resumable
    through the stage cache. Library output goes to <out>.report/run.log (-v: the terminal)."""
    from ..runner import check_out, report_dir_for, run
    from .common import STATE

    check_offload(offload)
    cap = gpu_cap(gpu_memory, device)  # at once, before any stage
    logfile = STATE.logfile = report_dir_for(check_out(out)) / "run.log"
    log.info(f"qship run {model} → {out}  (library output: {logfile})", style="bold")
    with (log.third_party_to(logfile, verbose=STATE.verbose),
          log.traceback_to_log(expected=(QshipError,))):  # fmt: skip
        return run(model, recipe, out, cache_dir=cache_root(cache_dir), publish_to=publish_to,
                   sign_key=sign_key, device=device, allow_pickle=allow_pickle,
                   require_pin=require_pin, offload=offload, gpus=gpus,
                   torchrun_args=tuple(shlex.split(torchrun_args)),
                   gpu_memory=cap,
                   checksums_dir=checksums)  # fmt: skip
