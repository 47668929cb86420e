"""Per-token quality statistics of a candidate against a reference distribution.

For every scored position t (the model has seen tokens 0..t and predicts token t+1):

* KL(P_ref || P_cand) = sum_v p_ref(v) * (log p_ref(v) - log p_cand(v)), in float64 from
  log-softmax of the logits, over the full vocabulary (exact mode), or over the
  reference's top-k tokens plus one "tail" bucket holding all other tokens (cached mode,
  see `kl_topk_tail`);
* top-1 agreement: argmax p_ref == argmax p_cand;
* NLL of the actual next token under each model (perplexity = exp(mean NLL));
* Δp = p_cand(next) - p_ref(next), summarised as its RMS (as llama.cpp's
  `llama-perplexity --kl-divergence` reports it).

Everything is computed in chunks of positions so memory stays bounded with a 262k
vocabulary (512 positions x 262,144 x float64 = 1 GiB; the default chunk is 128).
`Accumulator` collects the per-token values and `summarise` turns them into the figures
in eval.json.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

CHUNK = 128  # positions per chunk: 128 x 262,144 x 8 bytes = 256 MiB per float64 tensor
LOG_FLOOR = -1.0e4  # log of a mass that underflowed to 0 (keeps 0 * log 0 finite)
# Fixed log-spaced KL bins: 8 per decade from 1e-6 to 1e2 nats (values below 1e-6,
# including exact zeros, are counted in "zero"; values above 1e2 go to the last bin).
KL_HIST_EDGES: list[float] = [float(x) for x in np.logspace(-6, 2, 8 * 8 + 1)]


def _cat_stats(out: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-chunk statistics joined on the CPU: float64, top-1 agreement as bool."""
    return {
        k: torch.cat(v).cpu() if k == "top1" else torch.cat(v).double().cpu()
        for k, v in out.items()
    }


