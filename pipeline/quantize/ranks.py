"""What a quantize process needs to know about torch.distributed: which rank writes, the
ranks' peak memory, and where each rank's progress goes for the launcher (distributed.py)
to name the rank and the layer of a failure. Outside torch.distributed: one process, rank 0."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..records.checkpoint import PeakMemory

PROGRESS_ENV = "QSHIP_RANK_DIR"  # set by the launcher: a folder for per-rank progress files


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def is_writer() -> bool:
    return rank() == 0


def gather_peaks(mine: PeakMemory) -> list[PeakMemory]:
    """Every rank's peak (collective; [] in one process)."""
    d = _dist()
    if d is None:
        return []
    got: list[object] = [None] * d.get_world_size()
    d.all_gather_object(got, mine.to_json())
    return [PeakMemory.model_validate(p) for p in got]


def summed(counts: dict[str, int]) -> dict[str, int]:
    """Per-key totals over the ranks (collective; the same keys on every rank): what each
    rank counted on its share of the calibration samples, e.g. tokens per MoE expert."""
    d = _dist()
    if d is None or not counts:
        return counts
    import torch

    keys = sorted(counts)
    t = torch.tensor([counts[k] for k in keys], dtype=torch.int64)
    d.all_reduce(t)
    return dict(zip(keys, (int(v) for v in t.tolist()), strict=True))


def alone() -> contextlib.AbstractContextManager[None]:
    """Rank 0's own work after the collective part (the checks, the reload): compressed-
    tensors and model loading act as in one process."""
    from compressed_tensors.offload import as_single_threaded

    return as_single_threaded() if _dist() else contextlib.nullcontext()


def _progress_file(folder: Path, r: int) -> Path:
    return folder / f"rank{r}.layer"


def layer_done(layer: str, count: int) -> None:
    """Record the last decoder layer this rank finished and how many are done (the launcher
    shows rank 0's as progress and names a failed rank's)."""
    folder = os.environ.get(PROGRESS_ENV)
    if folder:
        tmp = _progress_file(Path(folder), rank()).with_suffix(".tmp")
        tmp.write_text(f"{count}\t{layer}")
        os.replace(tmp, _progress_file(Path(folder), rank()))


def progress(folder: Path, r: int) -> tuple[int, str] | None:
    """(layers done, the last one) as rank `r` recorded them, or None."""
    p = _progress_file(folder, r)
    if not p.is_file():
        return None
    count, _, layer = p.read_text().partition("\t")
    return int(count), layer
