"""eval.json and eval.md: the evaluation as CI reads it and as people read it."""

from __future__ import annotations

import json
from pathlib import Path

from ..io.atomic import atomic_write_text
from ..records.benchmarks import Benchmarks
from ..records.evaluation import EvalFile, Metrics


def _f(x: float | int | None, nd: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.{nd - 1}e}"
        return f"{x:.{nd}f}"
    return str(x)


ROWS: list[tuple[str, str]] = [
    ("KL mean", "kl.mean"),
    ("KL stderr", "kl.stderr"),
    ("KL median", "kl.median"),
    ("KL p90", "kl.p90"),
    ("KL p99", "kl.p99"),
    ("KL p999", "kl.p999"),
    ("KL max", "kl.max"),
    ("top-1 agreement", "top1_agreement"),
    ("ppl reference", "ppl_reference"),
    ("ppl candidate", "ppl_candidate"),
    ("ppl ratio", "ppl_ratio"),
    ("RMS Δp", "rms_dp"),
]


def _get(m: Metrics | None, path: str) -> float | None:
    obj: object = m
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, int | float) else None


def render_markdown(ev: EvalFile) -> str:
    c, s = ev.corpus, ev.settings
    lines = [
        "# qship evaluation",
        "",
        f"- reference: `{ev.reference.path}` (sha256 {ev.reference.model_hash[:16]}…)",
        f"- candidate: `{ev.candidate.path}` (sha256 {ev.candidate.model_hash[:16]}…)",
        f"- held-out tokens: {c.sequences} × {c.seq_len} ({c.tokens_scored} scored), "
        f"hash {c.heldout_hash[:16]}…" + (f", source {c.source}" if c.source else ""),
        f"- mode: {s.mode}; device {s.device}, dtype {s.dtype}",
        "",
        "| figure | candidate (as deployed) | weights only (KV quant off) |",
        "|---|---|---|",
    ]
    w = ev.metrics_weights_only
    for name, path in ROWS:
        lines.append(
            f"| {name} | {_f(_get(ev.metrics, path))} | {_f(_get(w, path)) if w else '–'} |"
        )
    if ev.kv_cache_share:
        k = ev.kv_cache_share
        lines += [
            "",
            f"FP8 KV cache adds {_f(k.kl_mean_added_by_kv)} nats of mean KL "
            f"({100 * k.fraction_of_kl_from_kv:.1f} % of the total).",
        ]
    if ev.greedy:
        lines += ["", f"Greedy agreement: {ev.greedy.describe()} ({ev.greedy.engine})."]
    if s.kl_approximation:
        lines += ["", f"KL approximation: {s.kl_approximation}."]
    lines += _benchmarks(ev.benchmarks)
    if ev.overlap:
        o = ev.overlap
        worst = ", ".join(f"{k} {s.overlapping}/{s.items}" for k, s in o.sets.items())
        lines += ["", f"Overlap with the calibration text ({o.n}-gram, limit "
                  f"{o.max_fraction:.1%}): {worst}."]  # fmt: skip
    lines += _gate(ev)
    if ev.timings:
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in ev.timings.items())]
    return "\n".join(lines) + "\n"


def _benchmarks(b: Benchmarks) -> list[str]:
    """The lm-eval tasks, reference beside candidate, and the sandbox they ran in."""
    if not b.tasks:
        return []
    lines = [
        "",
        "## Benchmarks (lm-eval, both models on the same items)",
        "",
        f"Items per task: {'all' if b.limit is None else f'the first {b.limit}'}"
        f"{' (per subject for mmlu)' if b.limit and 'mmlu' in b.tasks else ''}. Drop = "
        "reference − candidate in percentage points; its interval is paired (per-item "
        "differences). lost / gained: items only the reference / only the candidate got right.",
        "",
        "| task | items | metric | reference | candidate | drop pp [95 % CI] | noise | "
        "lost / gained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in sorted(b.tasks.items()):
        if t.status != "ok" or t.reference is None or t.candidate is None:
            lines.append(f"| {name} | – | – | – | – | – | {t.describe()} | – |")
            continue
        lo, hi = t.ci95_pp or (float("nan"), float("nan"))
        lines.append(
            f"| {name} | {t.n} of {t.n_total} ({t.split}) | {t.metric} | "
            f"{100 * t.reference.value:.1f} % | {100 * t.candidate.value:.1f} % | "
            f"{t.drop_pp:+.2f} [{lo:+.2f}, {hi:+.2f}] | "
            f"{'within' if t.within_noise else 'BEYOND'} | {t.lost} / {t.gained} |"
        )
    code = sorted(n for n, t in b.tasks.items() if t.isolation)
    if code:  # the sandbox's isolation (evaluate/sandbox.py), one for the whole run
        lines += ["", f"Model-written code ({', '.join(code)}) ran sandboxed: "
                  f"{b.tasks[code[0]].isolation}."]  # fmt: skip
    return lines


def _gate(ev: EvalFile) -> list[str]:
    """The gate's verdict, one row per check."""
    v = ev.verdict
    if not v:
        return []
    lines = [
        "",
        f"## Gate: {'PASSED' if v.passed else 'FAILED'}",
        "",
        "| check | value | limit | result |",
        "|---|---|---|---|",
    ]
    for ch in v.checks:
        note = f" ({ch.note})" if ch.note else ""
        lines.append(
            f"| {ch.name} | {_f(ch.value)} | {ch.op} {_f(ch.limit)} | "
            f"{'pass' if ch.passed else 'FAIL'}{note} |"
        )
    return lines


def write_outputs(ev: EvalFile, out_dir: Path) -> dict[str, Path]:
    """eval.json and eval.md in `out_dir`, each written atomically."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "eval.json", "md": out_dir / "eval.md"}
    text = json.dumps(ev.to_json(), indent=2, sort_keys=True) + "\n"
    atomic_write_text(paths["json"], text)
    atomic_write_text(paths["md"], render_markdown(ev))
    return paths
