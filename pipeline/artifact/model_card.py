"""The artifact's model card, README.md: Hub front matter, the gate, the figures, how to load.

Rendered from the records only (no clock, no environment), so the same inputs give the
same bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

from ..recipe import KVCache, Recipe
from ..records.benchmarks import TaskResult
from ..records.evaluation import EvalFile
from ..records.snapshot import Snapshot

DECIDE_PP = 2.0  # a benchmark row "decides" when its 95% CI can show a drop this large


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.6g}"
    if v is None:
        return "–"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _sig(v: float | None, digits: int = 3) -> str:
    """`digits` significant digits (the statistics without a standard error)."""
    if v is None or not math.isfinite(v):
        return "–"
    return f"{v:.{digits}g}"


def _pm(mean: float, se: float | None) -> str:
    """mean ± standard error, rounded to the error's two significant digits."""
    if se is None or not math.isfinite(se) or se <= 0:
        return _sig(mean)
    decimals = max(0, 1 - math.floor(math.log10(se)))
    return f"{mean:.{decimals}f} ± {se:.{decimals}f}"


def base_model(source: Snapshot | None) -> str | None:
    """The Hub id of the model the reference is (hf://) or was made from (a pinned GGUF
    whose pin names it); None for a local checkpoint."""
    if source is None:
        return None
    if source.source.startswith("hf://"):
        return source.repo_id
    gguf = source.checks.get("gguf")
    return gguf.get("base_model") if isinstance(gguf, dict) else None


def reference_text(source: Snapshot | None) -> str:
    """What the figures are measured against, in one paragraph."""
    if source is None:
        return "Reference: the unquantized checkpoint it was packaged from."
    gguf = source.checks.get("gguf")
    if isinstance(gguf, dict):
        about = gguf.get("about") or "a GGUF file"
        return (f"Reference: `{gguf.get('file')}` ({about}), dequantized to bfloat16 by qship "
                f"(model hash `{source.model_hash[:16]}`). Every figure below is measured "
                "against that dequantized model, not against the original 16-bit release: "
                "the GGUF was already quantized, so the error against the original is larger.")  # fmt: skip
    where = (f"`{source.repo_id}` at commit `{source.revision}`" if source.source.startswith("hf://")
             else f"the local checkpoint `{source.repo_id}`")  # fmt: skip
    return (
        f"Reference: {where} in its own dtype (model hash `{source.model_hash[:16]}`); "
        "every figure below is measured against it."
    )


def task_row(t: TaskResult) -> str:
    """A benchmark row: both scores and the drop, or -- when its 95% CI is too wide to see a
    DECIDE_PP drop -- the scores and how many items would decide."""
    if t.ci95_pp is None or t.drop_pp is None or t.n is None or t.reference is None \
            or t.candidate is None:  # fmt: skip
        return t.describe()
    lo, hi = t.ci95_pp
    half = (hi - lo) / 2
    if half <= DECIDE_PP:
        return t.describe()
    need = math.ceil(t.n * (half / DECIDE_PP) ** 2)
    return (f"{t.metric} {100 * t.reference.value:.0f}% -> {100 * t.candidate.value:.0f}% on "
            f"{t.n} items: too few to decide (95% CI ±{half:.0f} pp; about {need} items "
            f"would show a {DECIDE_PP:.0f} pp drop)")  # fmt: skip


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
        a = (g or {}).get("input_activations") or {}
        if a.get("num_bits") == 8:
            tags.add("w8a8" if w.get("num_bits") == 8 else f"w{w.get('num_bits')}a8")
    if quantization_config.get("kv_cache_scheme"):
        tags.add("fp8-kv-cache")
    return sorted(tags)


def _results(ev: EvalFile) -> list[str]:
    m, c = ev.metrics, ev.corpus
    rows = [
        ("KL(reference ‖ quantized), mean ± stderr", _pm(m.kl.mean, m.kl.stderr)),
        ("KL median / p99 / max", f"{_sig(m.kl.median)} / {_sig(m.kl.p99)} / {_sig(m.kl.max)}"),
        ("top-1 agreement", _sig(m.top1_agreement)),
        (
            "perplexity reference → quantized",
            f"{_sig(m.ppl_reference, 4)} → {_sig(m.ppl_candidate, 4)}",
        ),
        ("perplexity ratio", _sig(m.ppl_ratio, 4)),
    ]
    if ev.metrics_weights_only:
        w = ev.metrics_weights_only.kl
        rows.append(("KL mean with the KV cache in 16-bit", _pm(w.mean, w.stderr)))
    if ev.quantize:
        rows.append(("bits per quantized weight", f"{ev.quantize.bits_per_weight:.3f}"))
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
        lines += [f"| {n} | {task_row(t)} |" for n, t in tasks.items()]
        lines.append("")
    return lines


