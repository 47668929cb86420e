"""Predicting a quantize run's cost from the plan, before anything is loaded.

    GPU peak  = max(oneshot, reload check)
      oneshot = W + 2·N·S·H·2 (the sequential pipeline's cached layer inputs and outputs,
                bf16) + the largest layer's GPTQ Hessians (in² · 4 bytes per Linear) + AWQ's
                eager attention scores (B · heads · S² · 4) + C
      reload  = W + Q + C (the saved checkpoint reloaded and decompressed for the check)
    CPU peak  = W (loaded on the host first; fp32 on a CPU run) + R
    time      = layers · (a + b · layer params · N·S / 65,536) on a GPU,
                layers · k · layer params · N·S on a CPU

W dense bytes, Q checkpoint bytes, N×S calibration tokens, H hidden size, B batch. The
constants are fitted to measured runs (bench/RESULTS.md "Resource estimate"): C = 0.3 GB
(allocator and kernels), R = 2.0 GB (torch, transformers, datasets, the tokenizer), a =
0.425 s and b = 8.14e-9 s per parameter at 65,536 tokens (H200: Gemma 3 270M and an
8B-dims Llama), k = 2.2e-10 s per parameter-token (2-core CPU: Gemma 3 270M).
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..recipe import Recipe
from ..records.estimate import ResourceEstimate
from ..records.plan import Plan

GB = 1e9
C_GPU = 0.3 * GB
R_CPU = 2.0 * GB
A_S, B_S, TOKENS_REF = 0.425, 8.14e-9, 65_536
K_CPU = 2.2e-10
BASIS = ("fitted on Gemma 3 270M (H200, 2-core CPU) and an 8B-dims Llama (H200), "
         "bench/RESULTS.md")  # fmt: skip


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def estimate(plan: Plan, config: Any, recipe: Recipe, device: str) -> ResourceEstimate:
    cfg = _text_config(config)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    layers = max(len(plan.decoder_layers), 1)
    cal, ev = recipe.calibration, recipe.evaluation
    tokens = cal.num_samples * cal.seq_len
    in_layers = [
        m for m in plan.modules if any(m.name.startswith(d + ".") for d in plan.decoder_layers)
    ]
    layer_params = sum(m.in_features * m.out_features for m in in_layers) / layers
    per_layer_hess: dict[str, int] = {}
    for m in in_layers:
        if m.method == "gptq":
            layer = next(d for d in plan.decoder_layers if m.name.startswith(d + "."))
            per_layer_hess[layer] = per_layer_hess.get(layer, 0) + m.in_features**2 * 4
    hess = max(per_layer_hess.values(), default=0)
    awq = (
        cal.batch_size * heads * cal.seq_len**2 * 4
        if any(m.method == "awq" for m in plan.modules)
        else 0
    )
    w = plan.params.dense_bytes
    q = plan.expected_checkpoint_bytes
    acts = 2 * tokens * hidden * 2
    gpu = device.startswith("cuda")
    if gpu:
        oneshot = w + acts + hess + awq + C_GPU
        q_gpu: int | None = int(max(oneshot, w + q + C_GPU))
        seconds = layers * (A_S + B_S * layer_params * tokens / TOKENS_REF)
        cpu = w + R_CPU
        # one model resident, a batch of fp32 logits and their float64 log-softmax (chunked)
        e_gpu: int | None = int(
            w + ev.batch_size * ev.seq_len * vocab * 4 + 128 * vocab * 8 * 2 + C_GPU
        )
    else:
        q_gpu = e_gpu = None
        seconds = layers * K_CPU * layer_params * tokens
        cpu = 2 * w + R_CPU  # float32 on the CPU
    reference = ev.sequences * (ev.seq_len - 1) * min(4096, vocab or 4096) * 8
    disk = w + 2 * q + reference
    return ResourceEstimate(device="cuda" if gpu else "cpu", quantize_gpu_bytes=q_gpu,
                            quantize_cpu_bytes=int(cpu), quantize_s=round(seconds, 1),
                            evaluate_gpu_bytes=e_gpu, disk_bytes=int(disk), basis=BASIS)  # fmt: skip


def require_fit(est: ResourceEstimate, *, free_gpu_bytes: int | None, recipe: Recipe) -> None:
    """Exit 2 before anything is loaded when the predicted GPU peak exceeds free memory,
    saying what would fit."""
    need = est.quantize_gpu_bytes
    if need is None or free_gpu_bytes is None or need <= free_gpu_bytes:
        return
    cal = recipe.calibration
    raise UsageError(
        f"quantize needs about {need / GB:.1f} GB of GPU memory (predicted) but "
        f"{free_gpu_bytes / GB:.1f} GB are free",
        path=recipe.path,
        hint="use a GPU with more free memory, quantize on the CPU (--device cpu), or shrink "
        f"calibration (num_samples {cal.num_samples}, seq_len {cal.seq_len}, batch_size "
        f"{cal.batch_size}); `qship plan --device cuda` prints the estimate",
    )
