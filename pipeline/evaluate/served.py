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

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from .. import log
from ..errors import IntegrityError, UsageError
from ..io.hashing import sha256_file
from ..model.checkpoint import text_config
from ..recipe import ServeGate
from ..records.evaluation import EvalReport, KVShare
from ..records.served import KLFigures, MeasuredInfo, ServedCheck
from .kl_stats import CHUNK, LOG_FLOOR, _tail_logmass
from .scoring import kv_scheme, quantizes_activations

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
        # one metadata key: safetensors writes a map's keys in a per-process order, and two
        # identical evaluations must write identical bytes
        meta = {FORMAT: json.dumps({"topk": self.k, "attention": attention}, sort_keys=True)}
        save_file(tensors, str(path), metadata=meta)
        return MeasuredInfo(file=str(path), sha256=sha256_file(path).sha256, topk=self.k,
                            sequences=int(ids.shape[0]), seq_len=int(ids.shape[1]),
                            attention=attention)  # fmt: skip


def _log1m_sumexp(lp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(lp))) over the last dim: the mass outside the listed tokens."""
    total = torch.logsumexp(lp.double(), -1).clamp(max=0.0)
    return torch.log(-torch.expm1(total)).clamp(min=LOG_FLOOR)


FORMAT = "qship-measured-v1"
_FLOATS = ("cand_logp", "cand_tail", "ref_logp", "ref_tail", "cand_at_ref", "cand_at_ref_tail")
_IDS = ("cand_ids", "ref_ids")


def load_measured(
    path: Path, *, sha256: str | None = None, vocab_size: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The measured file, checked before anything is compared with it: the sha256 eval.json
    recorded (when given), its format, every tensor present, non-empty, finite and of the
    shapes the held-out ids imply, token ids inside the vocabulary. Any failure: exit 3."""
    from safetensors import safe_open

    path = Path(path)
    hint = ("do not deploy: the measured file is not what evaluate wrote (a corrupted or "
            "altered artifact); re-run qship run")  # fmt: skip

    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"measured log-probs {why}", path=str(path), hint=hint)

    if not path.is_file():
        raise IntegrityError(
            "no measured log-probs to compare with",
            path=str(path),
            hint="package the artifact with qship >= this version (evaluation.measured_topk > 0)",
        )
    if sha256 is not None and (got := sha256_file(path).sha256) != sha256:
        raise bad(f"do not match the sha256 eval.json records ({got[:16]}… vs {sha256[:16]}…)")
    try:
        with safe_open(str(path), "pt") as f:
            raw = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same failure
        raise bad(f"are not a readable safetensors file ({type(e).__name__}: {e})") from e
    if FORMAT in raw:
        meta = {k: str(v) for k, v in json.loads(raw[FORMAT]).items()}
    elif raw.get("format") == FORMAT:  # written by qship before the one-key metadata
        meta = dict(raw)
    else:
        raise bad(f"are not a qship measured file (metadata {sorted(raw)})")
    missing = [n for n in ("ids", *_IDS, *_FLOATS) if n not in tensors]
    if missing:
        raise bad(f"lack {missing}")
    ids = tensors["ids"]
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise bad(f"hold held-out ids of shape {tuple(ids.shape)} (empty or not [S, L>=2])")
    rows = ids.shape[0] * (ids.shape[1] - 1)
    for n in (*_IDS, *_FLOATS):
        if tensors[n].shape[0] != rows:
            raise bad(f"{n} has {tensors[n].shape[0]} rows, the held-out ids imply {rows}")
        if n in _FLOATS and not bool(torch.isfinite(tensors[n]).all()):
            raise bad(f"{n} holds non-finite values (NaN or inf)")
    if vocab_size is not None:
        top = max(int(tensors[n].max()) for n in ("ids", *_IDS))
        low = min(int(tensors[n].min()) for n in ("ids", *_IDS))
        if top >= vocab_size or low < 0:
            raise bad(f"hold token id {top if top >= vocab_size else low}, outside the model's "
                      f"vocabulary of {vocab_size}")  # fmt: skip
    return tensors, meta


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
    run_time_share: float | None = None,
) -> ServedCheck:
    """`run_time_share`: the share of the measured KL from what the checkpoint rounds at run
    time (`run_time_share`; None: it rounds nothing then), so served vs measured is also held
    to the floor `rounding_floor` gives."""
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
    limits, failures = judge(vs_meas, vs_ref, meas_ref, increase, max_kl=max_kl,
                             min_top1=min_top1, max_kl_increase=max_kl_increase,
                             run_time_share=run_time_share)  # fmt: skip
    return ServedCheck(
        engine=engine.name, kv_cache_dtype=kv_cache_dtype, served_vs_measured=vs_meas,
        served_vs_reference=vs_ref, measured_vs_reference=meas_ref, served_kl_increase=increase,
        missing=missing, positions=int(want.shape[0]), passed=not failures,
        thresholds=limits,
        failures=failures, seconds={"load": round(load_s, 2), "score": round(score_s, 2)},
        facts=dict(engine.facts),
    )  # fmt: skip