def render(
    *,
    name: str,
    source: Snapshot | None,
    recipe: Recipe,
    quantization_config: dict[str, Any],
    evaluation: EvalFile,
    dense_bytes: int | None = None,
    dtype: str = "bfloat16",
) -> str:
    lines = _header(name, source, recipe, quantization_config)
    lines += _size(evaluation, dense_bytes, dtype)
    lines += [reference_text(source), ""]
    lines += _gate(evaluation)
    lines += _results(evaluation)
    lines += _use(recipe, quantization_config, evaluation)
    return "\n".join(lines)


def _header(
    name: str, source: Snapshot | None, recipe: Recipe, quantization_config: dict[str, Any]
) -> list[str]:
    """The Hub's front matter, the title and what the model was made from, and how."""
    base = base_model(source)
    license = source.license if source else None
    front = {
        **({"base_model": base} if base else {}),
        "license": license or "other",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["qship", "quantized", *quant_tags(quantization_config)],
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=True).rstrip(), "---", ""]
    lines += [f"# {name}", ""]
    made_from = base or (source.repo_id if source else None) or "a local checkpoint"
    lines += [
        f"Quantized from `{made_from}` by qship with recipe `{recipe.name}` "
        f"(sha256 `{recipe.hash()[:16]}`), format `{quantization_config.get('format', '?')}` "
        f"({quantization_config.get('quant_method', '?')}).",
        "",
    ]
    if recipe.description:
        lines += [f"Recipe: {recipe.description}", ""]
    return lines


def _size(evaluation: EvalFile, dense_bytes: int | None, dtype: str) -> list[str]:
    """The weights' size against the dense model's, and the W4A8 note."""
    lines: list[str] = []
    q = evaluation.quantize
    if q is not None and dense_bytes:
        lines += [f"Size: {q.size_bytes / 1e6:,.0f} MB of weights against {dense_bytes / 1e6:,.0f} "
                  f"MB in {dtype} ({q.size_bytes / dense_bytes:.0%}; {q.bits_per_weight:.3f} "
                  "bits per quantized weight).", ""]  # fmt: skip
    if q is not None and q.served_rounding_modules:
        lines += [f"W4A8: the int4 values of its {q.served_rounding_modules} W4A8 Linears "
                  "were chosen (by GPTQ, or nearest for RTN) for the weights vLLM's CUTLASS "
                  "W4A8 kernel (Hopper) serves, FP8 group scales and FP8-rounded products; "
                  "the figures below are computed that way. An engine that computes q × scale "
                  "exactly serves slightly other weights.", ""]  # fmt: skip
    return lines


def _gate(evaluation: EvalFile) -> list[str]:
    """The quality gate's verdict and its checks."""
    v = evaluation.verdict
    if v is None:
        return []
    lines = [f"## Quality gate: {'PASSED' if v.passed else 'FAILED'}", ""]
    if v.checks:
        lines += ["| check | value | limit | passed |", "|---|---|---|---|"]
        for ch in v.checks:
            lines.append(
                f"| {_fmt(ch.name)} | {_fmt(ch.value)} | {ch.op} {_fmt(ch.limit)} "
                f"| {_fmt(ch.passed)} |"
            )
        lines.append("")
    return lines


