"""What every command shares: options, the cache root, where library output goes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
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
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cuda / cpu (default: the GPU when there is one).")
]


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return cache_dir
    env = os.environ.get("QSHIP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "qship"


def default_log(cache_dir: Path | None = None) -> Path:
    """Where library output goes for commands without a report folder of their own."""
    return cache_root(cache_dir) / "logs" / "qship.log"


def check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "bfloat16", "float16", "float32"):
        raise UsageError(
            f"--dtype {dtype!r} is not a compute dtype",
            path="--dtype",
            hint="use bfloat16, float16 or float32",
        )


class OneLineJson(dict):
    """A result printed as one compact JSON line on stdout, with or without --json (a CI
    matrix that `echo "matrix=$(qship compare --matrix)" >> $GITHUB_OUTPUT` reads)."""
