"""The recipe's `serve:` section: the served check's limits, the served-speed workloads
and their gates, and the long-context retrieval check.

    serve:
      engine: vllm                  # or transformers (CPU)
      kv_cache_dtype: auto          # auto: the checkpoint's FP8 KV cache when it has one
      max_kl: 0.03                  # served vs measured
      workloads: [{name, prompt_len, output_len, concurrency, num_prompts}]
      gates: {min_speedup: {1-stream: 1.2}, max_ttft_ms: {64-streams: 500}}
      long_context: {lengths: [4096, 16384, max], trials: 8, max_drop: 0.125}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, field_validator, model_validator

from .base import Strict as _Strict


class Workload(_Strict):
    """One served-performance workload (`qship verify --perf`, `compare --serve vllm`):
    requests of prompt_len random tokens generating exactly output_len tokens, with at most
    `concurrency` in flight (vLLM's `bench serve`)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    prompt_len: int = Field(gt=0, le=1_048_576)
    output_len: int = Field(gt=0, le=1_048_576)
    concurrency: int = Field(gt=0, le=4096)
    # requests per repeat; null: 8 per stream, at least 16 (enough for p99 to mean something)
    num_prompts: int | None = Field(default=None, gt=0, le=100_000)

    def prompts(self) -> int:
        return self.num_prompts or max(16, 8 * self.concurrency)


DEFAULT_WORKLOADS = [
    Workload(name="1-stream", prompt_len=256, output_len=128, concurrency=1),
    Workload(name="64-streams", prompt_len=1024, output_len=256, concurrency=64),
]


_DEFAULT_LENGTHS: list[int | Literal["max"]] = [4096, 16384, "max"]


class LongContext(_Strict):
    """A served retrieval check at long context (`serve.long_context`): a 5-digit passkey
    hidden at evenly spread depths in natural text of each length, the reference and the
    artifact asked for it (served with its KV cache as configured, and with a 16-bit one);
    exit 4 when the artifact retrieves fewer than the reference by more than max_drop."""

    # total tokens per trial; "max": the model's longest context (max_position_embeddings)
    lengths: list[int | Literal["max"]] = Field(default_factory=lambda: _DEFAULT_LENGTHS.copy(),
                                                min_length=1)  # fmt: skip
    # passkeys per length, at depths (i + 0.5) / trials of the text
    trials: int = Field(default=8, ge=1, le=512)
    # reference's retrieval rate minus the artifact's (FP8 KV as served), per length, at most
    max_drop: float = Field(default=0.125, ge=0, le=1)
    seed: int = 0

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int | str]) -> list[int | str]:
        for x in v:
            if isinstance(x, int) and x < 64:
                raise ValueError(f"{x} tokens leave no room for a needle in text (at least 64)")
        if len(set(v)) != len(v):
            raise ValueError("a length is listed twice")
        return v

    def beyond(self, max_positions: int | None) -> tuple[int, int] | None:
        """(index, tokens) of the first length longer than the model's context, or None."""
        if not isinstance(max_positions, int) or max_positions <= 0:
            return None
        return next(((i, x) for i, x in enumerate(self.lengths)
                     if isinstance(x, int) and x > max_positions), None)  # fmt: skip


class SpeedGates(_Strict):
    """Served-speed limits per workload name, relative to the 16-bit reference measured in
    the same run on the same GPU (exit 4 when missed)."""

    # candidate output tokens/s over the reference's, at least
    min_speedup: dict[str, PositiveFloat] = Field(default_factory=dict)
    # candidate time to first token, p99, at most (milliseconds)
    max_ttft_ms: dict[str, PositiveFloat] = Field(default_factory=dict)

    def any(self) -> bool:
        return bool(self.min_speedup or self.max_ttft_ms)


class ServeGate(_Strict):
    """The served-artifact check run by `qship run` when the engine is there (else it is
    reported as not run) and by `qship verify --serve`: exit 4 beyond these."""

    engine: Literal["vllm", "transformers"] = "vllm"
    # vLLM's kv_cache_dtype: "auto" serves FP8 when the checkpoint has a kv_cache_scheme
    kv_cache_dtype: Literal["auto", "fp8", "bfloat16"] = "auto"
    # KL(measured || served), nats, mean over positions. Two bf16 engines differ by this
    # much on their own: Gemma 3 270M served by vLLM vs measured in transformers, 0.0113
    # with a 16-bit KV cache, 0.0118 with FP8 (H200, bench/RESULTS.md); a tiny Llama 0.0012
    max_kl: float = Field(default=0.03, gt=0)
    # top-1 agreement of served and measured (Gemma 3 270M: 0.926, tiny Llama: 0.963). Where
    # the checkpoint rounds activations at run time (W8A8, W4A8 Linear inputs; an FP8 KV
    # cache) both limits widen to that rounding's noise: KL up to 2x the measured KL, top-1
    # down to its square (served.rounding_floor)
    min_top1: float = Field(default=0.90, ge=0, le=1)
    # KL(ref || served) / KL(ref || measured) - 1: how much worse served is than claimed
    max_kl_increase: float = Field(default=0.05, ge=0)
    # served performance (`--perf`): workloads run through vLLM's own benchmark, each
    # `repeats` times after a warm-up, reference and candidate alike
    workloads: list[Workload] = Field(default_factory=lambda: list(DEFAULT_WORKLOADS),
                                      min_length=1)  # fmt: skip
    repeats: int = Field(default=3, ge=1, le=20)
    seed: int = 0
    gates: SpeedGates = Field(default_factory=SpeedGates)
    # a passkey hidden in long text, retrieved by reference and artifact as served; null: off
    long_context: LongContext | None = None

    def overlong(self, max_positions: int | None) -> tuple[int, Workload] | None:
        """The first workload whose prompt + output exceeds the model's context, or None."""
        if not isinstance(max_positions, int) or max_positions <= 0:
            return None  # unknown context: nothing to hold the workloads against
        for i, w in enumerate(self.workloads):
            if w.prompt_len + w.output_len > max_positions:
                return i, w
        return None

    @model_validator(mode="after")
    def _named(self) -> ServeGate:
        names = [w.name for w in self.workloads]
        if len(set(names)) != len(names):
            raise ValueError("serve.workloads: two workloads share a name")
        for field in ("min_speedup", "max_ttft_ms"):
            for n in getattr(self.gates, field):
                if n not in names:
                    raise ValueError(f"serve.gates.{field}.{n}: no workload named {n!r} "
                                     f"(workloads: {', '.join(names)})")  # fmt: skip
        return self
