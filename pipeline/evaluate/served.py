"""The served-artifact check: the artifact as an inference engine serves it, against the
model evaluate measured.

At evaluate time `Capture` stores, for every scored held-out position, the candidate's
top-k log-probs, the reference's top-k log-probs and the candidate's log-probs at the
reference's top-k tokens (k = evaluation.measured_topk), with the held-out ids: the
artifact carries them as `qship/measured.safetensors` (outside the top level, so that no
engine takes it for weights). `check` feeds the same ids to an engine (engines.py), asks
it for its log-probs at the stored tokens, and reports

    served vs measured   KL(measured candidate ‖ served), top-1 agreement
    served vs reference  KL(reference ‖ served) -- the quality actually served
    measured vs ref.     KL(reference ‖ measured) at the same top-k -- what eval.json claims

every KL over P's top-k + one bucket for the rest (a lower bound of the full KL, the same
for all three). The logic is engine-neutral: transformers (CPU, CI) or vLLM (GPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from .. import log
from ..errors import IntegrityError
from ..io.hashing import sha256_file
from ..recipe import ServeGate
from ..records.served import KLFigures, MeasuredInfo, ServedCheck
from .kl_stats import CHUNK, LOG_FLOOR, _tail_logmass

FILE = "measured.safetensors"
ARTIFACT_PATH = f"qship/{FILE}"


class Capture:
    """Collects the measured log-probs batch by batch (see the module docstring)."""

    def __init__(self, k: int):
        self.k = k
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, ref: dict[str, torch.Tensor], cand_logits: torch.Tensor) -> None:
        k = self.k
        for s in range(0, cand_logits.shape[0], CHUNK):
            lc = torch.log_softmax(cand_logits[s : s + CHUNK].double(), dim=-1)
            ref_ids = ref["topk_ids"][s : s + CHUNK, :k].to(lc.device).long()
            ref_lp = ref["topk_logp"][s : s + CHUNK, :k].to(lc.device).double()
            top_lp, top_ids = lc.topk(k, dim=-1)
            at_ref = lc.gather(-1, ref_ids)
            rows = {
                "cand_ids": top_ids.int(),
                "cand_logp": top_lp.float(),
                "cand_tail": _tail_logmass(lc, top_ids).float(),
                "ref_ids": ref_ids.int(),
                "ref_logp": ref_lp.float(),
                "ref_tail": _log1m_sumexp(ref_lp).float(),
                "cand_at_ref": at_ref.float(),
                "cand_at_ref_tail": _tail_logmass(lc, ref_ids).float(),
            }
            for name, t in rows.items():
                self.parts.setdefault(name, []).append(t.cpu())

    def save(self, path: Path, ids: torch.Tensor, attention: str) -> MeasuredInfo:
        tensors = {n: torch.cat(v).contiguous() for n, v in self.parts.items()}
        tensors["ids"] = ids.int().contiguous()
        meta = {"format": "qship-measured-v1", "topk": str(self.k), "attention": attention}
        save_file(tensors, str(path), metadata=meta)
        return MeasuredInfo(file=str(path), sha256=sha256_file(path).sha256, topk=self.k,
                            sequences=int(ids.shape[0]), seq_len=int(ids.shape[1]),
                            attention=attention)  # fmt: skip


def _log1m_sumexp(lp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(lp))) over the last dim: the mass outside the listed tokens."""
    total = torch.logsumexp(lp.double(), -1).clamp(max=0.0)
    return torch.log(-torch.expm1(total)).clamp(min=LOG_FLOOR)


