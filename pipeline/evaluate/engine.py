"""evaluate: a quantized candidate against its unquantized reference, on held-out tokens.

On held-out token sequences (never calibration data: pipeline.data.tokens) every position's
next-token distribution of the candidate is compared with the reference's: KL(ref||cand)
mean ± stderr, median, p90, p99, p99.9, max; top-1 agreement; perplexity of both and their
ratio; RMS of Δp(next token) -- the figures of llama.cpp's `llama-perplexity
--kl-divergence` (kl_stats.py has the definitions).

Two modes:
* cached (default): the reference pass runs once per (reference identity, held-out ids,
  top-k, dtype) and stores top-k log-probs + one tail bucket (reference_cache.py); the
  reference model is freed before the candidate loads, and N candidates cost one
  reference pass. KL is then a lower bound (log-sum inequality); top-1, ppl, Δp exact.
* exact: reference and candidate run in lockstep and KL is summed over the full
  vocabulary in float64.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..data.tokens import tensor_hash
from ..errors import StageError, UsageError
from ..model.devices import default_device
from ..model.files import hash_model_dir
from ..model.loading import load_model
from ..records.benchmarks import Benchmarks, Overlap
from ..records.checkpoint import kv_skip_layers
from ..records.evaluation import (
    CandidateRef,
    CorpusRef,
    EvalOptions,
    EvalReport,
    EvalSettings,
    GreedyAgreement,
    KVShare,
    Metrics,
    ModelRef,
)
from ..records.tokens import TokenSetInfo
from . import greedy as greedy_mod
from . import kl_stats, reference_cache
from .numerics import SERVED_NUMERICS, serve_linears, served_attention
from .scoring import (
    forward_logits,
    kv_modules,
    kv_quantization,
    kv_scheme,
    score_against_reference,
    skip_kv_layers,
    sync,
)
from .served import Capture


def model_ref(path: Path) -> ModelRef:
    """A folder no stage recorded: its identity is hashed here (model files only)."""
    return ModelRef(path=Path(path), model_hash=hash_model_dir(Path(path))[1])


@dataclass
class _Loader:
    """Loads both models as evaluate runs them: on `device`, in `dtype`, offloaded to host
    memory when asked (disk is host memory here too)."""

    device: str
    dtype: str | None
    offload: str
    skip: tuple[int, ...]

    def load(self, p: Path) -> Any:
        offload = "none" if self.offload == "none" else "cpu"
        return load_model(p, device=self.device, dtype=self.dtype, offload=offload)

    def candidate(self, p: Path) -> tuple[Any, int]:
        """The candidate computing as served: vLLM's Linear numerics, the 16-bit KV layers.
        -> (model, Linears changed)."""
        m = self.load(p)
        n = serve_linears(m)
        skip_kv_layers(m, self.skip)
        return m, n


@dataclass
class _Scored:
    """What the scoring passes hand to the report."""

    on: kl_stats.Accumulator
    off: kl_stats.Accumulator | None
    n_linear: int
    n_hooked: int
    timings: dict[str, float]
    ref_entry: Any = None
    measured: Any = None
    greedy: GreedyAgreement | None = None


def evaluate(
    reference: ModelRef,
    candidate: ModelRef,
    *,
    heldout_ids: torch.Tensor,
    cache_dir: Path,
    options: EvalOptions | None = None,
    data_dir: Path | None = None,
    overlap: Overlap | None = None,
    corpus: TokenSetInfo | None = None,
    measured_path: Path | None = None,
    custom_dir: Path | None = None,
) -> EvalReport:
    """Compare candidate with reference on `heldout_ids` [sequences, seq_len], as `options`
    say. `options.attention`: the serving engine's attention numerics to simulate with an FP8
    KV cache (numerics.py); `measured_path`: where to store the measured top-k log-probs for
    the served check (served.py; cached mode only). `options.offload` cpu / disk: models that
    do not fit the GPU are evaluated with their weights in host memory, onloaded module by
    module (model/loading.py; disk is host memory here too: a packed checkpoint does not
    survive accelerate's disk offload); lm-eval places them with its own `parallelize`.
    `data_dir`: the pinned benchmark data; `overlap`: its overlap with calibration;
    `corpus`: where the held-out tokens came from (recorded); `custom_dir`: the checked
    custom tasks (data/custom_tasks.py)."""
    o = options or EvalOptions()
    device = o.device or default_device()
    if heldout_ids.ndim != 2 or heldout_ids.shape[1] < 2:
        raise UsageError(
            f"held-out ids must be [sequences, seq_len>=2], got {tuple(heldout_ids.shape)}"
        )
    ids = heldout_ids.long().cpu()
    scheme = kv_scheme(candidate.path)
    do_kv_off = o.kv_off and scheme is not None
    # layers served with a 16-bit KV cache (the recipe's kv_cache.skip_layers)
    skip = o.kv_skip_layers if o.kv_skip_layers is not None else kv_skip_layers(candidate.path)
    loader = _Loader(device, o.dtype, o.offload, skip)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    if o.exact:
        scored = _score_exact(reference, candidate, ids, o, loader, do_kv_off)
    else:
        scored = _score_cached(reference, candidate, ids, o, loader, do_kv_off,
                               cache_dir=cache_dir, measured_path=measured_path)  # fmt: skip
    if scheme is not None and scored.n_hooked == 0 and not skip:  # (every layer 16-bit: none left)
        raise StageError(
            "candidate config has a kv_cache_scheme but no attention module carries the "
            "compressed-tensors KV hook after loading: the FP8 KV cache would not be in the loop",
            path=str(candidate.path / "config.json"),
            hint="check the transformers / compressed-tensors versions against constraints.txt",
        )
    timings.update(scored.timings)
    mode = "exact" if o.exact else f"cached-top{o.topk}+tail"
    metrics = Metrics(**scored.on.summary(), kl_mode=mode)
    off = scored.off
    metrics_off = Metrics(**off.summary(), kl_mode=mode) if do_kv_off and off else None
    benchmarks = _benchmarks(reference, candidate, o, device, data_dir, cache_dir, timings,
                             custom_dir)  # fmt: skip
    timings["total_s"] = time.perf_counter() - t_all
    return EvalReport(
        reference=reference,
        candidate=CandidateRef(
            path=candidate.path,
            model_hash=candidate.model_hash,
            kv_cache_scheme=scheme,
            kv_hooked_attention_modules=scored.n_hooked,
            served_linear_modules=scored.n_linear,
        ),
        corpus=_corpus_ref(ids, corpus),
        settings=_settings(o, device, scheme, skip, scored, weights_only_pass=do_kv_off),
        metrics=metrics,
        metrics_weights_only=metrics_off,
        kv_cache_share=_kv_share(metrics, metrics_off),
        reference_cache=scored.ref_entry.info() if scored.ref_entry else None,
        benchmarks=benchmarks,
        overlap=overlap,
        measured=scored.measured,
        greedy=scored.greedy,
        timings={k: round(v, 3) for k, v in timings.items()},
    )


def _greedy(
    cand_model: Any, prompts: torch.Tensor, ref_cont: torch.Tensor, ref_hit: bool,
    o: EvalOptions, timings: dict[str, float],
) -> GreedyAgreement:  # fmt: skip
    """The candidate's greedy continuations (as served) against the reference's."""
    t0 = time.perf_counter()
    with kv_quantization(cand_model, True):
        cont = greedy_mod.continue_greedily(cand_model, prompts, o.greedy_tokens, o.batch_size)
    timings["candidate_greedy_s"] = time.perf_counter() - t0
    agreed = greedy_mod.agreement(ref_cont, cont)
    return agreed.model_copy(update={"reference_cached": ref_hit})


def _score_exact(
    reference: ModelRef, candidate: ModelRef, ids: torch.Tensor, o: EvalOptions,
    loader: _Loader, kv_off: bool,
) -> _Scored:  # fmt: skip
    """Exact mode: both models loaded, run in lockstep over the full vocabulary."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ref_model, (cand_model, n_linear) = (
        loader.load(reference.path),
        loader.candidate(candidate.path),
    )
    timings["load_s"] = time.perf_counter() - t0
    hooked = kv_modules(cand_model)
    t0 = time.perf_counter()
    greedy = None
    with served_attention(cand_model, o.attention, hooked):
        on, off = _lockstep(ref_model, cand_model, ids, o.batch_size, kv_off)
        if o.greedy_prompts:
            prompts = greedy_mod.prompts(ids, o.greedy_prompts)
            ref_cont = greedy_mod.continue_greedily(ref_model, prompts, o.greedy_tokens,
                                                    o.batch_size)  # fmt: skip
            greedy = _greedy(cand_model, prompts, ref_cont, False, o, timings)
    sync(loader.device)
    timings["lockstep_s"] = time.perf_counter() - t0
    del ref_model, cand_model
    return _Scored(on, off, n_linear, len(hooked), timings, greedy=greedy)