def judge(
    vs_meas: KLFigures, vs_ref: KLFigures, meas_ref: KLFigures, increase: float, *,
    max_kl: float, min_top1: float, max_kl_increase: float, run_time_share: float | None,
) -> tuple[dict[str, float], list[str]]:  # fmt: skip
    """The limits applied (the recipe's, widened by `rounding_floor` when something is
    rounded at run time: `run_time_share` not None) and what exceeded them."""
    limits = {"max_kl": max_kl, "min_top1": min_top1, "max_kl_increase": max_kl_increase}
    if run_time_share is not None:
        limits.update(rounding_floor(max_kl, min_top1, meas_ref, run_time_share))
    max_kl, min_top1 = limits["max_kl"], limits["min_top1"]
    failures = []
    figures = [vs_meas.kl_mean, vs_meas.kl_p99, vs_meas.top1, vs_ref.kl_mean, meas_ref.kl_mean]
    if not all(math.isfinite(x) for x in figures):
        failures.append("a served or measured figure is not a number (NaN / inf)")
    if not vs_meas.kl_mean <= max_kl:
        failures.append(f"served vs measured KL {vs_meas.kl_mean:.4g} > max_kl {max_kl:g}")
    if not vs_meas.top1 >= min_top1:
        failures.append(f"served vs measured top-1 {vs_meas.top1:.4f} < min_top1 {min_top1:g}")
    if not increase <= max_kl_increase:
        failures.append(f"served KL to the reference is {increase:+.1%} of the measured "
                        f"(> max_kl_increase {max_kl_increase:.0%})")  # fmt: skip
    return limits, failures


def rejudge(chk: ServedCheck, *, run_time_share: float | None) -> ServedCheck:
    """A stored check held to today's rule with the recipe limits it recorded: a session's
    served figures judged again after the rule changed (the rounding floor came after
    2026-12-06 07:20's checks; its KL limit became the run-time rounding's own share on
    2026-12-07), without serving again. `run_time_share`: `evaluated_run_time_share` of the
    evaluation the check belongs to."""
    t = chk.thresholds
    missing = {"max_kl", "min_top1", "max_kl_increase"} - set(t)
    if missing:
        raise UsageError(f"the served check records no {', '.join(sorted(missing))} threshold",
                         hint="judge it again from a check written by qship verify --serve")  # fmt: skip
    limits, failures = judge(
        chk.served_vs_measured, chk.served_vs_reference, chk.measured_vs_reference,
        chk.served_kl_increase, max_kl=t.get("recipe_max_kl", t["max_kl"]),
        min_top1=t.get("recipe_min_top1", t["min_top1"]), max_kl_increase=t["max_kl_increase"],
        run_time_share=run_time_share,
    )  # fmt: skip
    return chk.model_copy(update={"thresholds": limits, "failures": failures,
                                  "passed": not failures})  # fmt: skip


def rounding_floor(
    max_kl: float, min_top1: float, meas_ref: KLFigures, run_time_share: float
) -> dict[str, float]:
    """Served-vs-measured limits for a checkpoint that rounds activations at run time
    (`rounds_at_run_time`: per token in its Linears, or in its FP8 KV cache). The
    engine and qship's evaluation round slightly different inputs (their own kernels), and a
    value near a rounding boundary lands on the neighbouring level, so the two are two
    independent draws of that run-time rounding's noise around the same weights: their KL
    is about the sum of each one's KL to the unrounded model, their top-1 agreement about
    the product of each one's agreement (bench/studies/served_noise.py: an INT8 W8A8 Gemma 3 270M in
    float32 vs bfloat16, KL 0.081 between them, 0.061 / 0.073 to the reference; 0.003 for a
    weight-only one). So: KL up to twice the run-time rounding's own part of the measured
    KL (`run_time_share` of it: an FP8 KV cache's is what evaluate's KV-off pass removes,
    0.0119 served vs measured for SmolLM2's 4-bit recipe whose whole KL is 0.159) -- never
    the weights' error, so an artifact whose weights were rounded otherwise fails -- and
    top-1 down to the measured top-1's square; never stricter than the recipe's. The
    quality served stays held by max_kl_increase."""
    noise = run_time_share * meas_ref.kl_mean
    return {"max_kl": max(max_kl, 2 * noise), "min_top1": min(min_top1, meas_ref.top1**2),
            "recipe_max_kl": max_kl, "recipe_min_top1": min_top1,
            "run_time_share": run_time_share}  # fmt: skip