def load_measured(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    if not Path(path).is_file():
        raise IntegrityError(
            "no measured log-probs to compare with",
            path=str(path),
            hint="package the artifact with qship >= this version (evaluation.measured_topk > 0)",
        )
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "qship-measured-v1":
        raise IntegrityError(f"not a qship measured file (format {meta.get('format')!r})",
                             path=str(path))  # fmt: skip
    return load_file(str(path)), meta


class Engine(Protocol):
    name: str
    facts: dict[str, str]

    def logprobs_at(
        self, ids: torch.Tensor, want: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For ids [S, L] and wanted token ids [S*(L-1), m] (row = position predicting
        ids[:, 1:]): (log-probs at them [S*(L-1), m] float64, argmax [S*(L-1)], how many
        wanted ids it could not give exactly)."""
        ...


def _kl(p_lp: torch.Tensor, p_tail: torch.Tensor, q_lp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P ‖ Q) over P's listed tokens + one tail bucket."""
    p_lp, q_lp, p_tail = p_lp.double(), q_lp.double(), p_tail.double()
    q_tail = _log1m_sumexp(q_lp)
    head = (p_lp.exp() * (p_lp - q_lp)).sum(-1)
    tail = torch.where(p_tail > LOG_FLOOR, p_tail.exp() * (p_tail - q_tail), 0.0)
    return (head + tail).clamp(min=0.0)


def _figures(kl: torch.Tensor, top1: torch.Tensor) -> KLFigures:
    return KLFigures(kl_mean=float(kl.mean()), kl_p99=float(torch.quantile(kl.float(), 0.99)),
                     top1=float(top1.double().mean()))  # fmt: skip


def check(
    engine: Engine,
    measured: dict[str, torch.Tensor],
    *,
    kv_cache_dtype: str,
    max_kl: float,
    min_top1: float,
    max_kl_increase: float,
    load_s: float = 0.0,
) -> ServedCheck:
    k = measured["cand_ids"].shape[1]
    want = torch.cat([measured["cand_ids"], measured["ref_ids"]], dim=1).long()
    t0 = time.perf_counter()
    served, served_top1, missing = engine.logprobs_at(measured["ids"].long(), want)
    score_s = time.perf_counter() - t0
    if "load_s" in engine.facts:  # an engine in a child process loads inside logprobs_at
        load_s = float(engine.facts["load_s"])
        score_s -= load_s
    at_cand, at_ref = served[:, :k], served[:, k:]
    vs_meas = _figures(_kl(measured["cand_logp"], measured["cand_tail"], at_cand),
                       served_top1 == measured["cand_ids"][:, 0].long())  # fmt: skip
    ref_top1 = measured["ref_ids"][:, 0].long()
    vs_ref = _figures(_kl(measured["ref_logp"], measured["ref_tail"], at_ref),
                      served_top1 == ref_top1)  # fmt: skip
    meas_ref = _figures(_kl(measured["ref_logp"], measured["ref_tail"], measured["cand_at_ref"]),
                        measured["cand_ids"][:, 0].long() == ref_top1)  # fmt: skip
    increase = vs_ref.kl_mean / meas_ref.kl_mean - 1 if meas_ref.kl_mean > 0 else 0.0
    failures = []
    if vs_meas.kl_mean > max_kl:
        failures.append(f"served vs measured KL {vs_meas.kl_mean:.4g} > max_kl {max_kl:g}")
    if vs_meas.top1 < min_top1:
        failures.append(f"served vs measured top-1 {vs_meas.top1:.4f} < min_top1 {min_top1:g}")
    if increase > max_kl_increase:
        failures.append(f"served KL to the reference is {increase:+.1%} of the measured "
                        f"(> max_kl_increase {max_kl_increase:.0%})")  # fmt: skip
    return ServedCheck(
        engine=engine.name, kv_cache_dtype=kv_cache_dtype, served_vs_measured=vs_meas,
        served_vs_reference=vs_ref, measured_vs_reference=meas_ref, served_kl_increase=increase,
        missing=missing, positions=int(want.shape[0]), passed=not failures,
        thresholds={"max_kl": max_kl, "min_top1": min_top1, "max_kl_increase": max_kl_increase},
        failures=failures, seconds={"load": round(load_s, 2), "score": round(score_s, 2)},
        facts=dict(engine.facts),
    )  # fmt: skip


def run_check(
    model_dir: Path, measured_path: Path, gate: ServeGate, *, device: str | None = None,
    **engine_opts: Any,
) -> ServedCheck:  # fmt: skip
    """Load `model_dir` in the gate's engine and compare it with the measured file."""
    from . import engines

    measured, meta = load_measured(measured_path)
    t0 = time.perf_counter()
    with log.heartbeat(f"served check ({gate.engine})"):
        eng = engines.make(gate.engine, Path(model_dir), kv_cache_dtype=gate.kv_cache_dtype,
                           device=device, attention=meta.get("attention", "kv-only"),
                           max_len=int(measured["ids"].shape[1]), **engine_opts)  # fmt: skip
        load_s = time.perf_counter() - t0
        return check(eng, measured, kv_cache_dtype=gate.kv_cache_dtype, max_kl=gate.max_kl,
                     min_top1=gate.min_top1, max_kl_increase=gate.max_kl_increase,
                     load_s=load_s)  # fmt: skip
