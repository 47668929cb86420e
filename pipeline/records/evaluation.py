"""EvalReport: what evaluate hands on -- the candidate's quality against its reference.

eval.json (EvalFile) is this record plus the gate's verdict, the quantize figures and, in
an artifact, the load-probe fingerprint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..recipe import EvaluationConfig
from .base import SCHEMA_VERSION, Record
from .benchmarks import Benchmarks, Overlap
from .checkpoint import QuantizeSummary
from .perf import ServedPerf
from .served import LongContextCheck, MeasuredInfo, ServedCheck
from .verdict import Verdict


class KLStats(Record):
    """Per-token KL(P_ref ‖ P_cand) in nats over the scored held-out positions."""

    mean: float
    """Mean over the scored positions."""
    stderr: float
    """Standard error of the mean (std / sqrt(tokens))."""
    median: float
    """50th percentile."""
    p90: float
    """90th percentile."""
    p99: float
    """99th percentile."""
    p999: float
    """99.9th percentile."""
    max: float
    """The largest per-token KL."""


class KLHist(Record):
    """Per-token KL counts on fixed log-spaced bins (8 per decade, 1e-6 .. 1e2 nats)."""

    edges: list[float]
    """Bin edges (65 values, 1e-6 .. 1e2)."""
    counts: list[int]
    """Tokens per bin (values above the last edge are in the last bin)."""
    zero: int
    """Tokens below the first edge (exact zeros included)."""


class Metrics(Record):
    tokens: int
    """Scored positions (sequences × (seq_len − 1))."""
    kl: KLStats
    """KL(P_ref ‖ P_cand) per token, nats."""
    top1_agreement: float
    """Share of positions where both models' most likely next token is the same."""
    top1_agreement_stderr: float
    """Binomial standard error of top1_agreement."""
    ppl_reference: float
    """exp(mean NLL of the actual next token) of the reference."""
    ppl_candidate: float
    """exp(mean NLL of the actual next token) of the candidate."""
    ppl_ratio: float
    """ppl_candidate / ppl_reference."""
    ln_ppl_ratio_stderr: float
    """Standard error of ln(ppl ratio), from the paired per-token NLL differences."""
    rms_dp: float
    """RMS of p_cand(next) − p_ref(next) (llama.cpp's --kl-divergence figure)."""
    mean_dp: float
    """Mean of p_cand(next) − p_ref(next)."""
    kl_hist: KLHist
    """The per-token KL distribution (what compare plots)."""
    kl_mode: str
    """exact (full vocabulary) or cached-top<k>+tail (a lower bound of the exact KL)."""


class EvalOptions(Record):
    """How evaluate() runs: what it measures and on what (evaluate's input; EvalSettings is
    what it reports having used). `of(recipe.evaluation, ...)` takes the recipe's part."""

    tasks: tuple[str, ...] = ()
    """lm-eval tasks run on their pinned local data."""
    hub_tasks: tuple[str, ...] = ()
    """lm-eval tasks whose data comes from the Hub (skipped offline)."""
    limit: int | None = None
    """Items per task (the first N), null = all."""
    task_batch_size: int = 4
    """lm-eval's batch size."""
    batch_size: int = 4
    """Held-out sequences per forward pass."""
    exact: bool = False
    """Full-vocabulary KL, both models in lockstep (else top-k + tail against the cache)."""
    device: str | None = None
    """cuda / cpu (null: the GPU when there is one)."""
    dtype: str | None = None
    """Compute dtype of both models (null: the checkpoint's on a GPU, float32 on the CPU)."""
    topk: int = 4096
    """Reference tokens stored per position (cached mode)."""
    kv_off: bool = True
    """Also measure the candidate with its FP8 KV rounding off (the KV cache's share)."""
    attention: str = "vllm"
    """The serving engine's attention numerics to simulate with an FP8 KV cache."""
    measured_topk: int = 32
    """Top-k log-probs of both models kept for the served check (0: none)."""
    kv_skip_layers: tuple[int, ...] | None = None
    """Decoder layers whose KV cache is served 16-bit (None: what the candidate's recipe or
    quantize record says)."""
    offload: str = "none"
    """Where the weights live: none (the device), cpu or disk (host memory)."""
    code_execution: str = "off"
    """Whether code tasks may run model-written code in the sandbox (evaluation.code_execution)."""
    greedy_prompts: int = 0
    """Held-out prompts continued greedily by both models (0: greedy agreement not measured)."""
    greedy_tokens: int = 32
    """Tokens per greedy continuation."""

    @classmethod
    def of(cls, ev: EvaluationConfig, **overrides: Any) -> EvalOptions:
        return cls(tasks=tuple(ev.tasks), hub_tasks=tuple(ev.hub_tasks), limit=ev.limit,
                   task_batch_size=ev.task_batch_size, batch_size=ev.batch_size,
                   attention=ev.attention, measured_topk=ev.measured_topk,
                   code_execution=ev.code_execution, greedy_prompts=ev.greedy_prompts,
                   greedy_tokens=ev.greedy_tokens, **overrides)  # fmt: skip


