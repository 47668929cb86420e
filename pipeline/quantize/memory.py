"""Peak memory of a quantize, per phase: the oneshot (calibration + compression), the save,
and the reload check. On CUDA each phase's peak is measured from a reset counter, so a
process that runs several recipes (compare) reports each one's own peak."""

from __future__ import annotations

import gc
import resource

import torch

from ..records.checkpoint import CudaPeak, PeakMemory


class PhasePeaks:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.phases: dict[str, CudaPeak] = {}
        self.at_start: int | None = None
        if self.cuda:
            # what an earlier stage of this process left unreachable must not count here
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.at_start = int(torch.cuda.memory_allocated())

    def end_phase(self, name: str) -> None:
        """Record the peak since the last phase ended, then start counting again."""
        if not self.cuda:
            return
        self.phases[name] = CudaPeak(
            max_allocated_bytes=int(torch.cuda.max_memory_allocated()),
            max_reserved_bytes=int(torch.cuda.max_memory_reserved()),
        )
        torch.cuda.reset_peak_memory_stats()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def result(self) -> PeakMemory:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if not self.phases:
            return PeakMemory(peak_rss_bytes=rss)
        return PeakMemory(
            peak_rss_bytes=rss,
            cuda_max_allocated_bytes=max(p.max_allocated_bytes for p in self.phases.values()),
            cuda_max_reserved_bytes=max(p.max_reserved_bytes for p in self.phases.values()),
            cuda_phases=dict(self.phases),
            cuda_allocated_at_start_bytes=self.at_start,
        )


def release_llmcompressor_session() -> None:
    """llm-compressor's global session keeps the calibrated model (and its modifiers)
    alive after oneshot returns; reset it so the memory can be freed."""
    try:
        from llmcompressor.core import active_session

        active_session().reset()
    except Exception:  # noqa: BLE001 - only memory is at stake, never the result
        pass
