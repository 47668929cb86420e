"""QuantResults: qship's own in-toto predicate, the measured results an artifact ships with.

It rides in `attestation/results.json`, an in-toto v1 statement whose subjects are the
artifact's files (the same subjects as the SLSA provenance statement beside it), so a deploy
system's policy can read what was measured without parsing qship's eval.json. Every figure is
eval.json's, and `qship verify` holds the two equal.
"""

from __future__ import annotations

from .base import Record
from .benchmarks import TaskResult
from .evaluation import EvalFile, KLStats
from .perf import ServedPerf
from .served import LongContextCheck, ServedCheck
from .verdict import Verdict

RESULTS_PREDICATE = "urn:qship:predicate:results:v1"
RESULTS_VERSION = 1


class KLResults(Record):
    """KL(reference ‖ quantized) per token on the held-out set, and what follows from it."""

    tokens: int
    """Tokens scored."""
    kl: KLStats
    """The per-token KL statistics (mean, stderr, quantiles, max)."""
    top1_agreement: float
    """Fraction of tokens where both models' argmax agree."""
    ppl_ratio: float
    """Perplexity of the quantized model over the reference's."""
    heldout_hash: str
    """sha256 of the held-out token ids measured on."""


class QuantResults(Record):
    version: int = RESULTS_VERSION
    """Version of this predicate's layout (its type is `urn:qship:predicate:results:v1`)."""
    eval_sha256: str
    """sha256 of the artifact's eval.json, the record every figure here comes from."""
    verdict: Verdict
    """The quality gate: each check, its value and limit."""
    kl: KLResults
    """The KL statistics as measured (served numerics where the recipe serves so)."""
    benchmarks: dict[str, TaskResult] = {}
    """Per task: both scores, the paired drop and its interval."""
    served: ServedCheck | None = None
    """The served check (engine vs measured log-probs), when it ran."""
    served_perf: ServedPerf | None = None
    """Served speed and memory beside the 16-bit reference, when measured."""
    long_context: LongContextCheck | None = None
    """Long-context retrieval as served, when the recipe asks for it."""

    @classmethod
    def of(cls, ev: EvalFile, eval_sha256: str) -> QuantResults:
        """The predicate for an artifact whose eval.json is `ev` (with its verdict)."""
        if ev.verdict is None:
            raise ValueError("eval.json has no verdict")
        m = ev.metrics
        return cls(
            eval_sha256=eval_sha256,
            verdict=ev.verdict,
            kl=KLResults(
                tokens=m.tokens,
                kl=m.kl,
                top1_agreement=m.top1_agreement,
                ppl_ratio=m.ppl_ratio,
                heldout_hash=ev.corpus.heldout_hash,
            ),  # fmt: skip
            benchmarks=ev.benchmarks.tasks,
            served=ev.served,
            served_perf=ev.served_perf,
            long_context=ev.long_context,
        )