class GreedyAgreement(Record):
    """Greedy continuations of held-out prompts, candidate against reference, token for
    token (label-free: evaluate/greedy.py)."""

    prompts: int
    """Held-out prompts continued (evaluation.greedy_prompts)."""
    tokens: int
    """Tokens each model wrote per prompt (evaluation.greedy_tokens)."""
    identical: float
    """Share of continuations identical to the reference's (gates.greedy_agreement_min)."""
    mean_first_difference: float
    """Mean position (0-based) of the first token that differs; `tokens` where none does."""
    token_agreement: float
    """Share of positions where both wrote the same token."""
    engine: str
    """What generated them."""
    reference_cached: bool = False
    """The reference's continuations came from the stage cache."""

    def describe(self) -> str:
        return (f"{self.identical:.0%} of {self.prompts} greedy {self.tokens}-token "
                f"continuations identical; first difference at token "
                f"{self.mean_first_difference:.1f} on average")  # fmt: skip


class ModelRef(Record):
    path: Path
    """The checkpoint folder."""
    model_hash: str
    """Its identity (pipeline.model.files.model_hash)."""


class CandidateRef(ModelRef):
    kv_cache_scheme: dict[str, Any] | None = None
    """The candidate's quantization_config.kv_cache_scheme."""
    kv_hooked_attention_modules: int = 0
    """Attention modules carrying compressed-tensors' KV quantization hook when evaluated."""
    served_linear_modules: int = 0
    """Linear modules evaluated with vLLM's activation rounding (W8A8, W4A8: numerics.py)."""


class CorpusRef(Record):
    source: str | None = None
    """The corpus the held-out tokens come from."""
    corpus_hash: str | None = None
    """sha256 over the corpus documents."""
    heldout_hash: str
    """sha256 of the held-out ids that were scored (shape + int64 bytes)."""
    sequences: int
    """Held-out sequences."""
    seq_len: int
    """Tokens per sequence."""
    tokens_scored: int
    """Positions scored (sequences × (seq_len − 1))."""


class EvalSettings(Record):
    mode: str
    """exact or cached-top<k>+tail."""
    topk: int | None
    """Reference tokens stored per position (cached mode)."""
    kl_approximation: str | None
    """How the cached KL relates to the exact one (null in exact mode)."""
    kl_dtype: str
    """Precision the KL is summed in."""
    batch_size: int
    """Sequences per forward pass."""
    device: str
    """Where it ran."""
    dtype: str
    """Compute dtype of both models (auto = the checkpoint's)."""
    kv_cache: str
    """Whether the candidate's FP8 KV cache was in the loop."""
    weights_only_pass: bool
    """A second candidate pass ran with the KV-cache rounding off."""
    attention: str = "kv-only"
    """Attention numerics with the FP8 KV cache: `vllm` (K, V and the query rounded to FP8,
    as vLLM serves it on CUDA), `kv-only` (K and V), or no FP8 KV cache."""
    kv_16bit_layers: list[int] = []
    """Decoder layers whose K, V and query stayed 16-bit (kv_cache.skip_layers)."""
    served_numerics: str | None = None
    """The revision of qship's simulation of the serving engine's arithmetic
    (evaluate/numerics.py: SERVED_NUMERICS) the candidate was computed with; None when it
    had nothing to simulate (16-bit activations and KV cache). Figures of two revisions
    are not comparable."""


class KVShare(Record):
    kl_mean_kv_on: float
    """Mean KL with the FP8 KV cache (as deployed)."""
    kl_mean_kv_off: float
    """Mean KL with the KV rounding off."""
    kl_mean_added_by_kv: float
    """What the FP8 KV cache adds."""
    fraction_of_kl_from_kv: float
    """That addition as a share of the total."""


