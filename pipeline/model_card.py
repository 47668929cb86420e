"""The artifact's model card, README.md: Hub front matter, results, verdict, how to load.

Rendered from plain dicts only (no clock, no environment), so the same inputs give the
same bytes.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.6g}"
    if v is None:
        return "–"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _flatten(d: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    rows = []
    for k in sorted(d):
        if depth == 0 and k in ("probe", "verdict"):
            continue
        v = d[k]
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth < 2:
            rows += _flatten(v, key + ".", depth + 1)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            rows.append((key, v))
    return rows


def quant_tags(quantization_config: dict) -> list[str]:
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


def render(
    *,
    name: str,
    base_model: str | None,
    license: str | None,
    recipe_name: str,
    recipe_sha256: str,
    quantization_config: dict,
    eval_json: dict,
    verdict: dict,
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
        f"Quantized from `{base_model or 'unknown'}` by qship with recipe `{recipe_name}` "
        f"(sha256 `{recipe_sha256[:16]}`), format `{quantization_config.get('format', '?')}` "
        f"({quantization_config.get('quant_method', '?')}).",
        "",
    ]
    passed = bool(verdict.get("passed"))
    lines += [f"## Quality gate: {'PASSED' if passed else 'FAILED'}", ""]
    checks = verdict.get("checks") or []
    if checks:
        lines += ["| check | value | limit | passed |", "|---|---|---|---|"]
        for c in checks:
            lines.append(
                f"| {_fmt(c.get('name'))} | {_fmt(c.get('value'))} | {_fmt(c.get('limit'))} "
                f"| {_fmt(c.get('passed'))} |"
            )
        lines.append("")
    rows = _flatten(eval_json)
    if rows:
        lines += ["## Results", "", "| metric | value |", "|---|---|"]
        lines += [f"| {_fmt(k)} | {_fmt(v)} |" for k, v in rows[:60]]
        lines.append("")
    kv = quantization_config.get("kv_cache_scheme")
    kv_arg = ', kv_cache_dtype="fp8"'
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
        "vLLM with the FP8 KV cache"
        + (
            " (its static per-tensor scales are stored in this checkpoint):"
            if kv
            else " (this checkpoint stores no KV scales, so vLLM uses scale 1.0):"
        ),
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f'llm = LLM(model="PATH_OR_REPO"{kv_arg})',
        'print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text)',
        "```",
        "",
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