def _use(recipe: Recipe, quantization_config: dict[str, Any], evaluation: EvalFile) -> list[str]:
    """How to load and serve it, the served checks, integrity, the quantization_config."""
    kv = quantization_config.get("kv_cache_scheme")
    return [
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
        *_vllm_use((recipe.kv_cache or KVCache()) if kv is not None else None),
        *_served(evaluation),
        *_perf(evaluation),
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


def _vllm_use(kv: KVCache | None) -> list[str]:
    """How vLLM serves this checkpoint: `kv_cache_dtype="auto"` takes the checkpoint's
    kv_cache_scheme, i.e. FP8 with the stored scales (and the query rounded to FP8 with its
    calibrated scale, or 1.0, on CUDA, which the evaluation above simulates); the layers the
    recipe keeps 16-bit need vLLM's skip flag, which it does not read from the checkpoint."""
    args = ""
    if kv is not None:
        per = "per KV head" if kv.strategy == "attn_head" else "per tensor"
        query = "its calibrated scale" if kv.query else "scale 1.0"
        say = (f"vLLM serves it with the FP8 KV cache and the stored K/V scales ({per}): "
               '`kv_cache_dtype="auto"` (the default) takes the checkpoint\'s kv_cache_scheme; '
               '`kv_cache_dtype="bfloat16"` serves a 16-bit KV cache instead (not what was '
               f"measured). On CUDA vLLM also rounds the query to FP8 ({query}); the KL above "
               "is measured with that rounding.")  # fmt: skip
        if kv.skip_layers:
            skip = kv.skip_layers
            say += (f" Decoder layers {', '.join(map(str, skip))} were measured with a 16-bit "
                    f"KV cache: serve with `--kv-cache-dtype-skip-layers "
                    f"{' '.join(map(str, skip))}` (`vllm serve`) or `kv_cache_dtype_skip_layers` "
                    "as below; without it those layers' KV cache is FP8, which was not "
                    "measured.")  # fmt: skip
            args = f", kv_cache_dtype_skip_layers={[str(i) for i in skip]!r}"
    else:
        say = ('vLLM serves it with a 16-bit KV cache: keep `kv_cache_dtype="auto"` (or '
               '"bfloat16"); this checkpoint stores no KV scales.')  # fmt: skip
    return [say, "", "```python", "from vllm import LLM, SamplingParams", "",
            f'llm = LLM(model="PATH_OR_REPO"{args})  # kv_cache_dtype="auto"',
            'print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text)',
            "```", ""]  # fmt: skip


def _perf(ev: EvalFile) -> list[str]:
    p = ev.served_perf
    if p is None:
        return []
    out = [f"## Served speed ({p.engine}, {p.gpu})", "",
           "Measured with vLLM's own benchmark (`vllm bench serve`, random prompts, EOS "
           "ignored), the 16-bit reference in the same run on the same GPU; medians of "
           f"{len(p.workloads[0].candidate.repeats) if p.workloads else 0} repeats.", "",
           "| workload | prompt → output, streams | tokens/s (ref) | speed-up | over every pair "
           "of passes | TTFT p50 / p99 ms | TPOT p50 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in p.workloads:
        c, r = w.candidate, w.reference
        rng = w.speedup_range
        out.append(f"| {w.name} | {w.prompt_len} → {w.output_len}, {w.concurrency} | "
                   f"{c.output_tok_s:.0f} ({r.output_tok_s:.0f}) | {w.speedup:.2f}x | "
                   f"{f'{rng[0]:.2f}–{rng[1]:.2f}x' if rng else '–'} | "
                   f"{c.ttft_p50_ms:.1f} / {c.ttft_p99_ms:.1f} | {c.tpot_p50_ms:.2f} |")  # fmt: skip
    cc, rc = p.candidate, p.reference
    if cc.weights_gib is not None and rc.weights_gib is not None:
        out += ["", f"Weights on the GPU: {cc.weights_gib:.2f} GiB (16-bit: {rc.weights_gib:.2f}); "
                f"KV-cache capacity {cc.kv_cache_tokens or 0:,} tokens (16-bit: "
                f"{rc.kv_cache_tokens or 0:,}) at gpu_memory_utilization "
                f"{p.gpu_memory_utilization}."]  # fmt: skip
    if cc.kernels:
        out += ["", "Kernels: " + "; ".join(f"{cc.kernel_text(s)} for {s}" for s in sorted(cc.kernels))
                + "."]  # fmt: skip
    if cc.warnings:
        out += ["", "vLLM warned while serving it: " + "; ".join(f"“{w}”" for w in cc.warnings)]
    return [*out, ""]


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
    kernels = s.kernel_counts() or {}
    if kernels:
        out += ["Linears per kernel: " + "; ".join(
            f"{sc}: " + ", ".join(f"{k} ×{n}" for k, n in ks.items()) for sc, ks in kernels.items()
        ) + ".", ""]  # fmt: skip
    if s.performance_warnings():
        out += ["vLLM warned: " + "; ".join(s.performance_warnings()), ""]
    return out
