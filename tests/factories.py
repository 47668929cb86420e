"""Records for tests that need an evaluation without running a model: built by the same
record classes and the same statistics code (kl_stats.summarise) that evaluate uses, from
synthetic per-token values."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.evaluate import kl_stats
from pipeline.records.benchmarks import Benchmarks, TaskResult
from pipeline.records.checkpoint import QuantizeSummary
from pipeline.records.evaluation import (
    CandidateRef,
    CorpusRef,
    EvalFile,
    EvalReport,
    EvalSettings,
    Metrics,
    ModelRef,
)


def metrics(kl: np.ndarray, seed: int = 0, **override: float) -> Metrics:
    rng = np.random.default_rng(seed)
    n = kl.size
    m = kl_stats.summarise(
        kl, rng.random(n) < 0.8, rng.random(n) * 3, rng.random(n) * 3.1, rng.normal(0, 0.01, n)
    )
    return Metrics(**{**m, **override}, kl_mode="exact")


def eval_report(
    kl_scale: float = 0.2, *, seed: int = 0, n: int = 2000, tasks=None, **over
) -> EvalReport:
    rng = np.random.default_rng(seed)
    kl = rng.lognormal(np.log(kl_scale) - 1.5, 1.5, n)
    return EvalReport(
        reference=ModelRef(path=Path("ref"), model_hash="a" * 64),
        candidate=CandidateRef(path=Path("cand"), model_hash="b" * 64),
        corpus=CorpusRef(heldout_hash="c" * 64, sequences=n // 100, seq_len=101, tokens_scored=n),
        settings=EvalSettings(
            mode="exact",
            topk=None,
            kl_approximation=None,
            kl_dtype="float64",
            batch_size=4,
            device="cpu",
            dtype="auto",
            kv_cache="none",
            weights_only_pass=False,
        ),  # fmt: skip
        metrics=metrics(kl, seed, **over),
        benchmarks=Benchmarks(
            tasks={k: TaskResult.model_validate(v) for k, v in (tasks or {}).items()}
        ),
    )


def eval_file(
    name: str, bits: float, kl_scale: float, verdict, *, seed: int = 0, tasks=None
) -> EvalFile:
    """An eval.json as `qship run` / `qship compare` write it."""
    report = eval_report(kl_scale, seed=seed, tasks=tasks)
    q = QuantizeSummary(name=name, recipe=f"recipes/{name}.yaml", recipe_hash=f"{seed:064x}",
                        bits_per_weight=bits, size_bytes=int(bits * 1e5), seconds=1.5 + seed,
                        peak_mem_bytes=10**9 + seed, peak_mem_kind="process_peak_rss")  # fmt: skip
    return EvalFile.of(report, verdict=verdict, quantize=q)