def _tail_logmass(logp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside `idx`, summed directly (no 1 - x cancellation)."""
    masked = logp.scatter(-1, idx, float("-inf"))
    return torch.logsumexp(masked, -1).clamp(min=LOG_FLOOR)


# ------------------------------------------------------------------ exact (full vocab)


def exact_token_stats(
    ref_logits: torch.Tensor,
    cand_logits: torch.Tensor,
    next_ids: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    chunk: int = CHUNK,
) -> dict[str, torch.Tensor]:
    """Per-position statistics from two [N, V] logit tensors and the [N] next tokens.

    Returns float64/bool CPU tensors: kl, top1 (agreement), nll_ref, nll_cand, dp.
    """
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {cand_logits.shape}")
    out: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("kl", "top1", "nll_ref", "nll_cand", "dp")
    }
    for s in range(0, ref_logits.shape[0], chunk):
        lr = torch.log_softmax(ref_logits[s : s + chunk].to(dtype), dim=-1)
        lc = torch.log_softmax(cand_logits[s : s + chunk].to(dtype), dim=-1)
        nxt = next_ids[s : s + chunk].to(lr.device).long().unsqueeze(-1)
        # xlogy-style: p * (lr - lc), with 0 where p underflows to exactly 0
        pr = lr.exp()
        kl = (pr * (lr - lc)).sum(-1).clamp(min=0.0)
        lr_n = lr.gather(-1, nxt).squeeze(-1)
        lc_n = lc.gather(-1, nxt).squeeze(-1)
        out["kl"].append(kl)
        out["top1"].append(lr.argmax(-1) == lc.argmax(-1))
        out["nll_ref"].append(-lr_n)
        out["nll_cand"].append(-lc_n)
        out["dp"].append(lc_n.exp() - lr_n.exp())
        del lr, lc, pr
    return _cat_stats(out)


def _fused_rows(ref: torch.Tensor, cand: torch.Tensor, nxt: torch.Tensor, dtype: torch.dtype):
    """The exact statistics written as reductions over the raw logits, so that a compiler
    (torch.compile) can fuse each into one read of the two logit tensors:
    KL = sum_v p_ref(v) (r_v - c_v) - lse(r) + lse(c), with p_ref = exp(r - lse(r))."""
    r, c = ref.to(dtype), cand.to(dtype)
    lse_r = torch.logsumexp(r, -1)
    lse_c = torch.logsumexp(c, -1)
    kl = (torch.exp(r - lse_r[:, None]) * (r - c)).sum(-1) - lse_r + lse_c
    lr_n = r.gather(-1, nxt[:, None]).squeeze(-1) - lse_r
    lc_n = c.gather(-1, nxt[:, None]).squeeze(-1) - lse_c
    top1 = r.argmax(-1) == c.argmax(-1)
    return kl.clamp(min=0.0), top1, -lr_n, -lc_n, lc_n.exp() - lr_n.exp()


_COMPILED: dict = {}


def exact_token_stats_fused(
    ref_logits: torch.Tensor,
    cand_logits: torch.Tensor,
    next_ids: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    chunk: int = 1024,
    compile: bool = False,
) -> dict[str, torch.Tensor]:
    """`exact_token_stats` through `_fused_rows` (same figures, float64 arithmetic by
    default); with compile=True the rows go through torch.compile, which fuses the
    reductions so the 262k-wide rows are read, not written, in `dtype` (on an H200 the
    float64 KL then adds 3.9 % to the bare forward passes instead of 57 %; bench/RESULTS.md)."""
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {cand_logits.shape}")
    fn = _fused_rows
    if compile:
        fn = _COMPILED.setdefault("rows", torch.compile(_fused_rows, dynamic=True))
    keys = ("kl", "top1", "nll_ref", "nll_cand", "dp")
    out: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for s in range(0, ref_logits.shape[0], chunk):
        nxt = next_ids[s : s + chunk].to(ref_logits.device).long()
        for k, v in zip(
            keys, fn(ref_logits[s : s + chunk], cand_logits[s : s + chunk], nxt, dtype), strict=True
        ):
            out[k].append(v)
    return _cat_stats(out)


def exact_token_stats_fast(
    ref_logits: torch.Tensor, cand_logits: torch.Tensor, next_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The exact statistics by the fastest path for the logits' device: on CUDA the fused
    form compiled (falling back to it uncompiled when torch.compile cannot run there),
    elsewhere the log-softmax form (no compiler needed on a CPU; same figures)."""
    if not ref_logits.is_cuda:
        return exact_token_stats(ref_logits, cand_logits, next_ids)
    if _COMPILED.get("broken") is None:
        try:
            return exact_token_stats_fused(ref_logits, cand_logits, next_ids, compile=True)
        except Exception as e:  # noqa: BLE001 - e.g. no Triton: the same figures, slower
            _COMPILED["broken"] = f"{type(e).__name__}: {e}"
            print(
                f"note: torch.compile of the KL kernel failed ({_COMPILED['broken'][:200]}); "
                "computing it uncompiled",
                file=sys.stderr,
            )
    return exact_token_stats_fused(ref_logits, cand_logits, next_ids)


# ------------------------------------------------------------ truncated reference (cache)


def reference_topk(
    ref_logits: torch.Tensor,
    next_ids: torch.Tensor,
    k: int,
    *,
    dtype: torch.dtype = torch.float64,
    chunk: int = CHUNK,
) -> dict[str, torch.Tensor]:
    """What the reference cache stores per position (all CPU tensors):

    topk_ids int32 [N,k] (sorted by probability), top1_id int32 [N] (argmax),
    topk_logp float32 [N,k], tail_logp float64 [N] = log(1 - sum of the top-k masses),
    next_logp float64 [N] = log p_ref(actual next token) (its NLL is -next_logp).
    """
    keys = ("topk_ids", "topk_logp", "tail_logp", "next_logp", "top1_id")
    out: dict[str, list[torch.Tensor]] = {k_: [] for k_ in keys}
    k = min(k, ref_logits.shape[-1])
    for s in range(0, ref_logits.shape[0], chunk):
        lr = torch.log_softmax(ref_logits[s : s + chunk].to(dtype), dim=-1)
        nxt = next_ids[s : s + chunk].to(lr.device).long().unsqueeze(-1)
        vals, idx = lr.topk(k, dim=-1, sorted=True)
        out["topk_ids"].append(idx.int().cpu())
        out["topk_logp"].append(vals.float().cpu())
        out["tail_logp"].append(_tail_logmass(lr, idx).double().cpu())
        out["next_logp"].append(lr.gather(-1, nxt).squeeze(-1).double().cpu())
        # argmax, not topk_ids[:, 0]: same tie-breaking as the exact mode (bf16 logits tie)
        out["top1_id"].append(lr.argmax(-1).int().cpu())
        del lr
    return {k_: torch.cat(v) for k_, v in out.items()}


def kl_topk_tail(
    ref: dict[str, torch.Tensor],
    cand_logits: torch.Tensor,
    next_ids: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    chunk: int = CHUNK,
) -> dict[str, torch.Tensor]:
    """Statistics against a stored truncated reference (see `reference_topk`).

    KL is approximated by merging every token outside the reference's top-k into one
    bucket:  sum_{i in top-k} p_i log(p_i/q_i) + P_tail log(P_tail/Q_tail).
    Merging outcomes never increases a KL divergence (log-sum inequality), so this is a
    lower bound of the exact KL; the gap is the KL between the two models' distributions
    *within* the tail, weighted by P_tail. Top-1 agreement, NLLs and Δp are exact.
    """
    out: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("kl", "top1", "nll_ref", "nll_cand", "dp")
    }
    for s in range(0, cand_logits.shape[0], chunk):
        lc = torch.log_softmax(cand_logits[s : s + chunk].to(dtype), dim=-1)
        dev = lc.device
        idx = ref["topk_ids"][s : s + chunk].to(dev).long()
        lp = ref["topk_logp"][s : s + chunk].to(dev).to(dtype)
        tail_p = ref["tail_logp"][s : s + chunk].to(dev).to(dtype)
        lr_n = ref["next_logp"][s : s + chunk].to(dev).to(dtype)
        nxt = next_ids[s : s + chunk].to(dev).long().unsqueeze(-1)
        lq = lc.gather(-1, idx)
        tail_q = _tail_logmass(lc, idx)
        head = (lp.exp() * (lp - lq)).sum(-1)
        tail = torch.where(tail_p > LOG_FLOOR, tail_p.exp() * (tail_p - tail_q), 0.0)
        lc_n = lc.gather(-1, nxt).squeeze(-1)
        out["kl"].append((head + tail).clamp(min=0.0))
        out["top1"].append(lc.argmax(-1) == ref["top1_id"][s : s + chunk].to(dev).long())
        out["nll_ref"].append(-lr_n)
        out["nll_cand"].append(-lc_n)
        out["dp"].append(lc_n.exp() - lr_n.exp())
        del lc
    return _cat_stats(out)