class ReferenceCacheInfo(Record):
    key: str
    """The entry's key in the stage cache."""
    hit: bool
    """True when no reference pass ran."""
    path: Path
    """The entry's folder."""
    file: str
    """The safetensors file with the stored log-probs."""
    tokens: int
    """Positions stored."""
    topk: int
    """Tokens stored per position."""
    model_hash: str
    """The reference's identity."""
    heldout_hash: str
    """sha256 of the held-out ids."""
    sequences: int
    """Held-out sequences."""
    seq_len: int
    """Tokens per sequence."""
    dtype: str
    """Compute dtype of the reference pass."""
    device: str
    """Where the reference pass ran."""
    load_s: float
    """Seconds to load the reference."""
    forward_s: float
    """Seconds of the reference pass."""
    bytes: int
    """Size of the stored file."""


class EvalReport(Record):
    schema_version: int = SCHEMA_VERSION
    """Version of this record's layout."""
    reference: ModelRef
    """The unquantized model."""
    candidate: CandidateRef
    """The quantized model."""
    corpus: CorpusRef
    """The held-out tokens scored."""
    settings: EvalSettings
    """How it was measured."""
    metrics: Metrics
    """The candidate as deployed (its FP8 KV cache in the loop when it has one)."""
    metrics_weights_only: Metrics | None = None
    """The same with the KV-cache rounding off (null: no KV scheme)."""
    kv_cache_share: KVShare | None = None
    """The FP8 KV cache's part of the KL (null without one)."""
    reference_cache: ReferenceCacheInfo | None = None
    """The cached reference pass used (null in exact mode)."""
    benchmarks: Benchmarks = Benchmarks()
    """lm-eval tasks of both models."""
    overlap: Overlap | None = None
    """Calibration text vs the held-out tokens and every local benchmark's items."""
    measured: MeasuredInfo | None = None
    """The measured log-probs stored for the served check."""
    served: ServedCheck | None = None
    """The served-artifact check (recipe `serve:`), when it ran."""
    served_skipped: str | None = None
    """Why the recipe's served check did not run (its engine absent here)."""
    served_perf: ServedPerf | None = None
    """Served speed and memory beside the reference (`--perf`, `compare --serve vllm`)."""
    long_context: LongContextCheck | None = None
    """The long-context retrieval check (recipe `serve.long_context`), when it ran."""
    greedy: GreedyAgreement | None = None
    """Greedy agreement with the reference (null: evaluation.greedy_prompts is 0)."""
    timings: dict[str, float] = {}
    """Seconds per step."""

    def summary(self) -> str:
        m = self.metrics
        tasks, skipped = self.benchmarks.tasks, self.benchmarks.skipped()
        ran = f"; {len(tasks) - len(skipped)} of {len(tasks)} benchmark(s) ran" if tasks else ""
        return (
            f"KL mean {m.kl.mean:.4g} ± {m.kl.stderr:.2g}, p99 {m.kl.p99:.3g}, top-1 "
            f"{m.top1_agreement:.3f}, ppl ratio {m.ppl_ratio:.3f} ({m.tokens} tokens, {m.kl_mode})"
            f"{ran}"
        )

    def skipped_lines(self) -> list[str]:
        """One line per benchmark that did not run, with why (shown after the stage line)."""
        return [f"  ! {t} did not run: {why[:200]}" for t, why in self.benchmarks.skipped().items()]


class Probe(Record):
    """The load-probe fingerprint: top-k logits of one forward pass (float32, CPU)."""

    format: Literal["qship-probe-v1"] = "qship-probe-v1"
    """Fingerprint format."""
    prompt_ids: list[int]
    """The probe's token ids."""
    top_k: int
    """Tokens kept per position."""
    top_ids: list[list[int]]
    """Per position, the top-k token ids."""
    top_logits: list[list[float]]
    """Rounded to 1e-4."""


class EvalFile(EvalReport):
    """eval.json: the evaluation with what the later stages add to it."""

    verdict: Verdict | None = None
    """The gate's verdict."""
    quantize: QuantizeSummary | None = None
    """The quantize figures a comparison row shows (absent when evaluate ran alone on a
    folder without quantize_report.json)."""
    probe: Probe | None = None
    """In an artifact: what `qship verify --load` compares a reload with."""

    @classmethod
    def of(cls, report: EvalReport, **extra: Any) -> EvalFile:
        return cls(**{k: getattr(report, k) for k in EvalReport.model_fields}, **extra)
