"""Served performance: what a recipe buys in speed and memory, measured with vLLM's own
benchmark (`vllm bench serve`) for the candidate and its 16-bit reference in one run on one
GPU (pipeline/evaluate/perf.py)."""

from __future__ import annotations

import statistics
from typing import Any

from pydantic import field_validator

from .base import Record


class PerfFigures(Record):
    """One model on one workload: the median over the repeats, and each repeat's figures."""

    output_tok_s: float
    """Output tokens per second (vLLM's output_throughput), median of the repeats."""
    ttft_p50_ms: float
    """Time to first token, median request, ms."""
    ttft_p99_ms: float
    """Time to first token, 99th-percentile request, ms."""
    tpot_p50_ms: float
    """Time per output token after the first, median request, ms."""
    tpot_p99_ms: float
    """Time per output token, 99th-percentile request, ms."""
    repeats: list[dict[str, float]] = []
    """Each repeat's output_tok_s, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms."""


class WorkloadPerf(Record):
    name: str
    """The workload's name (recipe serve.workloads)."""
    prompt_len: int
    """Prompt tokens per request (random tokens)."""
    output_len: int
    """Generated tokens per request (EOS ignored)."""
    concurrency: int
    """Requests in flight at most."""
    num_prompts: int
    """Requests per repeat."""
    reference: PerfFigures
    """The 16-bit reference, same run, same GPU."""
    candidate: PerfFigures
    """The quantized artifact."""
    interleaved: bool = False
    """Both served at once, the candidate's pass r run next to the reference's pass r: each
    speed-up is a ratio of neighbouring passes."""
    reference_cached: bool = False
    """The reference's figures came from an earlier run on the same engine and GPU
    (perf.ReferenceCache), not served beside this candidate."""

    def paired_speedups(self) -> list[float]:
        """Interleaved: the candidate's pass r over the reference's pass r, per repeat."""
        c = [x.get("output_tok_s", 0.0) for x in self.candidate.repeats]
        r = [x.get("output_tok_s", 0.0) for x in self.reference.repeats]
        if not self.interleaved or len(c) != len(r) or not c or min(r) <= 0:
            return []
        return [a / b for a, b in zip(c, r, strict=True)]

    @property
    def speedup(self) -> float:
        """Interleaved: the median of the neighbouring passes' ratios; else the candidate's
        median output tokens/s over the reference's."""
        pairs = self.paired_speedups()
        if pairs:
            return float(statistics.median(pairs))
        r = self.reference.output_tok_s
        return self.candidate.output_tok_s / r if r > 0 else float("nan")

    @property
    def speedup_range(self) -> tuple[float, float] | None:
        """Interleaved: the lowest and highest neighbouring ratio. Else over every pair of
        repeats: the candidate's slowest pass over the reference's fastest, its fastest over
        the reference's slowest (None without repeats). A range holding 1 is a speed-up the
        passes' spread does not show (a small model's launch-bound passes spread up to
        ±20 %: Qwen2.5-Coder-0.5B, H100, 2026-12-06)."""
        pairs = self.paired_speedups()
        if pairs:
            return min(pairs), max(pairs)
        c = [x["output_tok_s"] for x in self.candidate.repeats if "output_tok_s" in x]
        r = [x["output_tok_s"] for x in self.reference.repeats if "output_tok_s" in x]
        if not c or not r or min(r) <= 0:
            return None
        return min(c) / max(r), max(c) / min(r)


class ModelServing(Record):
    """What the engine reported about one model while serving it."""

    weights_gib: float | None = None
    """GPU memory of the loaded weights ("Model loading took X GiB")."""
    kv_cache_tokens: int | None = None
    """KV-cache capacity in tokens at the run's gpu_memory_utilization."""
    kernels: dict[str, dict[str, int | None]] = {}
    """{quantization scheme: {kernel: Linear layers}}: every kernel the engine's log names
    for the scheme (Machete, Marlin, CUTLASS FP8, ...; vLLM names each once), with how many
    Linears ran it where a served check of the same artifact counted them (null: not
    counted)."""
    warnings: list[str] = []
    """The engine's warnings about speed in its log (e.g. Marlin's thread-tile padding)."""

    @field_validator("kernels", mode="before")
    @classmethod
    def _one_kernel_per_scheme(cls, v: Any) -> Any:
        """Records before 2026-12-07 kept one kernel per scheme: {scheme: kernel}."""
        if isinstance(v, dict):
            return {s: {k: None} if isinstance(k, str) else k for s, k in v.items()}
        return v

    def kernel_text(self, scheme: str) -> str:
        """ "MarlinLinearKernel ×90, MacheteLinearKernel ×30" (most Linears first)."""
        got = self.kernels.get(scheme, {})
        order = sorted(got, key=lambda k: -(got[k] or 0))
        return ", ".join(k + (f" ×{got[k]}" if got[k] is not None else "") for k in order)


class ServedPerf(Record):
    """`qship verify --perf` / `qship compare --serve vllm`: served speed and memory."""

    engine: str
    """Engine and version (vllm 0.26.0)."""
    gpu: str
    """The GPU it ran on."""
    gpu_memory_utilization: float
    """The share of GPU memory each server was given (the KV capacity depends on it): the
    reference and the candidate are served side by side, half each."""
    workloads: list[WorkloadPerf]
    """One per recipe workload."""
    reference: ModelServing
    """The reference's memory and kernels."""
    candidate: ModelServing
    """The candidate's memory and kernels."""
    command: str = ""
    """The benchmark command line of one repeat (workload values filled in)."""

    def by_name(self) -> dict[str, WorkloadPerf]:
        return {w.name: w for w in self.workloads}


def perf_lines(p: ServedPerf) -> list[str]:
    """Plain lines for a terminal or a log: one per workload, then memory and kernels."""
    out = [f"served performance ({p.engine}, {p.gpu}; median of the repeats):"]
    for w in p.workloads:
        c, r = w.candidate, w.reference
        rng = w.speedup_range
        out.append(
            f"  {w.name:<12} {w.speedup:5.2f}x"
            + (f" ({rng[0]:.2f}–{rng[1]:.2f}x over the passes)" if rng else "")
            + (" [reference from an earlier run]" if w.reference_cached else "")
            + f"  {c.output_tok_s:8.0f} tok/s (ref {r.output_tok_s:.0f})"
            f"  TTFT p50/p99 {c.ttft_p50_ms:.1f}/{c.ttft_p99_ms:.1f} ms (ref "
            f"{r.ttft_p50_ms:.1f}/{r.ttft_p99_ms:.1f})  TPOT p50 {c.tpot_p50_ms:.2f} ms "
            f"(ref {r.tpot_p50_ms:.2f})"
        )
    rc, cc = p.reference, p.candidate
    if rc.weights_gib is not None and cc.weights_gib is not None:
        out.append(f"  weights {cc.weights_gib:.2f} GiB (ref {rc.weights_gib:.2f}); KV cache "
                   f"{cc.kv_cache_tokens or 0:,} tokens (ref {rc.kv_cache_tokens or 0:,})")  # fmt: skip
    if cc.kernels:
        out.append(
            "  kernels: " + "; ".join(f"{s} -> {cc.kernel_text(s)}" for s in sorted(cc.kernels))
        )
    out += [f"  vLLM warned: {w}" for w in cc.warnings]
    return out
