"""evaluate: quality of a quantized candidate against its unquantized reference.

On held-out token sequences (never calibration data; built by calibration.py) every
position's next-token distribution of the candidate is compared with the reference's:
KL(ref||cand) mean ± stderr, median, p90, p99, p99.9, max; top-1 agreement; perplexity
of both and their ratio; RMS of Δp(next token) (the figures of llama.cpp's
`llama-perplexity --kl-divergence`). See kl_stats.py for the definitions.

Two modes:
* cached (default): the reference pass runs once per (reference hash, held-out hash,
  length, mode) and stores top-k log-probs + one tail bucket (reference_cache.py); the
  reference model is freed before the candidate loads, and N candidates cost one
  reference pass. KL is then a lower bound (log-sum inequality); top-1, ppl, Δp exact.
* exact: reference and candidate run in lockstep and KL is summed over the full
  vocabulary in float64.

The candidate runs as deployed: with its FP8 KV cache in the loop (compressed-tensors
hooks every attention module with a `QuantizedKVCache` that rounds K/V through e4m3
with the stored k_scale/v_scale). When it has a kv_cache_scheme, a second candidate pass
with that rounding switched off (`quantization_enabled = False` on the hooked attention
modules, the switch compressed-tensors' QuantizedKVCache.forward reads) gives the
weights-only figure, so the KV cache's share of the error is visible.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import kl_stats, reference_cache
from .devices import default_device
from .errors import GateFailed, StageError, UsageError
from .fsutil import atomic_write_text
from .progress import Every

KV_ATTR = "kv_cache"  # compressed_tensors.modeling.kvcache.KV_CACHE_ATTR


# ------------------------------------------------------------------ models


def load_model(path: Path, *, device: str, dtype: str | None = None):
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{path} is not a checkpoint directory (no config.json)",
            path=str(path),
            hint="pass a folder written by `qship fetch` or `qship quantize`",
        )
    if dtype is None and device.split(":")[0] == "cpu":
        dtype = "float32"  # 16-bit GEMMs are ~70x slower on the CPU (devices.py)
    kw: dict[str, Any] = {"dtype": getattr(torch, dtype) if dtype else "auto"}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return model.to(device).eval()


def kv_scheme(model_dir: Path) -> dict | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return (cfg.get("quantization_config") or {}).get("kv_cache_scheme")


def kv_modules(model) -> list[torch.nn.Module]:
    """Attention modules carrying compressed-tensors' KV-cache quantization hook."""
    return [
        m
        for m in model.modules()
        if hasattr(m, KV_ATTR)
        and getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
    ]


@contextlib.contextmanager
def kv_quantization(model, enabled: bool) -> Iterator[int]:
    """Switch the simulated KV-cache quantization on or off; yields #modules touched."""
    mods = kv_modules(model)
    old = [getattr(m, "quantization_enabled", True) for m in mods]
    for m in mods:
        m.quantization_enabled = enabled
    try:
        yield len(mods)
    finally:
        for m, o in zip(mods, old, strict=True):
            m.quantization_enabled = o


@torch.inference_mode()
def forward_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for positions 0..L-2 and the tokens they predict, flattened to [n, V], [n]."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def score_against_reference(
    model,
    ids: torch.Tensor,
    ref: dict[str, torch.Tensor],
    batch_size: int,
    kv_passes: dict[str, bool] | None = None,
    progress: str | None = None,
) -> dict[str, kl_stats.Accumulator]:
    """Per-token figures of `model` on `ids` against a cached reference entry (top-k + tail,
    rows in sequence-then-position order). One pass per entry of `kv_passes` (name -> KV
    quantization on/off; a model without KV hooks is the same in both). Used by evaluate's
    cached mode, by compare (per-token KL for the plot) and by sensitivity."""
    kv_passes = kv_passes or {"on": True}
    acc = {name: kl_stats.Accumulator() for name in kv_passes}
    per_seq = ids.shape[1] - 1
    n = ids.shape[0]
    bar = Every(f"qship evaluate: {progress}", n) if progress else None
    for s in range(0, n, batch_size):
        batch = ids[s : s + batch_size]
        rows = slice(s * per_seq, (s + batch.shape[0]) * per_seq)
        part = {k: v[rows] for k, v in ref.items()}
        for name, enabled in kv_passes.items():
            with kv_quantization(model, enabled):
                cl, nxt = forward_logits(model, batch)
            acc[name].add(kl_stats.kl_topk_tail(part, cl, nxt))
            del cl
        if bar:
            bar.step(s + batch.shape[0])
    return acc


