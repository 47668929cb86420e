"""ResourceEstimate: what a run will need, predicted from the config and the recipe."""

from __future__ import annotations

from .base import Record


class ResourceEstimate(Record):
    """Predicted peaks and time of quantize (and evaluate's peak) on one device, from the
    plan and measured per-layer costs (pipeline/quantize/estimate.py; predicted vs
    measured in bench/RESULTS.md)."""

    device: str
    """cuda or cpu."""
    offload: str = "none"
    """Where the weights live while quantize runs: none (on the device), cpu, disk."""
    ranks: int = 1
    """Processes (GPUs) under torchrun (--gpus); the GPU figures are per rank."""
    quantize_gpu_bytes: int | None
    """Peak GPU memory of quantize (with `offload`), null on the CPU."""
    quantize_cpu_bytes: int
    """Peak resident memory of the quantize process."""
    quantize_s: float
    """Calibration + compression time."""
    evaluate_gpu_bytes: int | None
    """Peak GPU memory of evaluate (one model and a batch of logits), null on the CPU."""
    disk_bytes: int
    """New cache entries and the artifact: bf16 snapshot, checkpoint twice, reference log-probs,
    the finished layers kept for a resume while quantize runs (and the weights' files with
    --offload disk)."""
    checkpoint_disk_bytes: int | None = None
    """What `qship quantize` alone writes: the checkpoint (and the weights' files with
    --offload disk); null in records written before it was estimated."""
    basis: str
    """Which measured costs the figures come from."""

    def summary(self) -> str:
        gb = 1e9
        gpu = (f"GPU {self.quantize_gpu_bytes / gb:.1f} GB quantize / "
               f"{(self.evaluate_gpu_bytes or 0) / gb:.1f} GB evaluate, "
               if self.quantize_gpu_bytes is not None else "")  # fmt: skip
        off = f" (--offload {self.offload})" if self.offload != "none" else ""
        off += f" × {self.ranks} GPUs (GPU figures per GPU)" if self.ranks > 1 else ""
        return (f"  estimate on {self.device}{off}: {gpu}CPU {self.quantize_cpu_bytes / gb:.1f} GB, "
                f"disk {self.disk_bytes / gb:.1f} GB, quantize ~{self.quantize_s / 60:.1f} min")  # fmt: skip
