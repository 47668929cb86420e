"""What every command shares: options, the cache root, where library output goes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from ..model.loading import OFFLOAD_MODES


@dataclass
class State:
    """The flags every command takes, before or after its name."""

    verbose: bool = False
    as_json: bool = False
    logfile: Path | None = None  # where the running command's library output and tracebacks go


STATE = State()


def _set_verbose(value: bool) -> bool:
    STATE.verbose = STATE.verbose or value
    return value


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
VerboseOpt = Annotated[
    bool,
    typer.Option("-v", "--verbose", callback=_set_verbose, is_eager=True,
                 help="Show library output and qship's details (also before the command)."),
]  # fmt: skip
CacheOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Stage cache (default $QSHIP_CACHE or ~/.cache/qship)."),
]
RequirePinOpt = Annotated[
    bool,
    typer.Option(
        "--require-pin",
        help="Exit 3 before any compute when no manifest in checksums/ pins the model "
        "(by name or by content), like pip's --require-hashes.",
    ),
]


def _check_pin_folder(value: Path | None) -> Path | None:
    from ..io.pins import require_folder

    return None if value is None else require_folder(Path(value), "--checksums")


ChecksumsOpt = Annotated[
    Path | None,
    typer.Option(
        "--checksums",
        callback=_check_pin_folder,
        help="Folder of pinned manifests, looked up first and written by --pin (default "
        "$QSHIP_CHECKSUMS, else ./checksums); qship's own pins are always looked up too.",
    ),
]


def _check_device(value: str | None) -> str | None:
    from ..model.devices import check_device

    return check_device(value)


def _check_device_name(value: str | None) -> str | None:
    from ..model.devices import check_device

    return check_device(value, on_paper=True)


_DEVICE_HELP = "cpu, cuda or cuda:N (default: the GPU when there is one)."
# commands that compute: the device must be here (exit 2 at once otherwise)
DeviceOpt = Annotated[
    str | None, typer.Option("--device", callback=_check_device, help=_DEVICE_HELP)
]
# commands that plan on paper (`plan`, `compare --matrix`): a valid name is enough
PaperDeviceOpt = Annotated[
    str | None, typer.Option("--device", callback=_check_device_name, help=_DEVICE_HELP)
]
OffloadOpt = Annotated[
    str,
    typer.Option(
        "--offload",
        help="Where the weights live while quantize and evaluate run: none (on the GPU), cpu "
        "(host memory, one decoder layer on the GPU at a time), disk (memory-mapped files), "
        "auto (none when the estimate fits the free GPU memory, else cpu, else disk).",
    ),
]
GpusOpt = Annotated[
    int,
    typer.Option(
        "--gpus",
        help="Quantize with N processes under torchrun (one per GPU; llm-compressor's "
        "distributed oneshot). 0: in this process.",
        min=0,
    ),
]
TorchrunOpt = Annotated[
    str,
    typer.Option(
        "--torchrun-args",
        help='Extra torchrun flags, e.g. "--nnodes 2 --node-rank 0 --rdzv-backend c10d '
        '--rdzv-endpoint HOST:29500" (every node runs the same qship run).',
    ),
]
GpuMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-memory",
        help="Use at most this much GPU memory, e.g. 12GB or 40GiB: the estimate plans with "
        "it (--offload auto then chooses by it) and the process is held to it.",
    ),
]
OFFLOAD_CHOICES = ("auto", *OFFLOAD_MODES)  # auto: chosen by the resource estimate
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str | None, *, option: str = "--gpu-memory") -> int | None:
    """'12GB' / '40GiB' / '1.5e10' -> bytes (None stays None); exit 2 on anything else."""
    import re

    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text!r} is not a size", path=option,
                         hint="write it as 12GB, 40GiB or a number of bytes")  # fmt: skip
    return int(float(m.group(1)) * _UNITS[unit])


def gpu_cap(text: str | None, device: str | None) -> int | None:
    """--gpu-memory in bytes, at most what the GPU it is meant for could have (exit 2)."""
    from ..model.devices import check_gpu_cap

    return check_gpu_cap(device, parse_size(text))


def check_offload(offload: str, *, auto: bool = True) -> str:
    """A valid --offload; `auto` only where a resource estimate chooses (run, quantize, plan)."""
    allowed = OFFLOAD_CHOICES if auto else OFFLOAD_CHOICES[1:]
    if offload not in allowed:
        raise UsageError(f"--offload {offload!r} is not one of {', '.join(allowed)}",
                         path="--offload", hint="use " + ", ".join(allowed) +
                         ("" if auto else " (`qship plan --offload auto` says which fits)"))  # fmt: skip
    return offload


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)  # a str from a typer that has not converted it yet
    env = os.environ.get("QSHIP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "qship"


def default_log(cache_dir: Path | None = None) -> Path:
    """Where library output goes for commands without a report folder of their own."""
    return cache_root(cache_dir) / "logs" / "qship.log"


def check_dtype(dtype: str | None) -> None:
    from typing import get_args

    from ..recipe import DType  # the compute dtypes, the recipe's `dtype:` list

    if dtype is not None and dtype not in get_args(DType):
        raise UsageError(
            f"--dtype {dtype!r} is not a compute dtype",
            path="--dtype",
            hint="use " + ", ".join(get_args(DType)),
        )


class OneLineJson(dict):
    """A result printed as one compact JSON line on stdout, with or without --json (a CI
    matrix that `echo "matrix=$(qship compare --matrix)" >> $GITHUB_OUTPUT` reads)."""
