"""Peak memory of a quantize, per phase: the load, the oneshot (calibration + compression),
the save and the reload check. On CUDA each phase's peak is measured from a reset counter,
so a process that runs several recipes (compare) reports each one's own peak; on Linux the
host's too (VmHWM, reset through /proc/self/clear_refs), which is what shows where an
offloaded run's host memory goes."""

from __future__ import annotations

import contextlib
import gc
import resource
import threading
import time
import weakref
from pathlib import Path

import torch

from ..compat.compressed_tensors_0_19 import compress_module_then
from ..records.checkpoint import CudaPeak, HostPeak, PeakMemory


class PhasePeaks:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.phases: dict[str, CudaPeak] = {}
        self.host: dict[str, HostPeak] = {}
        self.at_start: int | None = None
        self.sampler = _AnonSampler()
        reset_host_peak()
        if self.cuda:
            # what an earlier stage of this process left unreachable must not count here
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.at_start = int(torch.cuda.memory_allocated())

    def end_phase(self, name: str) -> None:
        """Record the peak since the last phase ended, then start counting again."""
        hwm = host_peak()
        if hwm is not None:
            self.host[name] = HostPeak(resident_bytes=hwm, anonymous_bytes=self.sampler.take())
            reset_host_peak()
        if not self.cuda:
            return
        self.phases[name] = CudaPeak(
            max_allocated_bytes=int(torch.cuda.max_memory_allocated()),
            max_reserved_bytes=int(torch.cuda.max_memory_reserved()),
        )
        torch.cuda.reset_peak_memory_stats()

    def free(self) -> None:
        """Collect what was dropped and hand cached device and page-locked blocks back; the
        host counters then start from what is left (the next phase is not charged with the
        memory held until here, e.g. the calibrated model before the reload check)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            release_pinned_cache()
        self.sampler.take()
        reset_host_peak()

    def result(self) -> PeakMemory:
        # the phases' resets of the high-water mark reset ru_maxrss too: take the largest
        rss = max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
                  + [h.resident_bytes for h in self.host.values()])  # fmt: skip
        if not self.phases:
            return PeakMemory(peak_rss_bytes=rss, host_phases=dict(self.host))
        return PeakMemory(
            peak_rss_bytes=rss,
            host_phases=dict(self.host),
            cuda_max_allocated_bytes=max(p.max_allocated_bytes for p in self.phases.values()),
            cuda_max_reserved_bytes=max(p.max_reserved_bytes for p in self.phases.values()),
            cuda_phases=dict(self.phases),
            cuda_allocated_at_start_bytes=self.at_start,
        )


class _AnonSampler:
    """The largest anonymous + shared resident size seen (sampled every 50 ms): memory the
    process owns, unlike the file pages of a memory-mapped read, which VmHWM counts too."""

    def __init__(self) -> None:
        self.peak = self.gen = 0
        self.lock = threading.Lock()
        self.alive = _status_kb("RssAnon")["RssAnon"] is not None
        if self.alive:  # the thread ends with its sampler (a weak reference)
            args = (weakref.ref(self),)
            threading.Thread(
                target=_sampling, args=args, name="qship-host-peak", daemon=True
            ).start()

    def _sample(self) -> None:
        gen = self.gen  # a reading from before a take() belongs to the phase that ended
        kb = _status_kb("RssAnon", "RssShmem")
        now = sum(v or 0 for v in kb.values()) * 1024
        with self.lock:
            if gen == self.gen:
                self.peak = max(self.peak, now)

    def take(self) -> int | None:
        """The peak since the last take (now included), then start again from now."""
        if not self.alive:
            return None
        self._sample()
        with self.lock:
            peak, self.peak = self.peak, 0
            self.gen += 1
        return peak


def _sampling(ref: weakref.ref[_AnonSampler]) -> None:
    while (s := ref()) is not None:
        s._sample()
        del s
        time.sleep(0.05)


def _status_kb(*fields: str) -> dict[str, int | None]:
    """{field: kB} from one read of /proc/self/status (None where absent: not Linux)."""
    out: dict[str, int | None] = dict.fromkeys(fields)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in out:
                out[name] = int(rest.split()[0])
    except OSError:
        pass
    return out


def host_peak() -> int | None:
    """The process's resident high-water mark since the last reset (Linux), in bytes."""
    kb = _status_kb("VmHWM")["VmHWM"]
    return None if kb is None else kb * 1024


def reset_host_peak() -> None:
    """Start the high-water mark again from the current resident size (Linux >= 4.0:
    writing 5 to clear_refs); elsewhere the phases are simply not recorded."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def release_pinned_cache() -> None:
    """Hand torch's cached page-locked host blocks back to the system: freed pinned memory
    stays in its caching host allocator otherwise, and with --offload cpu that is the whole
    calibrated model (40.6 GB of host memory at the 8B's reload check, 2.5x its weights,
    H100 2026-12-05)."""
    if not torch.cuda.is_available():
        return
    empty = getattr(torch.accelerator, "empty_host_cache", None)  # torch 2.13 has it
    if empty is not None:
        empty()


def pinned_cache_released_per_module() -> contextlib.AbstractContextManager[None]:
    """With --offload cpu the weights are page-locked host copies. Saving compresses them
    module by module (compressed-tensors' compress_module, in place); each module's freed
    16-bit blocks would stay in torch's caching host allocator until the save ends -- host
    memory held beside the new compressed copy (the 8B's save was its run's peak, 1.43x
    the weights, H100 2026-12-05). Inside the block each module's compression hands them
    back at once (release_pinned_cache)."""
    return compress_module_then(lambda: release_pinned_cache())


def release_llmcompressor_session() -> None:
    """llm-compressor's global session keeps the calibrated model (and its modifiers)
    alive after oneshot returns; reset it so the memory can be freed."""
    try:
        from llmcompressor.core import active_session

        active_session().reset()
    except Exception:  # noqa: BLE001 - only memory is at stake, never the result
        pass
