"""Every file of a comparison report, each written atomically."""

from __future__ import annotations

from pathlib import Path

from ..io.atomic import atomic_write_bytes, atomic_write_text
from .html import render_html
from .plots import plot_kl_distribution, plot_pareto, plot_speed, plot_task_drops
from .render import render_csv, render_json, render_md
from .report import summarise_rows

REPORT_FILES = (
    "compare.md",
    "compare.json",
    "compare.csv",
    "compare.html",
    "pareto.png",
    "kl_distribution.png",
    "task_drop_vs_kl.png",  # only when benchmarks ran
)
PERF_FILES = ("speed_vs_kl.png",)  # with served performance (compare --serve vllm)


def write_report(rows: list[dict], out_dir: Path) -> dict:
    """Write every report file into out_dir; return the compare.json dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = summarise_rows(rows)
    images = {"pareto": plot_pareto(report), "kl_distribution": plot_kl_distribution(report),
              "task_drop_vs_kl": plot_task_drops(report),
              "speed_vs_kl": plot_speed(report)}  # fmt: skip
    for key, png in images.items():
        if png:
            atomic_write_bytes(out_dir / f"{key}.png", png)
    atomic_write_text(out_dir / "compare.json", render_json(report))
    atomic_write_text(out_dir / "compare.md", render_md(report))
    atomic_write_text(out_dir / "compare.csv", render_csv(report))
    atomic_write_text(out_dir / "compare.html", render_html(report, images))
    return report
