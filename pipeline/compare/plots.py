"""The comparison's figures: bits per weight vs mean KL (with the Pareto front), the
per-token KL distribution of each recipe, each benchmark's accuracy drop vs mean KL, and
`qship tune`'s frontier. PNG bytes, deterministic (no timestamp); None without matplotlib
(a bare GPU host): the tables and JSON carry the same figures."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import numpy as np


def _figure(fn: Callable[..., bytes | None]) -> Callable[..., bytes | None]:
    """A figure function that returns None when matplotlib is not installed."""

    @functools.wraps(fn)
    def draw(*args: Any, **kwargs: Any) -> bytes | None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return None
        return fn(*args, **kwargs)

    return draw


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


@_figure
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


@_figure
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


@_figure
def plot_speed(report: dict) -> bytes | None:
    """Served speed-up over the 16-bit reference (y) vs mean KL (x, log): one panel per
    workload, the Pareto front of the passing recipes drawn (faster and closer), each point's
    bar the speed-up's range over every pair of passes (a small model's spread up to ±20 %)."""
    from .report import speedup_range, value, workloads

    rows = [r for r in report["rows"] if r.get("speed") and r.get("kl_mean")]
    wls = workloads(rows)
    if not wls:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(wls), figsize=(5.4 * len(wls), 4.4), squeeze=False)
    for ax, w in zip(axes[0], wls, strict=True):
        pts = sorted((r["kl_mean"], value(r, f"speed:{w}"), r) for r in rows
                     if value(r, f"speed:{w}") is not None)  # fmt: skip
        front, best = [], -1.0
        for kl, sp, r in pts:  # ascending KL: a point is on the front if it is faster
            if r.get("passed") and not r.get("refused") and sp > best:
                front.append((kl, sp))
                best = sp
        for kl, sp, r in pts:
            ok = r.get("passed") and not r.get("refused")
            ax.scatter([kl], [sp], s=36, color="C0" if ok else "C3", marker="o" if ok else "x")
            lo, hi = speedup_range(r, w)
            if hi > lo:
                ax.errorbar([kl], [sp], yerr=[[sp - lo], [hi - sp]], fmt="none",
                            ecolor="C0" if ok else "C3", elinewidth=0.9, capsize=3, alpha=0.7)  # fmt: skip
            ax.annotate(r["name"], (kl, sp), xytext=(4, 3), textcoords="offset points", fontsize=7)
        if front:
            ax.plot(*zip(*front, strict=True), "-", color="C0", alpha=0.5, lw=1.2)
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        # within a decade matplotlib labels every minor tick (they overlapped); room for names
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.margins(x=0.2)
        ax.set_xlabel("mean KL(ref ‖ quant), nats (log)")
        ax.set_ylabel("output tokens/s vs 16-bit (x)")
        ax.set_title(w, fontsize=10)
        ax.grid(alpha=0.3)
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "")
    fig.suptitle(f"Served speed-up vs quality ({gpu}); x: failed its gate; bars: the range "
                 "over every pair of passes", fontsize=10)  # fmt: skip
    return _figure_png(fig)


@_figure
def plot_task_drops(report: dict) -> bytes | None:
    """Accuracy drop (pp, paired 95 % interval) vs mean KL: one series per benchmark, one
    point per recipe. Does the cheap KL rank recipes as the benchmarks do?"""
    rows = [r for r in report["rows"] if r.get("tasks") and r.get("kl_mean") is not None]
    tasks = sorted({t for r in rows for t in r["tasks"]})
    if not tasks:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for i, t in enumerate(tasks):
        pts = [(r["kl_mean"], r["tasks"][t], (r.get("task_ci") or {}).get(t), r["name"])
               for r in rows if r["tasks"].get(t) is not None]  # fmt: skip
        pts.sort()
        x = [p[0] for p in pts]
        y = [p[1] for p in pts]
        err = [[p[1] - p[2][0] if p[2] else 0.0 for p in pts],
               [p[2][1] - p[1] if p[2] else 0.0 for p in pts]]  # fmt: skip
        ax.errorbar(x, y, yerr=err, fmt="o-", ms=4, lw=1.0, capsize=3, label=t,
                    alpha=0.85, color=f"C{i % 10}")  # fmt: skip
    names = {r["name"]: r["kl_mean"] for r in rows}
    for n, k in names.items():
        ax.annotate(n, (k, ax.get_ylim()[1]), xytext=(0, -8), textcoords="offset points",
                    rotation=90, fontsize=7, va="top", ha="center", color="0.4")  # fmt: skip
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("mean KL(ref ‖ quant) on held-out tokens, nats (log scale)")
    ax.set_ylabel("accuracy drop, percentage points (+ = worse)")
    ax.set_title("Benchmark accuracy drop vs mean KL (bars: paired 95 % interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _figure_png(fig)


@_figure
def plot_tune(
    frontier: list[tuple[float, float]],
    scale: float,
    verified: list[dict],
    max_bits: float | None,
    max_kl: float | None,
) -> bytes | None:
    """`qship tune`: the knapsack's predicted frontier (bits per weight vs summed module KL,
    scaled to verified KL), the budget, and every recipe verified end to end."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if frontier:
        xs, ys = zip(*frontier, strict=True)
        ax.plot(xs, np.array(ys) * scale, "-", color="0.6",
                label=f"predicted (sum of module KL x {scale:.3g})")  # fmt: skip
    for v in verified:
        if v.get("bits_per_weight") is None or v.get("kl_mean") is None:
            continue
        ax.errorbar(v["bits_per_weight"], v["kl_mean"], yerr=v.get("kl_stderr") or 0, fmt="o")
        ax.annotate(v["name"], (v["bits_per_weight"], v["kl_mean"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    if max_bits is not None:
        ax.axvline(max_bits, ls="--", color="tab:red", lw=1, label=f"--max-bits {max_bits}")
    if max_kl is not None:
        ax.axhline(max_kl, ls=":", color="tab:red", lw=1, label=f"--max-kl {max_kl}")
    ax.set_xlabel("bits per quantized weight")
    ax.set_ylabel("mean KL (nats)")
    ax.set_title("qship tune: predicted frontier and verified recipes")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _figure_png(fig)