# ------------------------------------------------------------------ result


@dataclass
class EvalResult:
    reference: dict
    candidate: dict
    corpus: dict
    settings: dict
    metrics: dict  # candidate as deployed (FP8 KV in the loop when it has one)
    metrics_weights_only: dict | None  # same with KV quantization off (None: no KV scheme)
    reference_cache: dict | None
    benchmarks: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "reference": self.reference,
            "candidate": self.candidate,
            "corpus": self.corpus,
            "settings": self.settings,
            "metrics": self.metrics,
            "metrics_weights_only": self.metrics_weights_only,
            "reference_cache": self.reference_cache,
            "benchmarks": self.benchmarks,
            "timings": self.timings,
        }
        if self.metrics_weights_only:
            on, off = self.metrics["kl"]["mean"], self.metrics_weights_only["kl"]["mean"]
            out["kv_cache_share"] = {
                "kl_mean_kv_on": on,
                "kl_mean_kv_off": off,
                "kl_mean_added_by_kv": on - off,
                "fraction_of_kl_from_kv": (on - off) / on if on > 0 else 0.0,
            }
        return out

    @classmethod
    def from_json(cls, d: dict) -> EvalResult:
        keys = cls.__dataclass_fields__
        return cls(**{k: d.get(k) for k in keys if k in d})

    def summary(self) -> str:
        return render_markdown(self.to_json(), None)


# ------------------------------------------------------------------ evaluation


