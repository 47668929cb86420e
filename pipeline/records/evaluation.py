"""EvalReport: what evaluate hands on -- the candidate's quality against its reference.

eval.json (EvalFile) is this record plus the gate's verdict, the quantize figures and, in
an artifact, the load-probe fingerprint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .base import SCHEMA_VERSION, Record
from .checkpoint import QuantizeSummary
from .verdict import Verdict


class KLStats(Record):
    """Per-token KL(P_ref ‖ P_cand) in nats over the scored held-out positions."""

    mean: float
    stderr: float
    """Standard error of the mean (std / sqrt(tokens))."""
    median: float
    p90: float
    p99: float
    p999: float
    max: float


class KLHist(Record):
    """Per-token KL counts on fixed log-spaced bins (8 per decade, 1e-6 .. 1e2 nats)."""

    edges: list[float]
    counts: list[int]
    zero: int
    """Tokens below the first edge (exact zeros included)."""


class Metrics(Record):
    tokens: int
    """Scored positions (sequences × (seq_len − 1))."""
    kl: KLStats
    top1_agreement: float
    """Share of positions where both models' most likely next token is the same."""
    top1_agreement_stderr: float
    ppl_reference: float
    """exp(mean NLL of the actual next token) of the reference."""
    ppl_candidate: float
    ppl_ratio: float
    ln_ppl_ratio_stderr: float
    """Standard error of ln(ppl ratio), from the paired per-token NLL differences."""
    rms_dp: float
    """RMS of p_cand(next) − p_ref(next) (llama.cpp's --kl-divergence figure)."""
    mean_dp: float
    kl_hist: KLHist
    kl_mode: str
    """exact (full vocabulary) or cached-top<k>+tail (a lower bound of the exact KL)."""


class Score(Record):
    value: float
    stderr: float | None = None


class TaskResult(Record):
    status: Literal["ok", "skipped"]
    reason: str | None = None
    """Why it was skipped."""
    hub: bool = False
    """A task whose data comes from the Hub."""
    metric: str | None = None
    higher_is_better: bool | None = None
    reference: Score | None = None
    candidate: Score | None = None
    drop: float | None = None
    """How much worse the candidate is (reference − candidate for higher-is-better)."""
    drop_stderr: float | None = None
    n: int | None = None
    """Items scored."""
    all_metrics: dict[str, dict[str, Score]] = {}
    """reference / candidate -> every metric lm-eval reported."""


class Benchmarks(Record):
    tasks: dict[str, TaskResult] = {}
    limit: int | None = None
    """Items per task (lm-eval's limit), null = the whole set."""
    reference_cached: bool = False
    hub_online: bool = False


class ModelRef(Record):
    path: Path
    model_hash: str


class CandidateRef(ModelRef):
    kv_cache_scheme: dict[str, Any] | None = None
    """The candidate's quantization_config.kv_cache_scheme."""
    kv_hooked_attention_modules: int = 0
    """Attention modules carrying compressed-tensors' KV quantization hook when evaluated."""


class CorpusRef(Record):
    source: str | None = None
    corpus_hash: str | None = None
    heldout_hash: str
    """sha256 of the held-out ids that were scored (shape + int64 bytes)."""
    sequences: int
    seq_len: int
    tokens_scored: int


class EvalSettings(Record):
    mode: str
    topk: int | None
    kl_approximation: str | None
    kl_dtype: str
    batch_size: int
    device: str
    dtype: str
    kv_cache: str
    weights_only_pass: bool
    """A second candidate pass ran with the KV-cache rounding off."""


class KVShare(Record):
    kl_mean_kv_on: float
    kl_mean_kv_off: float
    kl_mean_added_by_kv: float
    fraction_of_kl_from_kv: float


class ReferenceCacheInfo(Record):
    key: str
    hit: bool
    path: Path
    file: str
    tokens: int
    topk: int
    model_hash: str
    heldout_hash: str
    sequences: int
    seq_len: int
    dtype: str
    device: str
    load_s: float
    forward_s: float
    bytes: int


class EvalReport(Record):
    schema_version: int = SCHEMA_VERSION
    reference: ModelRef
    candidate: CandidateRef
    corpus: CorpusRef
    settings: EvalSettings
    metrics: Metrics
    """The candidate as deployed (its FP8 KV cache in the loop when it has one)."""
    metrics_weights_only: Metrics | None = None
    """The same with the KV-cache rounding off (null: no KV scheme)."""
    kv_cache_share: KVShare | None = None
    reference_cache: ReferenceCacheInfo | None = None
    benchmarks: Benchmarks = Benchmarks()
    timings: dict[str, float] = {}

    def summary(self) -> str:
        m = self.metrics
        return (
            f"KL mean {m.kl.mean:.4g} ± {m.kl.stderr:.2g}, p99 {m.kl.p99:.3g}, top-1 "
            f"{m.top1_agreement:.3f}, ppl ratio {m.ppl_ratio:.3f} ({m.tokens} tokens, {m.kl_mode})"
        )


class Probe(Record):
    """The load-probe fingerprint: top-k logits of one forward pass (float32, CPU)."""

    format: Literal["qship-probe-v1"] = "qship-probe-v1"
    prompt_ids: list[int]
    top_k: int
    top_ids: list[list[int]]
    top_logits: list[list[float]]
    """Rounded to 1e-4."""


class EvalFile(EvalReport):
    """eval.json: the evaluation with what the later stages add to it."""

    verdict: Verdict | None = None
    quantize: QuantizeSummary | None = None
    """The quantize figures a comparison row shows (absent when evaluate ran alone on a
    folder without quantize_report.json)."""
    probe: Probe | None = None
    """In an artifact: what `qship verify --load` compares a reload with."""

    @classmethod
    def of(cls, report: EvalReport, **extra: Any) -> EvalFile:
        return cls(**{k: getattr(report, k) for k in EvalReport.model_fields}, **extra)
