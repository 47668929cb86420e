"""The recipe comparison report: per-recipe rows -> compare.md / .json / .csv / .png / .html.

Pure: it takes a list of row dicts (the schema below) and writes files; it runs no model.
`pipeline.compare` builds the rows (in process, or from the eval.json files of CI jobs).

Row schema (one per recipe; every figure may be None when the stage did not report it):

    name             recipe name (unique in a report)
    recipe           recipe file as given
    recipe_hash      sha256 of the resolved recipe
    passed           gate verdict (bool or None)
    checks           [{name, value, limit, passed}]   the gate's checks
    bits_per_weight  storage bits per quantized Linear weight (scales, zero points included)
    size_bytes       bytes of the checkpoint's *.safetensors
    quantize_s       wall time of the quantize stage (s)
    peak_mem_bytes   peak memory of the quantize stage
    peak_mem_kind    "cuda_max_allocated" (GPU, reset per quantize) or "process_peak_rss"
                     (CPU: the process's high-water mark, so in one process it also covers
                     the recipes run before it)
    tokens           scored held-out tokens
    kl_mean kl_stderr kl_median kl_p90 kl_p99 kl_p999 kl_max    KL(ref||quant), nats/token
    top1             top-1 agreement with the reference
    ppl_reference ppl_candidate ppl_ratio
    tasks            {task: score}          benchmark scores (lm-eval)
    kl_hist          {"edges": [...], "counts": [...], "zero": n} per-token KL histogram on
                     the fixed log bins KL_HIST_EDGES (None when no per-token values exist)
    source           where the row came from (eval.json path), informative only

"Best" recipe (the one CI publishes): lowest mean KL among the recipes whose gate passed;
a tie goes to fewer bits per weight, then to the name.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .fsutil import atomic_write_bytes, atomic_write_text
from .kl_stats import KL_HIST_EDGES, kl_histogram  # noqa: F401 (re-exported)

SCHEMA = "qship.compare/1"


# (key, header, format, direction): direction "min"/"max"/"one" (closest to 1) or None
COLUMNS: list[tuple[str, str, str, str | None]] = [
    ("bits_per_weight", "bits/weight", "{:.3f}", "min"),
    ("size_bytes", "size MB", "mb", "min"),
    ("quantize_s", "quantize s", "{:.1f}", "min"),
    ("peak_mem_bytes", "peak mem MB", "mb", "min"),
    ("kl_mean", "KL mean", "{:.4g}", "min"),
    ("kl_stderr", "± stderr", "{:.2g}", None),
    # the same candidate with its FP8 KV rounding off: the difference is the KV cache's cost
    ("kl_mean_kv_off", "KL mean, KV off", "{:.4g}", None),
    ("kl_median", "KL median", "{:.4g}", "min"),
    ("kl_p99", "KL p99", "{:.4g}", "min"),
    ("kl_max", "KL max", "{:.4g}", "min"),
    ("top1", "top-1", "{:.4f}", "max"),
    ("ppl_ratio", "ppl ratio", "{:.4f}", "one"),
]

SCALARS = [
    "bits_per_weight",
    "size_bytes",
    "quantize_s",
    "peak_mem_bytes",
    "tokens",
    "kl_mean",
    "kl_stderr",
    "kl_mean_kv_off",
    "kl_median",
    "kl_p90",
    "kl_p99",
    "kl_p999",
    "kl_max",
    "top1",
    "ppl_reference",
    "ppl_candidate",
    "ppl_ratio",
]


# ------------------------------------------------------------------ rows


def _num(x: Any) -> float | int | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int):
        return x
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _first(d: dict, *paths: tuple[str, ...]) -> Any:
    for p in paths:
        v = _get(d, *p)
        if v is not None:
            return v
    return None


def task_scores(ev: dict) -> dict[str, float]:
    """{task: candidate score} from eval.json's benchmarks ({"tasks": {t: {"status": "ok",
    "metric", "reference": {"value"}, "candidate": {"value"}, "drop"}}}); tasks that did
    not run are left out. Also accepts a plain {"tasks": {t: number | {"score": x}}}."""
    raw = _get(ev, "benchmarks", "tasks") or ev.get("tasks") or {}
    out: dict[str, float] = {}
    if not isinstance(raw, dict):
        return out
    for name, v in raw.items():
        if isinstance(v, dict):
            if v.get("status") not in (None, "ok"):
                continue
            v = _first(v, ("candidate", "value"), ("score",), ("candidate",))
        n = _num(v)
        if n is not None:
            out[str(name)] = float(n)
    return dict(sorted(out.items()))


def row_from_eval(ev: dict, **extra: Any) -> dict:
    """A report row from an eval.json-shaped dict (evaluate's to_json(), optionally with
    "verdict" and a "compare" block holding the quantize figures); `extra` overrides."""
    cmp = ev.get("compare") if isinstance(ev.get("compare"), dict) else {}
    verdict = ev.get("verdict") if isinstance(ev.get("verdict"), dict) else None
    m = ev.get("metrics") if isinstance(ev.get("metrics"), dict) else ev  # evaluate's figures
    kl = m.get("kl") if isinstance(m.get("kl"), dict) else {}
    row: dict[str, Any] = {
        "name": cmp.get("name") or ev.get("recipe_name") or _get(ev, "recipe", "name"),
        "recipe": cmp.get("recipe"),
        "recipe_hash": cmp.get("recipe_hash") or ev.get("recipe_hash"),
        "passed": verdict.get("passed") if verdict else None,
        "checks": list(verdict.get("checks", [])) if verdict else [],
        "bits_per_weight": _num(cmp.get("bits_per_weight", ev.get("bits_per_weight"))),
        "size_bytes": _num(cmp.get("size_bytes", ev.get("size_bytes"))),
        "quantize_s": _num(cmp.get("quantize_s")),
        "peak_mem_bytes": _num(cmp.get("peak_mem_bytes")),
        "peak_mem_kind": cmp.get("peak_mem_kind"),
        "tokens": _num(m.get("tokens")),
    }
    for k in ("mean", "stderr", "median", "p90", "p99", "p999", "max"):
        row[f"kl_{k}"] = _num(kl.get(k))
    wo = ev.get("metrics_weights_only") if isinstance(ev.get("metrics_weights_only"), dict) else {}
    row["kl_mean_kv_off"] = _num((wo.get("kl") or {}).get("mean")) if wo else None
    row["top1"] = _num(_first(m, ("top1_agreement",), ("top1",)))
    for k in ("ppl_reference", "ppl_candidate", "ppl_ratio"):
        row[k] = _num(m.get(k))
    row["tasks"] = task_scores(ev)
    hist = cmp.get("kl_hist") or ev.get("kl_hist") or m.get("kl_hist")
    row["kl_hist"] = hist if isinstance(hist, dict) and "counts" in hist else None
    row["source"] = None
    row.update(extra)
    if not row["name"]:
        row["name"] = "recipe"
    return row


# ------------------------------------------------------------------ selection


def pareto_front(rows: list[dict], x: str = "bits_per_weight", y: str = "kl_mean") -> list[str]:
    """Names of the rows no other row beats on both x and y (lower is better), by x."""
    pts = [(r[x], r[y], r["name"]) for r in rows if r.get(x) is not None and r.get(y) is not None]
    front = []
    for xi, yi, n in pts:
        dominated = any(
            (xj <= xi and yj <= yi) and (xj < xi or yj < yi) for xj, yj, m in pts if m != n
        )
        if not dominated:
            front.append((xi, yi, n))
    return [n for _, _, n in sorted(front)]


def best_recipe(rows: list[dict]) -> str | None:
    """Lowest mean KL among passing recipes; tie -> fewer bits per weight, then name."""
    ok = [r for r in rows if r.get("passed") is True and r.get("kl_mean") is not None]
    if not ok:
        return None
    inf = float("inf")
    ok.sort(
        key=lambda r: (
            r["kl_mean"],
            r["bits_per_weight"] if r.get("bits_per_weight") is not None else inf,
            r["name"],
        )
    )
    return ok[0]["name"]


def best_by_width(rows: list[dict]) -> dict[str, str]:
    """The best passing recipe (best_recipe's rule) per weight width: the integer part of
    its bits per weight ("4" for 4.125 or 4.196, "8" for 8.02), so that an 8-bit recipe's
    lower KL does not hide which 4-bit recipe wins."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("bits_per_weight") is not None:
            by.setdefault(str(int(r["bits_per_weight"])), []).append(r)
    out = {w: best_recipe(rs) for w, rs in sorted(by.items(), key=lambda kv: int(kv[0]))}
    return {w: n for w, n in out.items() if n}


def _task_names(rows: list[dict]) -> list[str]:
    return sorted({t for r in rows for t in (r.get("tasks") or {})})


def _columns(rows: list[dict]) -> list[tuple[str, str, str, str | None]]:
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    cols += [(f"task:{t}", t, "{:.4f}", "max") for t in _task_names(rows)]
    return cols


def _value(row: dict, key: str) -> Any:
    if key.startswith("task:"):
        return (row.get("tasks") or {}).get(key[5:])
    return row.get(key)


def best_per_column(rows: list[dict]) -> dict[str, list[str]]:
    """{column key: names of the rows holding the best value} (ties all marked)."""
    out: dict[str, list[str]] = {}
    for key, _h, _f, direction in _columns(rows):
        if direction is None:
            continue
        vals = [(_value(r, key), r["name"]) for r in rows if _value(r, key) is not None]
        if len(vals) < 2:
            continue

        def score(v: float, d: str = direction) -> float:
            if d == "max":
                return -v
            if d == "one":
                return abs(math.log(v)) if v > 0 else float("inf")
            return v

        best = min(score(v) for v, _ in vals)
        out[key] = [n for v, n in vals if score(v) == best]
    return out


def summarise_rows(rows: list[dict]) -> dict:
    """compare.json: rows plus the derived selections (no timestamps: same rows, same bytes)."""
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        from .errors import UsageError

        dup = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(
            f"two results carry the same recipe name {dup[0]!r}",
            path=str(dup[0]),
            hint="give every recipe its own `name:`",
        )
    rows = sorted(rows, key=lambda r: r["name"])
    return {
        "schema": SCHEMA,
        "recipes": [r["name"] for r in rows],
        "best": best_recipe(rows),
        "best_by_width": best_by_width(rows),
        "best_rule": "lowest kl_mean among passing recipes; tie -> fewer bits_per_weight",
        "pareto_bits_vs_kl": pareto_front(rows),
        "best_per_column": best_per_column(rows),
        "rows": rows,
    }


# ------------------------------------------------------------------ text formats


def _fmt(v: Any, f: str) -> str:
    if v is None:
        return "–"
    if f == "mb":
        return f"{v / 1e6:.2f}"
    if isinstance(v, int) and "f" not in f and "g" not in f:
        return str(v)
    return f.format(v)


def _verdict_text(r: dict) -> str:
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


def _notes(rows: list[dict]) -> list[str]:
    return (
        [PEAK_RSS_NOTE] if any(r.get("peak_mem_kind") == "process_peak_rss" for r in rows) else []
    )


def _width_line(report: dict, fmt) -> str:
    widths = report.get("best_by_width") or {}
    if len(widths) < 2:
        return ""
    return (
        " Best per weight width: " + "; ".join(f"{w}-bit {fmt(n)}" for w, n in widths.items()) + "."
    )


def render_md(report: dict) -> str:
    rows = report["rows"]
    cols = _columns(rows)
    best = report["best_per_column"]
    pareto = set(report["pareto_bits_vs_kl"])
    head = ["recipe", *[h for _, h, _, _ in cols], "gate"]
    lines = [
        "# qship recipe comparison",
        "",
        f"Recipes: {len(rows)}. Best passing recipe (lowest mean KL, tie → fewer bits): "
        f"**{report['best'] or 'none passed'}**." + _width_line(report, lambda n: f"**{n}**"),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(cols) + ["---"]) + "|",
    ]
    for r in rows:
        cells = [r["name"].replace("|", "\\|") + (" ◆" if r["name"] in pareto else "")]
        for key, _h, f, _d in cols:
            s = _fmt(_value(r, key), f)
            cells.append(f"**{s}**" if r["name"] in best.get(key, []) else s)
        cells.append(_verdict_text(r))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bold: best in its column (ppl ratio: closest to 1). ◆: on the Pareto front of "
        "bits/weight vs mean KL. KL in nats per token, KL(reference ‖ quantized), "
        "on held-out tokens.",
        "",
    ]
    lines += [*(f"{n}\n" for n in _notes(rows))]
    return "\n".join(lines)


