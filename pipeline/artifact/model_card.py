"""The artifact's model card, README.md: Hub front matter, the gate, the figures, how to load.

Rendered from the records only (no clock, no environment), so the same inputs give the
same bytes.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from ..recipe import Recipe
from ..records.evaluation import EvalFile


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.6g}"
    if v is None:
        return "–"
    return str(v).replace("|", "\\|").replace("\n", " ")


def quant_tags(quantization_config: dict[str, Any]) -> list[str]:
    tags = set()
    if quantization_config.get("quant_method") == "compressed-tensors":
        tags.add("compressed-tensors")
    for g in (quantization_config.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        if w.get("type") == "int" and w.get("num_bits"):
            tags.add(f"int{w['num_bits']}")
        if w.get("type") == "float" and w.get("num_bits") == 8:
            tags.add("fp8")
    if quantization_config.get("kv_cache_scheme"):
        tags.add("fp8-kv-cache")
    return sorted(tags)


def _results(ev: EvalFile) -> list[str]:
    m, c = ev.metrics, ev.corpus
    rows = [
        ("KL(reference ‖ quantized), mean ± stderr", f"{_fmt(m.kl.mean)} ± {_fmt(m.kl.stderr)}"),
        ("KL median / p99 / max", f"{_fmt(m.kl.median)} / {_fmt(m.kl.p99)} / {_fmt(m.kl.max)}"),
        ("top-1 agreement", _fmt(m.top1_agreement)),
        ("perplexity reference → quantized", f"{_fmt(m.ppl_reference)} → {_fmt(m.ppl_candidate)}"),
        ("perplexity ratio", _fmt(m.ppl_ratio)),
    ]
    if ev.metrics_weights_only:
        rows.append(("KL mean with the KV cache in 16-bit", _fmt(ev.metrics_weights_only.kl.mean)))
    if ev.quantize:
        rows.append(("bits per quantized weight", _fmt(ev.quantize.bits_per_weight)))
    lines = [
        "## Results",
        "",
        f"Held-out tokens: {c.sequences} × {c.seq_len} ({c.tokens_scored} scored, "
        f"KL mode {m.kl_mode}), never used for calibration.",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    tasks = {n: t for n, t in sorted(ev.benchmarks.tasks.items()) if t.status == "ok"}
    if tasks:
        lines += ["| benchmark (lm-eval) | result |", "|---|---|"]
        lines += [f"| {n} | {t.describe()} |" for n, t in tasks.items()]
        lines.append("")
    return lines


def render(
    *,
    name: str,
    base_model: str | None,
    license: str | None,
    recipe: Recipe,
    quantization_config: dict[str, Any],
    evaluation: EvalFile,
) -> str:
    front = {
        "base_model": base_model or "unknown",
        "license": license or "other",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["qship", "quantized", *quant_tags(quantization_config)],
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=True).rstrip(), "---", ""]
    lines += [f"# {name}", ""]
    lines += [
        f"Quantized from `{base_model or 'unknown'}` by qship with recipe `{recipe.name}` "
        f"(sha256 `{recipe.hash()[:16]}`), format `{quantization_config.get('format', '?')}` "
        f"({quantization_config.get('quant_method', '?')}).",
        "",
    ]
    v = evaluation.verdict
    if v is not None:
        lines += [f"## Quality gate: {'PASSED' if v.passed else 'FAILED'}", ""]
        if v.checks:
            lines += ["| check | value | limit | passed |", "|---|---|---|---|"]
            for ch in v.checks:
                lines.append(
                    f"| {_fmt(ch.name)} | {_fmt(ch.value)} | {ch.op} {_fmt(ch.limit)} "
                    f"| {_fmt(ch.passed)} |"
                )
            lines.append("")
    lines += _results(evaluation)
    kv = quantization_config.get("kv_cache_scheme")
    lines += [
        "## Use",
        "",
        "transformers (decompresses the int weights on load):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", device_map="auto")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")',
        "```",
        "",
        *(_vllm_use(kv is not None)),
        *_served(evaluation),
        "## Integrity",
        "",
        "Every file is listed in `SHA256SUMS` (`sha256sum -c SHA256SUMS`); `qship verify .` "
        "checks it, the safetensors headers against `config.json`, and the signature "
        "`model.sig` when present (`--pubkey KEY.pem`). Provenance: `provenance.json`.",
        "",
        "<details><summary>quantization_config</summary>",
        "",
        "```json",
        json.dumps(quantization_config, indent=2, sort_keys=True),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def _vllm_use(fp8_kv: bool) -> list[str]:
    """How vLLM serves this checkpoint: `kv_cache_dtype="auto"` takes the checkpoint's
    kv_cache_scheme, i.e. FP8 with the stored scales (and the query rounded to FP8 with
    scale 1.0 on CUDA, which the evaluation above simulates)."""
    if fp8_kv:
        say = ("vLLM serves it with the FP8 KV cache and the stored per-tensor K/V scales: "
               '`kv_cache_dtype="auto"` (the default) takes the checkpoint\'s kv_cache_scheme; '
               '`kv_cache_dtype="bfloat16"` serves a 16-bit KV cache instead (not what was '
               "measured). On CUDA vLLM also rounds the query to FP8 (scale 1.0); the KL above "
               "is measured with that rounding.")  # fmt: skip
    else:
        say = ('vLLM serves it with a 16-bit KV cache: keep `kv_cache_dtype="auto"` (or '
               '"bfloat16"); this checkpoint stores no KV scales.')  # fmt: skip
    return [say, "", "```python", "from vllm import LLM, SamplingParams", "",
            'llm = LLM(model="PATH_OR_REPO")  # kv_cache_dtype="auto"',
            'print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text)',
            "```", ""]  # fmt: skip


def _served(ev: EvalFile) -> list[str]:
    s = ev.served
    if s is None:
        if ev.served_skipped:
            return [f"Served check: not run ({ev.served_skipped}).", ""]
        return []
    rows = [("served vs measured", s.served_vs_measured),
            ("served vs reference", s.served_vs_reference),
            ("measured vs reference", s.measured_vs_reference)]  # fmt: skip
    out = [f"## Served check: {'PASSED' if s.passed else 'FAILED'} ({s.engine}, "
           f"kv_cache_dtype={s.kv_cache_dtype})", "",
           "| compared | KL mean | KL p99 | top-1 |", "|---|---|---|---|"]  # fmt: skip
    out += [f"| {n} | {f.kl_mean:.4g} | {f.kl_p99:.4g} | {f.top1:.4f} |" for n, f in rows]
    out += ["", f"Served KL to the reference: {s.served_kl_increase:+.1%} vs the measured "
            f"(top-{ev.measured.topk if ev.measured else '?'} + tail, {s.positions} positions).",
            ""]  # fmt: skip
    return out