def _score_cached(
    reference: ModelRef, candidate: ModelRef, ids: torch.Tensor, o: EvalOptions,
    loader: _Loader, kv_off: bool, *, cache_dir: Path, measured_path: Path | None,
) -> _Scored:  # fmt: skip
    """Cached mode: the reference's top-k log-probs from the cache (built once, its model
    freed), then the candidate scored against them; its top-k kept for the served check."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    run = reference_cache.ReferencePass(forward_logits, loader.load, o.batch_size, loader.device)
    ref_entry = reference_cache.get_or_build(
        cache_dir, reference, ids, topk=o.topk, dtype=o.dtype or "auto", run=run
    )
    timings["reference_s"] = time.perf_counter() - t0
    ref = ref_entry.load()
    if o.greedy_prompts:  # the reference's continuations: cached beside its log-probs
        t0 = time.perf_counter()
        prompts = greedy_mod.prompts(ids, o.greedy_prompts)
        ref_cont, ref_hit = greedy_mod.reference_continuations(
            cache_dir, reference.model_hash, prompts, tokens=o.greedy_tokens,
            dtype=o.dtype or "auto", device=loader.device, batch_size=o.batch_size,
            load=lambda: loader.load(reference.path),
        )  # fmt: skip
        timings["reference_greedy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cand_model, n_linear = loader.candidate(candidate.path)
    timings["load_s"] = time.perf_counter() - t0
    hooked = kv_modules(cand_model)
    t0 = time.perf_counter()
    passes = {"on": True, "off": False} if kv_off else {"on": True}
    capture = (Capture(min(o.measured_topk, o.topk)) if measured_path and o.measured_topk
               else None)  # fmt: skip
    with served_attention(cand_model, o.attention, hooked):
        spent: dict[str, float] = {}
        scored = score_against_reference(cand_model, ids, ref, o.batch_size, passes,
                                         "candidate", capture=capture, timings=spent)  # fmt: skip
        timings.update({f"candidate_{k}": v for k, v in spent.items()})
        greedy = (_greedy(cand_model, prompts, ref_cont, ref_hit, o, timings)
                  if o.greedy_prompts else None)  # fmt: skip
    measured = None
    if capture is not None and measured_path is not None:
        measured = capture.save(measured_path, ids, o.attention if hooked else "kv-only")
    sync(loader.device)
    timings["candidate_s"] = time.perf_counter() - t0
    del cand_model
    on, off = scored["on"], scored.get("off")
    return _Scored(on, off, n_linear, len(hooked), timings, ref_entry, measured, greedy)


def _benchmarks(
    reference: ModelRef, candidate: ModelRef, o: EvalOptions, device: str,
    data_dir: Path | None, cache_dir: Path, timings: dict[str, float],
    custom_dir: Path | None,
) -> Benchmarks:  # fmt: skip
    """The lm-eval tasks on both models (none asked: an empty record)."""
    if not (o.tasks or o.hub_tasks or custom_dir):
        return Benchmarks()
    from . import benchmarks as bm

    t0 = time.perf_counter()
    res = bm.compare(
        reference, candidate.path, tasks=list(o.tasks), hub_tasks=list(o.hub_tasks),
        data_dir=data_dir, limit=o.limit, cache_dir=cache_dir, device=device, dtype=o.dtype,
        batch_size=o.task_batch_size, offload=o.offload, code_execution=o.code_execution,
        custom_dir=custom_dir,
    )  # fmt: skip
    timings["benchmarks_s"] = time.perf_counter() - t0
    return res


def _corpus_ref(ids: torch.Tensor, corpus: TokenSetInfo | None) -> CorpusRef:
    return CorpusRef(
        source=corpus.source if corpus else None,
        corpus_hash=corpus.corpus_hash if corpus else None,
        heldout_hash=tensor_hash(ids),
        sequences=int(ids.shape[0]),
        seq_len=int(ids.shape[1]),
        tokens_scored=int(ids.shape[0] * (ids.shape[1] - 1)),
    )


def _settings(
    o: EvalOptions, device: str, scheme: Any, skip: Any, scored: _Scored, *,
    weights_only_pass: bool,
) -> EvalSettings:  # fmt: skip
    """What evaluate reports having used."""
    exact, topk = o.exact, o.topk
    n_hooked = scored.n_hooked
    return EvalSettings(
        mode="exact" if exact else f"cached-top{topk}+tail",
        topk=None if exact else topk,
        kl_approximation=None
        if exact
        else (
            f"reference stored as its top-{topk} log-probs + one bucket for the rest; "
            "KL = sum_topk p log(p/q) + P_tail log(P_tail/Q_tail), a lower bound of the "
            "full-vocabulary KL (log-sum inequality); top-1, ppl and dp are exact"
        ),
        kl_dtype="float64",
        batch_size=o.batch_size,
        device=device,
        dtype=o.dtype or "auto",
        kv_cache="on (as deployed)" if scheme else "none in candidate",
        kv_16bit_layers=list(skip),
        attention=o.attention if (scheme is not None and n_hooked) else "no fp8 kv cache",
        weights_only_pass=weights_only_pass,
        served_numerics=SERVED_NUMERICS if (scored.n_linear or n_hooked) else None,
    )  # fmt: skip


def _lockstep(
    ref_model: Any, cand_model: Any, ids: torch.Tensor, batch_size: int, kv_off: bool
) -> tuple[kl_stats.Accumulator, kl_stats.Accumulator | None]:
    """Exact mode: both models on each batch, KL over the full vocabulary."""
    on = kl_stats.Accumulator()
    off = kl_stats.Accumulator() if kv_off else None
    n = ids.shape[0]
    with log.Progress("exact", n, unit="sequences") as bar:
        for s in range(0, n, batch_size):
            batch = ids[s : s + batch_size]
            rl, nxt = forward_logits(ref_model, batch)
            with kv_quantization(cand_model, True):
                cl, _ = forward_logits(cand_model, batch)
            on.add(kl_stats.exact_token_stats_fast(rl, cl, nxt))
            del cl
            if off is not None:
                with kv_quantization(cand_model, False):
                    cl, _ = forward_logits(cand_model, batch)
                off.add(kl_stats.exact_token_stats_fast(rl, cl, nxt))
                del cl
            del rl
            bar.update(s + batch.shape[0])
    return on, off


def _kv_share(on: Metrics, off: Metrics | None) -> KVShare | None:
    if off is None:
        return None
    a, b = on.kl.mean, off.kl.mean
    return KVShare(
        kl_mean_kv_on=a,
        kl_mean_kv_off=b,
        kl_mean_added_by_kv=a - b,
        fraction_of_kl_from_kv=(a - b) / a if a > 0 else 0.0,
    )
