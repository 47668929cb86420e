"""The recipe comparison report: per-recipe rows -> the report dict (selections, columns,
recommendation) that render.py writes as compare.md / .json / .csv, plots.py and html.py
as the rest.

Pure: rows in, a dict out; it runs no model. rows.py builds the rows from eval.json records
(in process, or from the eval.json files of CI jobs); output.py writes every file.

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
    greedy_identical greedy_first_diff   share of greedy continuations identical to the
                     reference's, mean position of the first differing token (None: not
                     measured)
    tasks            {task: drop}           benchmark accuracy drop vs the reference, pp
    task_ci          {task: [lo, hi]}       its paired 95 % interval, pp
    kl_hist          {"edges": [...], "counts": [...], "zero": n} per-token KL histogram on
                     the fixed log bins KL_HIST_EDGES (None when no per-token values exist)
    source           where the row came from (eval.json path), informative only
    baseline         a row without a recipe (compare/baseline.py: bitsandbytes NF4, int8):
                     what it is, not servable by vLLM's fast kernels, or why it was not
                     measured here; None for a recipe. It has no gate: never recommended
    refused          why today's rules refuse this recipe (e.g. its plan splits a fused
                     set vLLM loads as one layer), or None: a refused row is shown, never
                     recommended
    formats          its weight/activation formats ("W4A16", "W8A8-FP8, W4A16")
    speed            {workload: {speedup, output_tok_s, ttft_p99_ms, tpot_p50_ms}} served
                     through vLLM's benchmark beside the 16-bit reference (`--serve vllm`)
    gpu              the GPU and engine the speed was measured on
    weights_gib kv_cache_tokens   served weight memory and KV-cache capacity

"Best" recipe (the one CI publishes): lowest mean KL among the recipes whose gate passed;
a tie goes to fewer bits per weight, then to the name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import UsageError
from ..recipe import GATE_FIGURES

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
    # greedy continuations identical to the reference's, and where the first one differs
    ("greedy_identical", "greedy same", "{:.2f}", "max"),
    ("greedy_first_diff", "first diff at", "{:.1f}", "max"),
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
    "greedy_identical",
    "greedy_first_diff",
]


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


def _eligible(rows: list[dict]) -> list[dict]:
    """Rows that may be recommended: the gate passed and no current rule refuses them."""
    return [r for r in rows if r.get("passed") is True and r.get("kl_mean") is not None
            and not r.get("refused")]  # fmt: skip


def best_recipe(rows: list[dict]) -> str | None:
    """Lowest mean KL among passing recipes; tie -> fewer bits per weight, then name."""
    ok = _eligible(rows)
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


def budget(bits: float) -> float:
    """The bit budget a row falls in: its bits rounded up to a quarter bit (4.125 and 4.248
    -> 4.25, 4.313 -> 4.5, 8.02 -> 8.25)."""
    return math.ceil(bits * 4 - 1e-9) / 4


def goals(rows: list[dict]) -> dict[str, str]:
    """{goal: recipe name}: the smallest recipe that passes its gate, and the lowest mean KL
    within each bit budget the rows span (`lowest_kl_at_4.25_bits`), refused rows left out."""
    ok = [r for r in _eligible(rows) if r.get("bits_per_weight") is not None]
    if not ok:
        return {}
    out = {"smallest_passing": min(ok, key=lambda r: (r["bits_per_weight"], r["kl_mean"],
                                                      r["name"]))["name"]}  # fmt: skip
    for b in sorted({budget(r["bits_per_weight"]) for r in ok}):
        within = [r for r in ok if r["bits_per_weight"] <= b]
        best = min(within, key=lambda r: (r["kl_mean"], r["bits_per_weight"], r["name"]))
        out[f"lowest_kl_at_{b:g}_bits"] = best["name"]
    return out


def _said(r: dict) -> str:
    se = r.get("kl_stderr")
    kl = f"{r['kl_mean']:.3g}" + (f" ± {se:.1g}" if se else "")
    return f"**{r['name']}** ({r['bits_per_weight']:.3f} bits/weight, mean KL {kl})"


# The shipped recipes that won on the quality frontier (bench/RESULTS.md) and when to pick
# each; the report names those it compared, and `qship tune` when no tuned recipe was there
WINNERS = {
    "autoround-w4a": "the least KL of one portable 4-bit recipe (4.16 bits; AutoRound "
    "calibrates ~25x longer than GPTQ)",
    "gptq-w4a-mse": "GPTQ's speed, portable; the base `qship tune` starts from",
    "autoround-w4a-tune4.249-nokv": "the least KL within 4.25 bits on Gemma 3 270M (16-bit "
    "KV cache; recipes/models/gemma-3-270m)",
    "gptq-w4a-imatrix-tune4.249": "the least KL within 4.25 bits on Gemma 3 270M with an FP8 "
    "KV cache (recipes/models/gemma-3-270m)",
    "gptq-w4-mse-kvhead-q-skip5": "a model whose FP8 KV cache costs much of its KL, at "
    "gptq-w4's bits (Qwen2.5-Coder-0.5B: 26 % below gptq-w4)",
}
TUNED = re.compile(r"-tune\d")  # the names `qship tune` gives its recipes: <base>-tune4.248


def recommendation(report: dict) -> str:
    """Plain words per goal (the smallest recipe that passes; the lowest KL within each bit
    budget), the shipped winners among the rows, and the rows no one should ship."""
    by_name = {r["name"]: r for r in report["rows"]}
    names = {n for n, r in by_name.items() if not r.get("refused")}
    picks = [f"{n} for {why}" for n, why in WINNERS.items() if n in names]
    g = report.get("goals") or {}
    if not g:
        text = "No recipe passed its gate."
    else:
        said = [f"Smallest that passes its gate: {_said(by_name[g['smallest_passing']])}."]
        said += [f"Lowest KL at ≤ {k.split('_at_')[1].removesuffix('_bits')} bits: "
                 f"{_said(by_name[n])}." for k, n in g.items() if k.startswith("lowest_kl_at_")]  # fmt: skip
        text = " ".join(said)
    refused = sorted(n for n, r in by_name.items() if r.get("refused"))
    if refused:
        text += (" Not to ship, whatever their figures: " + "; ".join(
            f"{n} ({by_name[n]['refused']})" for n in refused) + ".")  # fmt: skip
    text += baseline_words(report["rows"])
    if picks:
        text += " Shipped winners here: " + "; ".join(picks) + "."
    text += speed_words(report)
    if not any(TUNED.search(n) for n in names):
        text += (" For the least KL within a bit budget on this model: `qship tune --recipe "
                 "recipes/gptq-w4a-mse.yaml --max-bits 4.25 --write-recipe R.yaml`.")  # fmt: skip
    return text


def baseline_words(rows: list[dict]) -> str:
    """What the team would get without qship: each baseline's mean KL and bits, or why it
    was not measured; baselines are not servable by vLLM's fast kernels, so never picked."""
    said = []
    for r in rows:
        if not r.get("baseline"):
            continue
        if r.get("kl_mean") is None:
            said.append(f"{r['name']} {r['baseline']}")
        else:
            said.append(f"{r['name']} ({r['bits_per_weight']:.3f} bits/weight, mean KL "
                        f"{r['kl_mean']:.3g}; not servable by vLLM's fast kernels)")  # fmt: skip
    return (" Without qship (baselines, no gate): " + "; ".join(said) + ".") if said else ""


