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
    tasks, hub_tasks, dtype, exact, topk = o.tasks, o.hub_tasks, o.dtype, o.exact, o.topk
    batch_size, attention, offload = o.batch_size, o.attention, o.offload
    if heldout_ids.ndim != 2 or heldout_ids.shape[1] < 2:
        raise UsageError(
            f"held-out ids must be [sequences, seq_len>=2], got {tuple(heldout_ids.shape)}"
        )
    ids = heldout_ids.long().cpu()
    scheme = kv_scheme(candidate.path)
    do_kv_off = o.kv_off and scheme is not None
    # layers served with a 16-bit KV cache (the recipe's kv_cache.skip_layers)
    skip = o.kv_skip_layers if o.kv_skip_layers is not None else kv_skip_layers(candidate.path)
    timings: dict[str, float] = {}

    def load(p: Path) -> Any:
        return load_model(
            p, device=device, dtype=dtype, offload="none" if offload == "none" else "cpu"
        )

    def load_candidate() -> tuple[Any, int]:
        """The candidate computing as served: vLLM's Linear numerics, the 16-bit KV layers.
        -> (model, Linears changed)."""
        m = load(candidate.path)
        n = serve_linears(m)
        skip_kv_layers(m, skip)
        return m, n

    t_all = time.perf_counter()
    ref_entry = None
    measured = None
    greedy: GreedyAgreement | None = None
    if exact:
        t0 = time.perf_counter()
        ref_model, (cand_model, n_linear) = load(reference.path), load_candidate()
        timings["load_s"] = time.perf_counter() - t0
        hooked = kv_modules(cand_model)
        n_hooked = len(hooked)
        t0 = time.perf_counter()
        with served_attention(cand_model, attention, hooked):
            on, off = _lockstep(ref_model, cand_model, ids, batch_size, do_kv_off)
            if o.greedy_prompts:
                prompts = greedy_mod.prompts(ids, o.greedy_prompts)
                ref_cont = greedy_mod.continue_greedily(ref_model, prompts, o.greedy_tokens,
                                                        batch_size)  # fmt: skip
                greedy = _greedy(cand_model, prompts, ref_cont, False, o, timings)
        sync(device)
        timings["lockstep_s"] = time.perf_counter() - t0
        del ref_model, cand_model
    else:
        t0 = time.perf_counter()
        ref_entry = reference_cache.get_or_build(
            cache_dir, reference, ids, topk=topk, forward=forward_logits, load_model=load,
            batch_size=batch_size, dtype=dtype or "auto", device=device,
        )  # fmt: skip
        timings["reference_s"] = time.perf_counter() - t0
        ref = ref_entry.load()
        if o.greedy_prompts:  # the reference's continuations: cached beside its log-probs
            t0 = time.perf_counter()
            prompts = greedy_mod.prompts(ids, o.greedy_prompts)
            ref_cont, ref_hit = greedy_mod.reference_continuations(
                cache_dir, reference.model_hash, prompts, tokens=o.greedy_tokens,
                dtype=dtype or "auto", device=device, batch_size=batch_size,
                load=lambda: load(reference.path),
            )  # fmt: skip
            timings["reference_greedy_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        cand_model, n_linear = load_candidate()
        timings["load_s"] = time.perf_counter() - t0
        hooked = kv_modules(cand_model)
        n_hooked = len(hooked)
        t0 = time.perf_counter()
        passes = {"on": True, "off": False} if do_kv_off else {"on": True}
        capture = (Capture(min(o.measured_topk, topk)) if measured_path and o.measured_topk
                   else None)  # fmt: skip
        with served_attention(cand_model, attention, hooked):
            spent: dict[str, float] = {}
            scored = score_against_reference(cand_model, ids, ref, batch_size, passes,
                                             "candidate", capture=capture, timings=spent)  # fmt: skip
            timings.update({f"candidate_{k}": v for k, v in spent.items()})
            if o.greedy_prompts:
                greedy = _greedy(cand_model, prompts, ref_cont, ref_hit, o, timings)
        if capture is not None and measured_path is not None:
            measured = capture.save(measured_path, ids, attention if n_hooked else "kv-only")
        on, off = scored["on"], scored.get("off")
        sync(device)
        timings["candidate_s"] = time.perf_counter() - t0
        del cand_model
    if scheme is not None and n_hooked == 0 and not skip:  # (every layer 16-bit: none left)
        raise StageError(
            "candidate config has a kv_cache_scheme but no attention module carries the "
            "compressed-tensors KV hook after loading: the FP8 KV cache would not be in the loop",
            path=str(candidate.path / "config.json"),
            hint="check the transformers / compressed-tensors versions against constraints.txt",
        )
    numerics = attention if (scheme is not None and n_hooked) else "no fp8 kv cache"
    mode = "exact" if exact else f"cached-top{topk}+tail"
    metrics = Metrics(**on.summary(), kl_mode=mode)
    metrics_off = Metrics(**off.summary(), kl_mode=mode) if do_kv_off and off else None

    benchmarks = Benchmarks()
    if tasks or hub_tasks or custom_dir:
        from . import benchmarks as bm

        t0 = time.perf_counter()
        benchmarks = bm.compare(
            reference, candidate.path, tasks=list(tasks), hub_tasks=list(hub_tasks),
            data_dir=data_dir, limit=o.limit, cache_dir=cache_dir, device=device, dtype=dtype,
            batch_size=o.task_batch_size, offload=offload, code_execution=o.code_execution,
            custom_dir=custom_dir,
        )  # fmt: skip
        timings["benchmarks_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_all
    return EvalReport(
        reference=reference,
        candidate=CandidateRef(
            path=candidate.path,
            model_hash=candidate.model_hash,
            kv_cache_scheme=scheme,
            kv_hooked_attention_modules=n_hooked,
            served_linear_modules=n_linear,
        ),
        corpus=CorpusRef(
            source=corpus.source if corpus else None,
            corpus_hash=corpus.corpus_hash if corpus else None,
            heldout_hash=tensor_hash(ids),
            sequences=int(ids.shape[0]),
            seq_len=int(ids.shape[1]),
            tokens_scored=int(ids.shape[0] * (ids.shape[1] - 1)),
        ),
        settings=EvalSettings(
            mode=mode,
            topk=None if exact else topk,
            kl_approximation=None
            if exact
            else (
                f"reference stored as its top-{topk} log-probs + one bucket for the rest; "
                "KL = sum_topk p log(p/q) + P_tail log(P_tail/Q_tail), a lower bound of the "
                "full-vocabulary KL (log-sum inequality); top-1, ppl and dp are exact"
            ),
            kl_dtype="float64",
            batch_size=batch_size,
            device=device,
            dtype=dtype or "auto",
            kv_cache="on (as deployed)" if scheme else "none in candidate",
            kv_16bit_layers=list(skip),
            attention=numerics,
            weights_only_pass=do_kv_off,
            served_numerics=SERVED_NUMERICS if (n_linear or n_hooked) else None,
        ),  # fmt: skip
        metrics=metrics,
        metrics_weights_only=metrics_off,
        kv_cache_share=_kv_share(metrics, metrics_off),
        reference_cache=ref_entry.info() if ref_entry else None,
        benchmarks=benchmarks,
        overlap=overlap,
        measured=measured,
        greedy=greedy,
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