def csv_header(rows: list[dict]) -> list[str]:
    return (
        ["name", "recipe", "recipe_hash", "passed", *SCALARS]
        + [f"task:{t}" for t in _task_names(rows)]
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
                v = _value(r, k)
            out.append("" if v is None else (repr(v) if isinstance(v, float) else v))
        w.writerow(out)
    return buf.getvalue()


def render_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"


# ------------------------------------------------------------------ plots


def _figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(report: dict) -> bytes | None:
    """bits per weight (x) vs mean KL (y, ± stderr), passing/failing, Pareto front drawn.
    When the recipes span several weight widths (4-bit and 8-bit, say), a second panel
    zooms into the narrowest-bit cluster, where most recipes sit, and names them there."""
    rows = [
        r
        for r in report["rows"]
        if r.get("bits_per_weight") is not None and r.get("kl_mean") is not None
    ]
    if not rows:
        return None
    plt = _plt()
    low = min(r["bits_per_weight"] for r in rows)
    cluster = [r for r in rows if r["bits_per_weight"] < low + 1.0]
    zoom = len(cluster) >= 2 and len(cluster) < len(rows)
    if zoom:
        fig, (ax, az) = plt.subplots(1, 2, figsize=(12.0, 4.8), width_ratios=[1, 1.4])
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
    _draw_pareto(ax, rows, report, legend=True)
    if zoom:
        others = [r for r in rows if r not in cluster]
        _label_points(ax, others, report["best"])
        ax.annotate(
            f"{len(cluster)} recipes, see the right panel",
            (low, max(r["kl_mean"] for r in cluster)),
            xytext=(10, 10),
            textcoords="offset points",
            fontsize=8,
        )
        _draw_pareto(az, cluster, report, legend=False)
        az.set_title(f"zoom: the {int(low)}-bit recipes")
        _label_points(az, cluster, report["best"])
    else:
        _label_points(ax, rows, report["best"])
    fig.tight_layout()
    return _figure_png(fig)


def _draw_pareto(ax, rows: list[dict], report: dict, *, legend: bool) -> None:
    front = [n for n in report["pareto_bits_vs_kl"] if any(r["name"] == n for r in rows)]
    by = {r["name"]: r for r in rows}
    if len(front) > 1:
        fx = [by[n]["bits_per_weight"] for n in front]
        fy = [by[n]["kl_mean"] for n in front]
        ax.step(fx, fy, where="post", color="0.55", lw=1.2, ls="--", zorder=1, label="Pareto front")
    for status, color, marker in (
        (True, "tab:green", "o"),
        (False, "tab:red", "X"),
        (None, "tab:gray", "s"),
    ):
        sel = [r for r in rows if r.get("passed") is status]
        if not sel:
            continue
        label = {True: "gate passed", False: "gate failed", None: "no verdict"}[status]
        ax.errorbar(
            [r["bits_per_weight"] for r in sel],
            [r["kl_mean"] for r in sel],
            yerr=[r.get("kl_stderr") or 0.0 for r in sel],
            fmt=marker,
            color=color,
            ms=8,
            capsize=3,
            zorder=3,
            label=label,
        )
    for r in rows:
        if r["name"] in front:
            ax.scatter(
                [r["bits_per_weight"]],
                [r["kl_mean"]],
                s=260,
                facecolors="none",
                edgecolors="k",
                linewidths=1.0,
                zorder=2,
            )
    ax.set_xlabel("bits per weight (quantized Linear layers)")
    ax.set_ylabel("mean KL(ref ‖ quant), nats/token")
    ax.set_title("Quality vs size: lower-left is better")
    xs = [r["bits_per_weight"] for r in rows]
    span = max(xs) - min(xs)
    pad = span * 0.15 if span > 0 else 0.25
    ax.set_xlim(min(xs) - pad, max(xs) + pad * 4)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if legend:
        ax.scatter([], [], s=120, facecolors="none", edgecolors="k", label="on the front")
        ax.legend(fontsize=8, loc="best")


def _label_points(ax, rows: list[dict], best: str | None) -> None:
    """Name every point, to its right; labels of points close on screen are stacked at
    least one text line apart (greedy, in display pixels) so none overlap."""
    fig = ax.figure
    fig.canvas.draw()  # fixes the limits and hence the data -> pixel transform
    pts = []
    for r in rows:
        x, y = ax.transData.transform((r["bits_per_weight"], r["kl_mean"]))
        pts.append([x, y, y, r])  # x px, y px, label y px, row
    line = 12.0 * fig.dpi / 72.0  # a text line of 8 pt plus leading, in pixels
    pts.sort(key=lambda p: (-p[1], p[0]))  # top to bottom
    placed: list[list] = []
    for p in pts:
        for q in placed:
            if abs(q[0] - p[0]) < 70 and q[2] - p[2] < line:
                p[2] = q[2] - line
        placed.append(p)
    for x, y, ly, r in placed:
        ax.annotate(
            r["name"] + (" ★" if r["name"] == best else ""),
            ax.transData.inverted().transform((x, y)),
            xytext=((x + 15) * 72.0 / fig.dpi, ly * 72.0 / fig.dpi),
            va="center",
            textcoords="figure points",  # dpi-independent: savefig may use another dpi
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6} if abs(ly - y) > 1 else None,
        )


