"""What the served-artifact check compares and finds: the model as measured by evaluate
vs the same artifact as an inference engine serves it (pipeline/evaluate/served.py)."""

from __future__ import annotations

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
    """max_kl (served vs measured), min_top1, max_kl_increase."""
    failures: list[str] = []
    """What exceeded its threshold."""
    seconds: dict[str, float] = {}
    """load, score."""
    facts: dict[str, str] = {}
    """What the engine reported: kernels, attention backend, KV-cache dtype."""

    def summary(self) -> str:
        s, r = self.served_vs_measured, self.served_vs_reference
        head = "served check PASSED" if self.passed else "served check FAILED"
        return (
            f"{head} ({self.engine}, kv {self.kv_cache_dtype}): served vs measured KL "
            f"{s.kl_mean:.3g}, top-1 {s.top1:.4f}; served vs reference KL {r.kl_mean:.4g} "
            f"({self.served_kl_increase:+.1%} vs measured {self.measured_vs_reference.kl_mean:.4g})"
            + "".join(f"\n  {f}" for f in self.failures)
        )