def evaluate(
    reference_dir: Path,
    candidate_dir: Path,
    *,
    heldout_ids: torch.Tensor,
    heldout_hash: str,
    cache_dir: Path,
    tasks: list[str] | tuple[str, ...] = (),
    hub_tasks: list[str] | tuple[str, ...] = (),
    limit: int | None = None,
    batch_size: int = 4,
    exact: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    topk: int = reference_cache.DEFAULT_TOPK,
    kv_off: bool = True,
    corpus: dict | None = None,
) -> EvalResult:
    """Compare candidate with reference on `heldout_ids` [sequences, seq_len]."""
    device = device or default_device()
    reference_dir, candidate_dir = Path(reference_dir), Path(candidate_dir)
    if heldout_ids.ndim != 2 or heldout_ids.shape[1] < 2:
        raise UsageError(
            f"held-out ids must be [sequences, seq_len>=2], got {tuple(heldout_ids.shape)}"
        )
    heldout_ids = heldout_ids.long().cpu()
    ref_hash = reference_cache.model_hash(reference_dir)
    cand_hash = reference_cache.model_hash(candidate_dir)
    scheme = kv_scheme(candidate_dir)
    do_kv_off = kv_off and scheme is not None
    dtype_name = dtype or "auto"
    timings: dict[str, float] = {}

    def load(p: Path):
        return load_model(p, device=device, dtype=dtype)

    on, off = kl_stats.Accumulator(), kl_stats.Accumulator()
    ref_entry = None
    n_hooked = 0
    t_all = time.perf_counter()
    if exact:
        t0 = time.perf_counter()
        ref_model, cand_model = load(reference_dir), load(candidate_dir)
        timings["load_s"] = time.perf_counter() - t0
        n_hooked = len(kv_modules(cand_model))
        t0 = time.perf_counter()
        n = heldout_ids.shape[0]
        bar = Every("qship evaluate: exact", n)
        for s in range(0, n, batch_size):
            batch = heldout_ids[s : s + batch_size]
            rl, nxt = forward_logits(ref_model, batch)
            with kv_quantization(cand_model, True):
                cl, _ = forward_logits(cand_model, batch)
            on.add(kl_stats.exact_token_stats_fast(rl, cl, nxt))
            del cl
            if do_kv_off:
                with kv_quantization(cand_model, False):
                    cl, _ = forward_logits(cand_model, batch)
                off.add(kl_stats.exact_token_stats_fast(rl, cl, nxt))
                del cl
            del rl
            bar.step(s + batch.shape[0])
        _sync(device)
        timings["lockstep_s"] = time.perf_counter() - t0
        del ref_model, cand_model
    else:
        t0 = time.perf_counter()
        ref_entry = reference_cache.get_or_build(
            cache_dir,
            reference_dir,
            heldout_ids,
            heldout_hash=heldout_hash,
            ref_hash=ref_hash,
            topk=topk,
            forward=forward_logits,
            load_model=load,
            batch_size=batch_size,
            dtype=dtype_name,
            device=device,
        )
        timings["reference_s"] = time.perf_counter() - t0
        ref = ref_entry.load()
        t0 = time.perf_counter()
        cand_model = load(candidate_dir)
        timings["load_s"] = time.perf_counter() - t0
        n_hooked = len(kv_modules(cand_model))
        t0 = time.perf_counter()
        kv_passes = {"on": True, "off": False} if do_kv_off else {"on": True}
        scored = score_against_reference(
            cand_model, heldout_ids, ref, batch_size, kv_passes, progress="candidate"
        )
        on, off = scored["on"], scored.get("off", off)
        _sync(device)
        timings["candidate_s"] = time.perf_counter() - t0
        del cand_model
    if scheme is not None and n_hooked == 0:
        raise StageError(
            "candidate config has a kv_cache_scheme but no attention module carries the "
            "compressed-tensors KV hook after loading: the FP8 KV cache would not be in the loop",
            path=str(candidate_dir / "config.json"),
            hint="check the transformers / compressed-tensors versions against constraints.txt",
        )
    metrics = on.summary()
    metrics_off = off.summary() if do_kv_off else None
    mode = "exact" if exact else f"cached-top{topk}+tail"
    metrics["kl_mode"] = mode
    if metrics_off:
        metrics_off["kl_mode"] = mode

    benchmarks: dict = {}
    if tasks or hub_tasks:
        from . import benchmarks as bm

        t0 = time.perf_counter()
        benchmarks = bm.compare(
            reference_dir,
            candidate_dir,
            tasks=list(tasks),
            hub_tasks=list(hub_tasks),
            limit=limit,
            cache_dir=cache_dir,
            ref_hash=ref_hash,
            device=device,
            dtype=dtype,
        )
        timings["benchmarks_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_all
    return EvalResult(
        reference={"path": str(reference_dir), "model_hash": ref_hash},
        candidate={
            "path": str(candidate_dir),
            "model_hash": cand_hash,
            "kv_cache_scheme": scheme,
            "kv_hooked_attention_modules": n_hooked,
        },
        corpus={
            **(corpus or {}),
            "heldout_hash": heldout_hash,
            "ids_sha256": reference_cache.ids_digest(heldout_ids),
            "sequences": int(heldout_ids.shape[0]),
            "seq_len": int(heldout_ids.shape[1]),
            "tokens_scored": int(heldout_ids.shape[0] * (heldout_ids.shape[1] - 1)),
        },
        settings={
            "mode": mode,
            "topk": None if exact else topk,
            "kl_approximation": None
            if exact
            else (
                f"reference stored as its top-{topk} log-probs + one bucket for the rest; "
                "KL = sum_topk p log(p/q) + P_tail log(P_tail/Q_tail), a lower bound of the "
                "full-vocabulary KL (log-sum inequality); top-1, ppl and dp are exact"
            ),
            "kl_dtype": "float64",
            "batch_size": batch_size,
            "device": device,
            "dtype": dtype_name,
            "kv_cache": "on (as deployed)" if scheme else "none in candidate",
            "weights_only_pass": do_kv_off,
        },
        metrics=metrics,
        metrics_weights_only=metrics_off,
        reference_cache=ref_entry.to_json() if ref_entry else None,
        benchmarks=benchmarks,
        timings={k: round(v, 3) for k, v in timings.items()},
    )


# ------------------------------------------------------------------ outputs


def _f(x: Any, nd: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.{nd - 1}e}"
        return f"{x:.{nd}f}"
    return str(x)


def render_markdown(ev: dict, verdict: dict | None) -> str:
    m, w = ev["metrics"], ev.get("metrics_weights_only")
    c = ev["corpus"]
    lines = [
        "# qship evaluation",
        "",
        f"- reference: `{ev['reference']['path']}` (sha256 {ev['reference']['model_hash'][:16]}…)",
        f"- candidate: `{ev['candidate']['path']}` (sha256 {ev['candidate']['model_hash'][:16]}…)",
        f"- held-out tokens: {c['sequences']} × {c['seq_len']} ({c['tokens_scored']} scored), "
        f"hash {str(c['heldout_hash'])[:16]}…"
        + (f", source {c['source']}" if c.get("source") else ""),
        f"- mode: {ev['settings']['mode']}; device {ev['settings']['device']}, dtype {ev['settings']['dtype']}",
        "",
        "| figure | candidate (as deployed) | weights only (KV quant off) |",
        "|---|---|---|",
    ]

    def row(name, get):
        lines.append(f"| {name} | {_f(get(m))} | {_f(get(w)) if w else '–'} |")

    row("KL mean", lambda d: d["kl"]["mean"])
    row("KL stderr", lambda d: d["kl"]["stderr"])
    for q in ("median", "p90", "p99", "p999", "max"):
        row(f"KL {q}", lambda d, q=q: d["kl"][q])
    row("top-1 agreement", lambda d: d["top1_agreement"])
    row("ppl reference", lambda d: d["ppl_reference"])
    row("ppl candidate", lambda d: d["ppl_candidate"])
    row("ppl ratio", lambda d: d["ppl_ratio"])
    row("RMS Δp", lambda d: d["rms_dp"])
    if ev.get("kv_cache_share"):
        s = ev["kv_cache_share"]
        lines += [
            "",
            f"FP8 KV cache adds {_f(s['kl_mean_added_by_kv'])} nats of mean KL "
            f"({100 * s['fraction_of_kl_from_kv']:.1f} % of the total).",
        ]
    if ev["settings"].get("kl_approximation"):
        lines += ["", f"KL approximation: {ev['settings']['kl_approximation']}."]
    b = ev.get("benchmarks") or {}
    if b.get("tasks"):
        lines += [
            "",
            "## Benchmarks (lm-eval)",
            "",
            "| task | metric | reference | candidate | drop (+ = worse) | status |",
            "|---|---|---|---|---|---|",
        ]
        for name, t in sorted(b["tasks"].items()):
            if t.get("status") != "ok":
                lines.append(
                    f"| {name} | – | – | – | – | {t.get('status')}: {t.get('reason', '')} |"
                )
                continue

            def sc(x):
                return f"{_f(x['value'])} ± {_f(x.get('stderr'))}"

            lines.append(
                f"| {name} | {t['metric']} | {sc(t['reference'])} | {sc(t['candidate'])} | "
                f"{_f(t['drop'])} ± {_f(t.get('drop_stderr'))} | ok |"
            )
    if verdict:
        lines += [
            "",
            f"## Gate: {'PASSED' if verdict['passed'] else 'FAILED'}",
            "",
            "| check | value | limit | result |",
            "|---|---|---|---|",
        ]
        for ch in verdict["checks"]:
            lines.append(
                f"| {ch['name']} | {_f(ch['value'])} | {ch['op']} {_f(ch['limit'])} | "
                f"{'pass' if ch['passed'] else 'FAIL'}{' (' + ch['note'] + ')' if ch.get('note') else ''} |"
            )
    t = ev.get("timings") or {}
    if t:
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in t.items())]
    return "\n".join(lines) + "\n"