# ------------------------------------------------------------------ summary statistics


@dataclass
class Accumulator:
    """Collects per-token values (CPU) across batches; `summary()` gives the figures."""

    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        for k, v in stats.items():
            self.parts.setdefault(k, []).append(v.detach().cpu())

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: torch.cat(v).numpy() for k, v in self.parts.items()}

    def summary(self) -> dict:
        return summarise(**self.arrays())


def kl_histogram(values) -> dict:
    """Per-token KL values -> counts on KL_HIST_EDGES (a fixed binning, so rows compare)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    edges = np.asarray(KL_HIST_EDGES)
    zero = int((v < edges[0]).sum())
    pos = np.minimum(v[v >= edges[0]], edges[-1])
    counts, _ = np.histogram(pos, bins=edges)
    return {"edges": KL_HIST_EDGES, "counts": [int(c) for c in counts], "zero": zero}


def summarise(kl, top1, nll_ref, nll_cand, dp) -> dict:
    """The eval.json figures from per-token arrays (numpy, float64)."""
    kl = np.asarray(kl, dtype=np.float64)
    n = int(kl.size)
    if n == 0:
        raise ValueError("no tokens were scored")
    nll_ref = np.asarray(nll_ref, dtype=np.float64)
    nll_cand = np.asarray(nll_cand, dtype=np.float64)
    dp = np.asarray(dp, dtype=np.float64)
    top1 = np.asarray(top1, dtype=np.float64)
    q = np.percentile(kl, [50, 90, 99, 99.9])
    ppl_ref = float(np.exp(nll_ref.mean()))
    ppl_cand = float(np.exp(nll_cand.mean()))
    sd = float(kl.std(ddof=1)) if n > 1 else 0.0
    return {
        "tokens": n,
        "kl": {
            "mean": float(kl.mean()),
            "stderr": sd / math.sqrt(n),
            "median": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
            "p999": float(q[3]),
            "max": float(kl.max()),
        },
        "top1_agreement": float(top1.mean()),
        "top1_agreement_stderr": float(np.sqrt(top1.mean() * (1 - top1.mean()) / n)),
        "ppl_reference": ppl_ref,
        "ppl_candidate": ppl_cand,
        "ppl_ratio": ppl_cand / ppl_ref,
        # ln(ppl ratio) = mean NLL difference; its stderr comes from the paired differences
        "ln_ppl_ratio_stderr": float((nll_cand - nll_ref).std(ddof=1) / math.sqrt(n))
        if n > 1
        else 0.0,
        "rms_dp": float(np.sqrt(np.mean(dp**2))),
        "mean_dp": float(dp.mean()),
        # the per-token distribution, for compare's plot without another candidate pass
        "kl_hist": kl_histogram(kl),
    }
