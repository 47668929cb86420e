"""compare.html: one self-contained page (inline CSS, PNGs as data: URIs)."""

from __future__ import annotations

import base64
import html

from .render import fmt, notes, verdict_text, width_line
from .report import columns, value

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
    cols = columns(rows)
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
        + width_line(report, lambda n: f"<b>{e(n)}</b>")
        + "</p>",
        "<table><thead><tr><th>recipe</th>"
        + "".join(f"<th>{e(h)}</th>" for _, h, _, _ in cols)
        + "<th>gate</th></tr></thead><tbody>",
    ]
    for r in rows:
        tds = [f'<td class="v">{e(r["name"])}{" &#9670;" if r["name"] in pareto else ""}</td>']
        for key, _h, f, _d in cols:
            cls = ' class="best"' if r["name"] in best.get(key, []) else ""
            tds.append(f"<td{cls}>{e(fmt(value(r, key), f))}</td>")
        cls = "v fail" if r.get("passed") is False else "v"
        tds.append(f'<td class="{cls}">{e(verdict_text(r))}</td>')
        out.append("<tr>" + "".join(tds) + "</tr>")
    out += [
        "</tbody></table>",
        "<p>Green: best in its column (ppl ratio: closest to 1). &#9670;: on the Pareto front "
        "of bits/weight vs mean KL. KL in nats per token on held-out tokens.</p>",
        *(f"<p>{e(n)}</p>" for n in notes(rows)),
    ]
    captions = {
        "pareto": "Bits per weight vs mean KL (the Pareto front dashed, front members circled)",
        "kl_distribution": "Per-token KL distribution of each recipe",
        "task_drop_vs_kl": "Benchmark accuracy drop vs mean KL (paired 95 % intervals)",
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
