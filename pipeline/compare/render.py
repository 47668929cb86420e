"""The comparison report as text: compare.md, compare.csv, compare.json (report.py builds
the report dict from the rows; html.py and plots.py render the rest)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from typing import Any

from .report import SCALARS, SUPPORTED_GATES, columns, recommendation, task_names, value, workloads


def fmt(v: Any, f: str) -> str:
    if v is None:
        return "–"
    if f == "mb":
        return f"{v / 1e6:.2f}"
    if f == "s":
        return str(v).replace("|", "\\|")
    if isinstance(v, int) and "f" not in f and "g" not in f:
        return str(v)
    return f.format(v)


def verdict_text(r: dict) -> str:
    if r.get("passed") is None:
        return "–"
    if r["passed"]:
        return "pass"
    failed = [c.get("name", "?") for c in r.get("checks", []) if not c.get("passed", True)]
    return "FAIL" + (f" ({', '.join(failed)})" if failed else "")


PEAK_RSS_NOTE = (
    "peak mem: the process's peak RSS (CPU run); within one `qship compare` process it is a "
    "high-water mark that includes the recipes run before, so compare it only across "
    "separate jobs (on a GPU it is torch.cuda.max_memory_allocated per quantize)."
)


def notes(rows: list[dict]) -> list[str]:
    return (
        ([PEAK_RSS_NOTE] if any(r.get("peak_mem_kind") == "process_peak_rss" for r in rows) else [])
        + [f"{r['name']}: {r['baseline']}." for r in rows if r.get("baseline")]
        + served_notes(rows)
    )


def served_notes(rows: list[dict]) -> list[str]:
    """Per served recipe: every kernel vLLM ran per scheme (with its Linears where counted)
    and vLLM's speed warnings, which explain a slow row."""
    out = []
    for r in rows:
        kernels = "; ".join(f"{s} -> {k}" for s, k in (r.get("kernels") or {}).items())
        warned = (
            " vLLM warned: " + "; ".join(r["serve_warnings"]) if r.get("serve_warnings") else ""
        )
        if kernels or warned:
            out.append(f"{r['name']} served with {kernels or 'no kernel logged'}.{warned}")
    return out


def width_line(report: dict, style: Callable[[str], str]) -> str:
    widths = report.get("best_by_width") or {}
    if len(widths) < 2:
        return ""
    return (
        " Best per weight width: "
        + "; ".join(f"{w}-bit {style(n)}" for w, n in widths.items())
        + "."
    )


def render_md(report: dict) -> str:
    rows = report["rows"]
    cols = columns(rows)
    best = report["best_per_column"]
    pareto = set(report["pareto_bits_vs_kl"])
    head = ["recipe", *[h for _, h, _, _ in cols], "gate"]
    lines = [
        "# qship recipe comparison",
        "",
        f"Recipes: {len(rows)}. Best passing recipe (lowest mean KL, tie → fewer bits): "
        f"**{report['best'] or 'none passed'}**." + width_line(report, lambda n: f"**{n}**"),
        "",
        "Recommendation: " + recommendation(report),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(cols) + ["---"]) + "|",
    ]
    for r in rows:
        cells = [r["name"].replace("|", "\\|") + (" ◆" if r["name"] in pareto else "")]
        for key, _h, f, _d in cols:
            s = fmt(value(r, key), f)
            cells.append(f"**{s}**" if r["name"] in best.get(key, []) else s)
        cells.append(verdict_text(r))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bold: best in its column (ppl ratio: closest to 1). ◆: on the Pareto front of "
        "bits/weight vs mean KL. KL in nats per token, KL(reference ‖ quantized), "
        "on held-out tokens.",
        "",
    ]
    lines += [*(f"{n}\n" for n in notes(rows))]
    lines += limits_md(report)
    return "\n".join(lines)


def limits_md(report: dict) -> list[str]:
    """The gate limits each row's measurement supports on this model, beside the recipe's
    own (shipped limits come from another model's run: set yours from these)."""
    supported = report.get("supported_limits") or {}
    gates = [g for g in SUPPORTED_GATES if any(g in v for v in supported.values())]
    if not gates:
        return []
    lines = ["## Gate limits these measurements support", "",
             f"On this model, per recipe: {report.get('supported_limits_rule', '')}; in "
             "brackets the recipe's own limit. Set your gates from these, not from the shipped "
             "recipes' (measured on another model).", "",
             "| recipe | " + " | ".join(gates) + " |", "|---|" + "---:|" * len(gates)]  # fmt: skip
    for r in report["rows"]:
        own = {c.get("name"): c.get("limit") for c in r.get("checks") or []}
        got = supported.get(r["name"], {})
        cells = [f"{got[g]:g}" + (f" ({own[g]:g})" if isinstance(own.get(g), int | float) else "")
                 if g in got else "–" for g in gates]  # fmt: skip
        lines.append("| " + r["name"].replace("|", "\\|") + " | " + " | ".join(cells) + " |")
    return [*lines, ""]


def csv_header(rows: list[dict]) -> list[str]:
    return (
        ["name", "recipe", "recipe_hash", "passed", "formats", *SCALARS]
        + [f"task:{t}" for t in task_names(rows)]
        + [f"speed:{w}" for w in workloads(rows)]
        + (["weights_gib", "kv_cache_tokens"] if workloads(rows) else [])
        + ["failed_checks"]
    )


def render_csv(report: dict) -> str:
    rows = report["rows"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = csv_header(rows)
    w.writerow(header)
    for r in rows:
        out = []
        for k in header:
            if k == "failed_checks":
                v = ";".join(
                    c.get("name", "?") for c in r.get("checks", []) if not c.get("passed", True)
                )
            else:
                v = value(r, k)
            out.append("" if v is None else (repr(v) if isinstance(v, float) else v))
        w.writerow(out)
    return buf.getvalue()


def render_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