def plot_kl_distribution(report: dict) -> bytes | None:
    """Per-token KL distribution of each recipe: log-binned density, one line per recipe;
    recipes without a histogram are drawn as their quantiles (median, p90, p99, p99.9, max)."""
    rows = report["rows"]
    if not any(r.get("kl_hist") or r.get("kl_median") is not None for r in rows):
        return None
    plt = _plt()
    many = len(report["rows"]) > 10  # more rows than the default cycle has colours
    fig, ax = plt.subplots(figsize=(9.6, 4.8) if many else (6.8, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if many:
        colors = [plt.get_cmap("tab20")(i) for i in range(20)]
    for i, r in enumerate(rows):
        c = colors[i % len(colors)]
        h = r.get("kl_hist")
        if h:
            counts = np.asarray(h["counts"], dtype=np.float64)
            edges = np.asarray(h["edges"], dtype=np.float64)
            total = counts.sum() + h.get("zero", 0)
            if total > 0:
                frac = counts / total
                ax.stairs(frac, edges, color=c, lw=1.6, label=f"{r['name']} (n={int(total)})")
        qs = [(r.get(k), k) for k in ("kl_median", "kl_p99") if r.get(k)]
        for v, k in qs:
            ax.axvline(v, color=c, lw=0.9, ls=":" if k == "kl_p99" else "-", alpha=0.8)
        if not h:
            pts = [r.get(k) for k in ("kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max")]
            pts = [p for p in pts if p]
            ax.plot(pts, [0.0] * len(pts), "|", ms=14, color=c, label=f"{r['name']} (quantiles)")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(ref ‖ quant), nats (log scale)")
    ax.set_ylabel("fraction of tokens per bin")
    ax.set_title("Per-token KL distribution (solid: median, dotted: p99)")
    ax.grid(alpha=0.3)
    if many:  # beside the axes: inside, a dozen entries hide the histograms
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
    else:
        ax.legend(fontsize=8)
    return _figure_png(fig)


# ------------------------------------------------------------------ html


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th:first-child,td:first-child,td.v{text-align:left}
td.best{font-weight:bold;background:#e6f4e6}
td.fail{color:#b00}
img{max-width:100%;height:auto;border:1px solid #eee;margin:1em 0}
code{background:#f4f4f4;padding:1px 4px}
"""


def render_html(report: dict, images: dict[str, bytes | None]) -> str:
    """A single self-contained page: inline CSS, PNGs as data: URIs, no external reference."""
    e = html.escape
    rows = report["rows"]
    cols = _columns(rows)
    best = report["best_per_column"]
    pareto = set(report["pareto_bits_vs_kl"])
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>qship recipe comparison</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>qship recipe comparison</h1>",
        f"<p>{len(rows)} recipes. Best passing recipe (lowest mean KL, tie &rarr; fewer bits): "
        f"<b>{e(report['best'] or 'none passed')}</b>."
        + _width_line(report, lambda n: f"<b>{e(n)}</b>")
        + "</p>",
        "<table><thead><tr><th>recipe</th>"
        + "".join(f"<th>{e(h)}</th>" for _, h, _, _ in cols)
        + "<th>gate</th></tr></thead><tbody>",
    ]
    for r in rows:
        tds = [f'<td class="v">{e(r["name"])}{" &#9670;" if r["name"] in pareto else ""}</td>']
        for key, _h, f, _d in cols:
            cls = ' class="best"' if r["name"] in best.get(key, []) else ""
            tds.append(f"<td{cls}>{e(_fmt(_value(r, key), f))}</td>")
        cls = "v fail" if r.get("passed") is False else "v"
        tds.append(f'<td class="{cls}">{e(_verdict_text(r))}</td>')
        out.append("<tr>" + "".join(tds) + "</tr>")
    out += [
        "</tbody></table>",
        "<p>Green: best in its column (ppl ratio: closest to 1). &#9670;: on the Pareto front "
        "of bits/weight vs mean KL. KL in nats per token on held-out tokens.</p>",
        *(f"<p>{e(n)}</p>" for n in _notes(rows)),
    ]
    captions = {
        "pareto": "Bits per weight vs mean KL (the Pareto front dashed, front members circled)",
        "kl_distribution": "Per-token KL distribution of each recipe",
    }
    for key, png in images.items():
        if not png:
            continue
        b64 = base64.b64encode(png).decode("ascii")
        cap = captions.get(key, key)
        out.append(f"<h2>{e(cap)}</h2>")
        out.append(f'<img alt="{e(cap)}" src="data:image/png;base64,{b64}">')
    out.append(
        "<h2>Gate checks</h2><table><thead><tr><th>recipe</th><th>check</th>"
        "<th>value</th><th>limit</th><th>result</th></tr></thead><tbody>"
    )
    for r in rows:
        for c in r.get("checks", []):
            ok = c.get("passed")
            out.append(
                f'<tr><td class="v">{e(r["name"])}</td><td class="v">{e(str(c.get("name")))}</td>'
                f"<td>{e(str(c.get('value')))}</td><td>{e(str(c.get('limit')))}</td>"
                f'<td class="{"v" if ok else "v fail"}">{"pass" if ok else "FAIL"}</td></tr>'
            )
    out.append("</tbody></table></body></html>\n")
    return "\n".join(out)


# ------------------------------------------------------------------ all files


REPORT_FILES = (
    "compare.md",
    "compare.json",
    "compare.csv",
    "compare.html",
    "pareto.png",
    "kl_distribution.png",
)


def write_report(rows: list[dict], out_dir: Path) -> dict:
    """Write every report file into out_dir (each atomically); return the compare.json dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = summarise_rows(rows)
    images = {"pareto": plot_pareto(report), "kl_distribution": plot_kl_distribution(report)}
    for key, png in images.items():
        if png:
            atomic_write_bytes(out_dir / f"{key}.png", png)
    atomic_write_text(out_dir / "compare.json", render_json(report))
    atomic_write_text(out_dir / "compare.md", render_md(report))
    atomic_write_text(out_dir / "compare.csv", render_csv(report))
    atomic_write_text(out_dir / "compare.html", render_html(report, images))
    return report
