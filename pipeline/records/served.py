"""What the served-artifact check compares and finds: the model as measured by evaluate
vs the same artifact as an inference engine serves it (pipeline/evaluate/served.py)."""

from __future__ import annotations

import json

from .base import Record


class MeasuredInfo(Record):
    """The measured log-probs stored beside the weights (`qship/measured.safetensors` in an
    artifact) for the served check: the held-out ids evaluate scored, and per position the
    candidate's and the reference's top-k log-probs plus one bucket for the rest."""

    file: str
    """Its path (inside the artifact, or the evaluate cache entry)."""
    sha256: str
    """sha256 of the file."""
    topk: int
    """Tokens kept per position and model."""
    sequences: int
    """Held-out sequences."""
    seq_len: int
    """Tokens per sequence."""
    attention: str
    """The attention numerics it was measured with (e.g. `fp8 kv + fp8 query (vllm)`)."""


class KLFigures(Record):
    """KL(P ‖ Q) in nats per scored position over P's top-k tokens + one tail bucket (a
    lower bound of the full-vocabulary KL), and top-1 agreement."""

    kl_mean: float
    """Mean over positions."""
    kl_p99: float
    """99th percentile."""
    top1: float
    """Share of positions whose most likely token is the same in both."""


class ServedCheck(Record):
    """`qship verify --serve ENGINE` / the recipe's `serve:` gate."""

    engine: str
    """`transformers` or `vllm` (with its version)."""
    kv_cache_dtype: str
    """What the engine was asked for (`auto`: the checkpoint's kv_cache_scheme)."""
    served_vs_measured: KLFigures
    """KL(measured candidate ‖ served): 0 up to the engines' arithmetic noise."""
    served_vs_reference: KLFigures
    """KL(reference ‖ served): the served model's quality."""
    measured_vs_reference: KLFigures
    """KL(reference ‖ measured candidate) at the same top-k: what evaluate claimed."""
    served_kl_increase: float
    """served_vs_reference.kl_mean / measured_vs_reference.kl_mean - 1."""
    missing: int
    """Stored token ids outside what the engine returned (their log-prob bounded by the
    engine's k-th value)."""
    positions: int
    """Positions compared."""
    passed: bool
    """Within the thresholds below."""
    thresholds: dict[str, float] = {}
    """max_kl (served vs measured), min_top1, max_kl_increase as applied; for a checkpoint
    that rounds activations at run time (Linear inputs, an FP8 KV cache) also recipe_max_kl /
    recipe_min_top1, the recipe's own, which the rounding floor may widen, and
    run_time_share, the share of the measured KL from that rounding (the FP8 KV cache's
    from evaluate's KV-off pass; 1 for rounded Linear inputs) whose double max_kl may reach
    (evaluate/served.py `rounding_floor`)."""
    failures: list[str] = []
    """What exceeded its threshold."""
    seconds: dict[str, float] = {}
    """load, score."""
    facts: dict[str, str] = {}
    """What the engine reported: kernels, attention backend, KV-cache dtype."""

    def kernel_counts(self) -> dict[str, dict[str, int]] | None:
        """{scheme: {kernel: Linear layers}} from a vLLM check's walk of its modules
        (facts `linear_kernels`: {"Scheme/Kernel": n}); None without one."""
        raw = self.facts.get("linear_kernels")
        if not raw:
            return None
        out: dict[str, dict[str, int]] = {}
        for key, n in sorted(json.loads(raw).items()):
            scheme, _, kernel = key.partition("/")
            out.setdefault(scheme, {})[kernel] = int(n)
        return out

    def performance_warnings(self) -> list[str]:
        """vLLM's warnings about speed while it served the check (facts)."""
        raw = self.facts.get("performance_warnings")
        return [str(w) for w in json.loads(raw)] if raw else []

    def summary(self) -> str:
        s, r = self.served_vs_measured, self.served_vs_reference
        head = "served check PASSED" if self.passed else "served check FAILED"
        return (
            f"{head} ({self.engine}, kv {self.kv_cache_dtype}): served vs measured KL "
            f"{s.kl_mean:.3g}, top-1 {s.top1:.4f}; served vs reference KL {r.kl_mean:.4g} "
            f"({self.served_kl_increase:+.1%} vs measured {self.measured_vs_reference.kl_mean:.4g})"
            + "".join(f"\n  {f}" for f in self.failures)
        )


class LongContextRow(Record):
    """One length of the long-context retrieval check: the share of passkeys each model
    returned exactly (greedy), out of `trials`."""

    length: int
    """Tokens per trial (text, needle, question and the passkey's own tokens)."""
    trials: int
    """Passkeys asked for, at depths (i + 0.5) / trials."""
    reference: float
    """The 16-bit reference's retrieval rate."""
    served: float
    """The artifact's, served with the check's KV-cache dtype (its FP8 KV cache under auto)."""
    served_16bit: float | None = None
    """The artifact's with a 16-bit KV cache (null: it has no quantized KV cache)."""
    drop: float
    """reference - served."""


class LongContextCheck(Record):
    """`serve.long_context`: a passkey hidden in long natural text, retrieved as served."""

    engine: str
    """`transformers` or `vllm` (with its version)."""
    kv_cache_dtype: str
    """The artifact's KV cache as served (`auto`: its kv_cache_scheme)."""
    rows: list[LongContextRow]
    """One per length."""
    max_drop: float
    """The recipe's limit on `drop`."""
    passed: bool
    """Every length's drop within max_drop."""
    failures: list[str] = []
    """The lengths beyond it, with their figures."""
    seconds: float = 0.0
    """Wall time of the check (every model and length)."""

    def kv_cache_at_fault(self) -> bool:
        """Every failing length retrieves within max_drop with a 16-bit KV cache: the
        quantized KV cache lost it. False when the weights lose it too (Gemma 3 270M's
        mixed recipe: 0 % with either cache, H100 2026-12-06) or there is no 16-bit run."""
        bad = [r for r in self.rows if r.drop > self.max_drop]
        return bool(bad) and all(
            r.served_16bit is not None and r.reference - r.served_16bit <= self.max_drop
            for r in bad
        )

    def summary(self) -> str:
        head = "long-context check " + ("PASSED" if self.passed else "FAILED")
        rows = ", ".join(
            f"{r.length}: {r.served:.0%} vs {r.reference:.0%}"
            + (f" (16-bit KV {r.served_16bit:.0%})" if r.served_16bit is not None else "")
            for r in self.rows
        )
        return f"{head} ({self.engine}, kv {self.kv_cache_dtype}; retrieved at {rows})" + "".join(
            f"\n  {f}" for f in self.failures
        )