def write_outputs(result: EvalResult | dict, verdict, out_dir: Path) -> dict[str, Path]:
    """eval.json (all figures + verdict) and eval.md, each written atomically."""
    ev = result.to_json() if hasattr(result, "to_json") else dict(result)
    vj = verdict.to_json() if hasattr(verdict, "to_json") else verdict
    data = {**ev, "verdict": vj}
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "eval.json", "md": out_dir / "eval.md"}
    atomic_write_text(paths["json"], json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    atomic_write_text(paths["md"], render_markdown(ev, vj))
    return paths


def evaluate_and_gate(
    reference_dir: Path,
    candidate_dir: Path,
    *,
    gates: Any,
    out_dir: Path | None,
    raise_on_fail: bool = True,
    **kwargs,
):
    """evaluate() + gate.check() + write_outputs(); raises GateFailed (exit 4) after writing.

    With raise_on_fail=False returns (result, verdict) and leaves `require_pass` to the
    caller (the CLI prints the JSON first, then fails).
    """
    from . import gate

    result = evaluate(reference_dir, candidate_dir, **kwargs)
    verdict = gate.check(result.to_json(), gates)
    if out_dir is not None:
        write_outputs(result, verdict, out_dir)
    if raise_on_fail:
        require_pass(verdict, out_dir=out_dir, candidate_dir=candidate_dir)
    return result, verdict


def require_pass(
    verdict, *, out_dir: Path | None = None, candidate_dir: Path | None = None
) -> None:
    if verdict.passed:
        return
    failed = [c for c in verdict.checks if not c["passed"]]
    raise GateFailed(
        f"{len(failed)} of {len(verdict.checks)} quality checks failed: "
        + "; ".join(
            f"{c['name']} = {_f(c['value'])} (limit {c['op']} {_f(c['limit'])})" for c in failed
        ),
        path=str(Path(out_dir) / "eval.json") if out_dir else str(candidate_dir),
        hint="see eval.md; use a stronger recipe (more bits, GPTQ/AWQ) or relax the recipe's gates",
    )
