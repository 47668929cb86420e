"""The fetch stage: a model source -> a verified local Snapshot in the stage cache.

* `hf://org/name[@revision]` (hub.py) -- the revision is resolved to a commit SHA first and
  everything is downloaded *at that commit*; only model files are taken; each is checked
  against the Hub's LFS sha256 and the pin. With `HF_HUB_OFFLINE=1` a filled HF cache is
  used (no LFS check: recorded so).
* a local folder (local.py) -- a plain checkpoint, or an HF cache snapshot folder.
* a `.gguf` file or `gguf-pkg://NAME` (gguf.py) -- the GGUF is hashed and pinned, then
  dequantized by transformers to a deterministic bf16 checkpoint with a pin of its own.

snapshot.py holds what every source ends with: copy-while-hashing into the cache entry,
the consistency checks, the pin check, and the atomic rename.

`read_config` gives a source's config without fetching its weights, so that a recipe is
checked against the model (exit 2) before anything large is downloaded or loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..io.pins import checksums_dir as pin_folder
from ..records.snapshot import Snapshot
from .sources import Source, parse_source

__all__ = ["Source", "fetch", "parse_source", "read_config"]


def fetch(
    source: str | Path,
    *,
    cache_dir: Path,
    checksums_dir: Path | None = None,
    allow_pickle: bool = False,
    pin: bool = False,
    require_pin: bool = False,
) -> Snapshot:
    """Fetch, verify and cache a model; see the module docstring. IntegrityError = exit 3;
    with `require_pin` an input that no manifest pins (by name or content) is exit 3 too,
    raised before the download (Hub) or the dequantization (GGUF)."""
    if pin and require_pin:
        raise UsageError(
            "--pin and --require-pin contradict each other",
            path="--require-pin",
            hint="pin once with --pin (after review), then run with --require-pin",
        )
    src = parse_source(source)
    checksums_dir, cache_dir = pin_folder(checksums_dir), Path(cache_dir)
    if src.kind == "hf":
        from .hub import fetch_hub

        snap = fetch_hub(src, cache_dir=cache_dir, checksums_dir=checksums_dir,
                         allow_pickle=allow_pickle, pin=pin, require_pin=require_pin)  # fmt: skip
    elif src.kind == "dir":
        from .local import fetch_dir

        snap = fetch_dir(src, cache_dir=cache_dir, checksums_dir=checksums_dir,
                         allow_pickle=allow_pickle, pin=pin, require_pin=require_pin)  # fmt: skip
    else:
        from .gguf import fetch_gguf

        snap = fetch_gguf(src, cache_dir=cache_dir, checksums_dir=checksums_dir, pin=pin,
                          require_pin=require_pin)  # fmt: skip
    snap = _pin_by_content(snap, checksums_dir, require_pin)
    if any(Path(snap.path).glob("*.safetensors")):
        from ..model.config_check import check_source_weights

        check_source_weights(Path(snap.path))  # config.json vs the headers: exit 3
    return snap


def _pin_by_content(snap: Snapshot, checksums_dir: Path, require_pin: bool) -> Snapshot:
    """A cache entry recorded as unpinned may have been pinned since (or match a pin by
    content); it is looked up again, and refused under --require-pin."""
    if snap.pin_status != "unpinned":
        return snap
    from ..io.pins import find_by_content, unpinned_error

    found = find_by_content(checksums_dir, dict(snap.files))
    if found is not None:
        return snap.model_copy(update={"pin_status": "pinned", "manifest": str(found)})
    if require_pin:
        from ..io.hashing import Manifest

        name = Manifest.filename(snap.repo_id or "local/model", snap.revision or "local")
        raise unpinned_error(snap.source, checksums_dir / name)
    return snap


def read_config(source: str | Path, *, cache_dir: Path) -> Any:
    """The transformers config of a source, read without its weights: a folder's
    config.json, the Hub's config.json at the revision, a GGUF's metadata."""
    from transformers import AutoConfig

    from ..model.config_check import check_config_bounds, check_source_weights

    src = parse_source(source)
    try:
        if src.kind == "dir":
            assert src.path is not None
            # config.json against the weights' headers before any model is built from it
            if any(src.path.glob("*.safetensors")):
                check_source_weights(src.path)
            return AutoConfig.from_pretrained(str(src.path))
        if src.kind == "hf":
            from .hub import hub_config

            config = hub_config(src)
            check_config_bounds(config.to_dict(), where=f"{src.text}/config.json")
            return config
        from .gguf import gguf_path
        from .gguf_config import gguf_config

        path, _, _ = gguf_path(src, Path(cache_dir))
        return gguf_config(path)
    except UsageError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(
            f"cannot read the model's config ({type(e).__name__}: {str(e)[:300]})",
            path=src.text,
            hint="check the source: a folder needs config.json; a GGUF must be one "
            "transformers can read",
        ) from e