def run_check(
    model_dir: Path, measured_path: Path, gate: ServeGate, *, device: str | None = None,
    sha256: str | None = None, kv_share: KVShare | None = None, **engine_opts: Any,
) -> ServedCheck:  # fmt: skip
    """Load `model_dir` in the gate's engine and compare it with the measured file (checked
    against `sha256`, what eval.json records, and the model's vocabulary first). `kv_share`:
    the evaluation's KV-on/KV-off split, the FP8 KV cache's part of the KL."""
    from . import engines

    measured, meta = load_measured(measured_path, sha256=sha256,
                                   vocab_size=_vocab_size(Path(model_dir)))  # fmt: skip
    t0 = time.perf_counter()
    with log.heartbeat(f"served check ({gate.engine})"):
        eng = engines.make(gate.engine, Path(model_dir), kv_cache_dtype=gate.kv_cache_dtype,
                           device=device, attention=meta.get("attention", "kv-only"),
                           max_len=int(measured["ids"].shape[1]), **engine_opts)  # fmt: skip
        load_s = time.perf_counter() - t0
        return check(eng, measured, kv_cache_dtype=gate.kv_cache_dtype, max_kl=gate.max_kl,
                     min_top1=gate.min_top1, max_kl_increase=gate.max_kl_increase,
                     load_s=load_s,
                     run_time_share=run_time_share(Path(model_dir), kv_share))  # fmt: skip


def rounds_at_run_time(model_dir: Path) -> bool:
    """Whether serving rounds activations (the served check's rounding floor applies): Linear
    inputs (W8A8, W4A8), or an FP8 KV cache -- K and V rounded as they are cached, and the
    query with them in vLLM's FP8 attention. On the H100/H200 the FP8 KV cache alone took
    Qwen2.5-Coder-0.5B's W4A16 from served-vs-measured KL 0.0007 / top-1 0.976 (16-bit KV) to
    0.018 / 0.90-0.91, its served KL to the reference within 1.2 % of the measured both times
    (bench/RESULTS.md, H200 session 2026-12-06)."""
    return quantizes_activations(model_dir, query=False) or kv_scheme(model_dir) is not None


def run_time_share(model_dir: Path, kv_share: KVShare | None) -> float | None:
    """The share of the measured KL that comes from what `model_dir` rounds at run time
    (None: nothing, `rounds_at_run_time`): an FP8 KV cache's measured part (`kv_part`);
    rounded Linear inputs count as all of it, evaluate not splitting their share off."""
    if quantizes_activations(model_dir, query=False):
        return 1.0
    return kv_part(kv_share) if kv_scheme(model_dir) is not None else None


def evaluated_run_time_share(ev: EvalReport) -> float | None:
    """The same from what an evaluation record says it simulated (Linear inputs rounded as
    vLLM does, a KV scheme) and measured (the KV-on/KV-off split), for rows whose
    checkpoint is not at hand (a GPU session's)."""
    if ev.candidate.served_linear_modules > 0:
        return 1.0
    return kv_part(ev.kv_cache_share) if ev.candidate.kv_cache_scheme is not None else None


def kv_part(kv_share: KVShare | None) -> float:
    """The FP8 KV cache's share of the measured KL, in [0, 1] (the KV-off pass may score a
    hair worse: 0); an evaluation without the KV-off pass (none since it became the default)
    counts all of it."""
    if kv_share is None:
        return 1.0
    return min(1.0, max(0.0, kv_share.fraction_of_kl_from_kv))


def _vocab_size(model_dir: Path) -> int | None:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    v = text_config(cfg).get("vocab_size")
    return int(v) if isinstance(v, int) else None