def task_names(rows: list[dict]) -> list[str]:
    return sorted({t for r in rows for t in (r.get("tasks") or {})})


def workloads(rows: list[dict]) -> list[str]:
    """The served-performance workloads measured in any row, in first-seen order."""
    out: list[str] = []
    for r in rows:
        out += [w for w in (r.get("speed") or {}) if w not in out]
    return out


def columns(rows: list[dict]) -> list[tuple[str, str, str, str | None]]:
    cols: list[tuple[str, str, str, str | None]] = []
    if any(r.get("formats") for r in rows):
        cols.append(("formats", "formats", "s", None))
    cols += [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    cols += [(f"task:{t}", f"{t} drop pp", "{:+.2f}", "min") for t in task_names(rows)]
    for w in workloads(rows):
        cols.append((f"speed:{w}", f"{w} speed-up", "{:.2f}x", "max"))
    if any(r.get("weights_gib") is not None for r in rows):
        cols.append(("weights_gib", "served weights GiB", "{:.2f}", "min"))
    if any(r.get("kv_cache_tokens") is not None for r in rows):  # what a small model buys
        cols.append(("kv_cache_tokens", "KV-cache tokens", "{:d}", "max"))
    return cols


def value(row: dict, key: str) -> Any:
    if key.startswith("task:"):
        return (row.get("tasks") or {}).get(key[5:])
    if key.startswith("speed:"):
        return ((row.get("speed") or {}).get(key[6:]) or {}).get("speedup")
    return row.get(key)


def speedup_range(row: dict, workload: str) -> tuple[float, float]:
    """A measured workload's speed-up over every pair of passes (records/perf.py); the
    median alone (lo = hi) for a record without its passes."""
    rng = ((row.get("speed") or {}).get(workload) or {}).get("speedup_range")
    sp = value(row, f"speed:{workload}")
    return (rng[0], rng[1]) if rng else (sp, sp)


def fastest(rows: list[dict]) -> dict[str, str]:
    """{workload: the passing, not refused recipe with the highest speed-up}, one faster in
    every pair of passes first (a higher median inside the passes' spread does not win)."""
    out = {}
    for w in workloads(rows):
        ok = [r for r in _eligible(rows) if value(r, f"speed:{w}") is not None]

        def key(r: dict, w: str = w) -> tuple[bool, float, float]:
            return (speedup_range(r, w)[0] > 1, value(r, f"speed:{w}"), -r["kl_mean"])

        if ok:
            out[w] = max(ok, key=key)["name"]
    return out


def speed_words(report: dict) -> str:
    """ "1-stream: W4A16 g128, 1.9x, KL 0.15 -- 64-streams: FP8 dynamic, 1.3x, KL 0.01"; a
    workload where even the fastest is below 1x says that the 16-bit model serves it faster
    (a small model on a big GPU: its decode step is launches, not weight traffic), and one
    whose passes overlap the 16-bit model's says that no recipe is measurably faster."""
    by_name = {r["name"]: r for r in report["rows"]}
    parts = []
    for w, n in (report.get("fastest") or {}).items():
        r = by_name[n]
        sp = value(r, "speed:" + w)
        lo, hi = speedup_range(r, w)
        spread = f" (its passes {lo:.2f}–{hi:.2f}x)" if lo <= 1 <= hi else ""
        said = f"**{n}** ({r.get('formats') or '?'}), {sp:.2f}x{spread}, KL {r['kl_mean']:.3g}"
        if lo > 1:
            parts.append(f"{w}: {said}")
        elif hi >= 1:
            parts.append(f"{w}: none measurably faster than the 16-bit model (the fastest, {said})")
        else:
            parts.append(f"{w}: none faster than the 16-bit model (the fastest, {said})")
    if not parts:
        return ""
    gpu = next((r["gpu"] for r in report["rows"] if r.get("gpu")), "")
    return f" Fastest passing recipe per workload ({gpu}): " + " — ".join(parts) + "."


def best_per_column(rows: list[dict]) -> dict[str, list[str]]:
    """{column key: names of the rows holding the best value} (ties all marked)."""
    out: dict[str, list[str]] = {}
    for key, _h, _f, direction in columns(rows):
        if direction is None:
            continue
        vals = [(value(r, key), r["name"]) for r in rows if value(r, key) is not None]
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


# The limits a measured row supports on the model it was measured on: SUPPORT_HEADROOM more
# loss than measured (the loss: the KL itself, 1 - top-1, ppl ratio - 1), rounded up to 3
# significant digits, so that a rerun's noise does not fail it. A team sets its gates from
# these on its own model instead of inheriting the shipped recipes' (another model's).
SUPPORT_HEADROOM = 0.10
SUPPORTED_GATES = GATE_FIGURES  # gate -> (row figure, which way)


def _round_up(x: float) -> float:
    if x <= 0:
        return 0.0
    q = 10.0 ** (math.floor(math.log10(x)) - 2)
    return round(math.ceil(round(x / q, 6)) * q, 12)


def supported_limits(row: dict) -> dict[str, float]:
    """Gate name -> the limit this row's measurement supports (figures it lacks: absent)."""
    out: dict[str, float] = {}
    for gate, (key, way) in SUPPORTED_GATES.items():
        v = row.get(key)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            continue
        loss = {"max": v, "min": 1 - v, "ratio": v - 1}[way]
        room = _round_up(max(loss, 0.0) * (1 + SUPPORT_HEADROOM))
        out[gate] = {"max": room, "min": max(0.0, 1 - room), "ratio": 1 + room}[way]
        out[gate] = round(out[gate], 12)
    return out


def summarise_rows(rows: list[dict]) -> dict:
    """compare.json: rows plus the derived selections (no timestamps: same rows, same bytes)."""
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
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
        "goals": goals(rows),
        "winners_compared": [n for n in WINNERS if n in names],
        "pareto_bits_vs_kl": pareto_front(rows),
        "best_per_column": best_per_column(rows),
        "fastest": fastest(rows),
        "supported_limits": {r["name"]: supported_limits(r) for r in rows},
        "supported_limits_rule": f"{SUPPORT_HEADROOM:.0%} more loss than measured (KL; 1 - "
        "top-1; ppl ratio - 1), rounded up to 3 significant digits",
        "rows": rows,
    }
