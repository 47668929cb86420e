"""Predicting a quantize run's cost from the plan, before anything is loaded.

    GPU peak  = max(oneshot, reload check)
      oneshot = W + 2·N·S·H·2 (the sequential pipeline's cached layer inputs and outputs,
                bf16) + the largest layer's GPTQ Hessians (in² · 4 bytes per Linear) and
                GPTQ's batched compression of same-shape modules (_gptq_batches: the MoE
                term) + AWQ's eager attention scores (B · heads · S² · 4) + C
      reload  = W + Q + C (the saved checkpoint reloaded and decompressed for the check)
    CPU peak  = Q + R on a GPU (the weights are read straight onto it; the saved checkpoint
                passes through host memory), 2·W + R on the CPU (fp32)
    time      = a · quantized Linears (a' for an MoE expert's) + layers · b · layer params
                · N·S / 65,536 on a GPU,
                layers · k · layer params · N·S on a CPU

With --offload cpu|disk the weights stay off the GPU and one decoder layer (or the
embeddings / lm_head) is there at a time: W above becomes 2·L, L the largest such unit's
bytes (it and its quantized copy); each layer's weights cross to the GPU and back, + T
seconds per byte of layer and T' per quantized Linear (time); the host holds W + Q + R
with cpu (8B dims on an H100: 23.8 GB predicted; measured 20.1 GB anonymous, the
calibration's peak, since the reload check decompresses one module at a time (7.6 GB;
21.5 when it decompressed the whole model, 40.6 before it stopped pinning and the cached
page-locked blocks were released): the Q term is headroom) or max(L, Q) + R with disk (the
reload check reads the packed checkpoint into host memory: checks.verify_reload). An MoE
family whose experts transformers fuses on load (PhiMoE, gpt-oss: no per-expert mapping in
llm-compressor) has its experts decompressed whole by that offloaded reload: +
FUSED_RELOAD_HOST x the expert weights.
`auto` picks none when the GPU peak fits free GPU memory, else cpu when its host peak
fits free host memory, else disk.

With --gpus G (torchrun) each rank caches 1/G of the layer inputs and calibrates 1/G of
the tokens (assumed: the several-GPU run is not measured yet), holds the rest as one
process does, and the host carries G processes' R.

W dense bytes, Q checkpoint bytes, N×S calibration tokens, H hidden size, B batch. The
constants are fitted to measured runs (bench/RESULTS.md "Resource estimate"): C = 0.3 GB
(allocator and kernels), R = 2.0 GB (torch, transformers, datasets, the tokenizer), a =
0.525 / 7 s per quantized Linear and b = 1.262e-8 s per method-weighted parameter at 65,536
tokens (H200: Gemma 3 270M 10.5 s and an 8B-dims Llama 79.5 s, 7 quantized Linears a
layer), k = 2.2e-10 s per parameter-token (2-core CPU: Gemma 3 270M), T = 0.7e-9 s per
byte (H200 host link, page-locked host copies: 8B dims, --offload cpu vs none).
The time terms count each Linear's parameters weighted by what its method costs relative to
the mixed recipe the constants were fitted on (METHOD_COST): on the 2-core CPU (Gemma 3 270M,
32 x 256 tokens, one process per recipe) RTN took 33.7 s, GPTQ 66.5 s, AWQ 445.9 s and the
mixed recipe 181.8 s; on the H200 (128 x 512 tokens) RTN 8.4 s, GPTQ 7.9-10.6 s, AWQ 16.3 s,
mixed 15.5 s and AutoRound 272.3 s (about 25x GPTQ). A module kept 16-bit costs nothing.
MoE: on 2 layers of Qwen3-30B-A3B dims (128 experts of 2048x768) the GPU peak measured
18.67 GB; without the batched compression the estimate said 9.44 GB, with it 18.6 GB; on 16
and 24 layers (H100, 2026-12-06 19:00) 36.35 / 46.43 GB measured, 36.01 / 45.98 predicted,
and 16.95 / 16.95 with --offload cpu (17.32). An expert Linear's time (A_EXPERT_S) is fitted
on those rows (bench/RESULTS.md, "H100 sessions 2026-12-06, 18:50–19:23").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..errors import UsageError
from ..recipe import METHODS, Recipe
from ..records.estimate import ResourceEstimate
from ..records.plan import Plan
from .methods import ROUNDING

GB = 1e9
C_GPU = 0.3 * GB
R_CPU = 2.0 * GB
# a per quantized Linear (hooks, batches, bookkeeping: it carries over to an MoE layer's
# hundreds of expert Linears); refit once METHOD_COST weighted the parameters (the constants
# fitted before it, 0.425 / 7 and 8.14e-9, then predicted the 8B at 54 s)
A_S, B_S, TOKENS_REF = 0.525 / 7, 1.262e-8, 65_536
# an MoE expert Linear (calibration, GPTQ, its share of save and reload check): fitted on
# 16 and 24 Qwen3-30B-A3B-dims layers (6,144 and 9,216 expert Linears: 254.3 and 408.0 s
# with the weights on the GPU, H100 2026-12-06 19:00, beside the --offload cpu run); 0.105
# before the reload check decompressed on the GPU (it took 223 of 8 layers' 378 s on the host)
A_EXPERT_S = 0.031
# host bytes per byte of expert weights that an offloaded reload check of fused experts
# holds beyond W + Q + R: 36.8 GB on 16 layers (H100 2026-12-06 19:00), before Qwen3-MoE's
# experts were read per expert there (24 layers: 23.9 GB in the check, below calibration's)
FUSED_RELOAD_HOST = 0.38
K_CPU = 2.2e-10
T_OFFLOAD = 0.7e-9
# per quantized Linear under offload: loading into host memory and page-locking costs each
# module ~8.5 ms beyond the bytes (Qwen3-30B-A3B dims, H100 2026-12-06: load 62.6 / 90.8 s
# offloaded against 7.8 / 14.6 s onto the GPU, for 6,208 / 9,312 Linears); negligible for
# a dense model (the 8B's 224 Linears: ~2 s)
T_OFFLOAD_MODULE = 0.0085
ASSUMED_SPLIT = ("; --gpus N assumed to split the calibration tokens evenly over the ranks "
                 "(not yet measured on several GPUs)")  # fmt: skip
BASIS = ("fitted on Gemma 3 270M (H200, 2-core CPU) and an 8B-dims Llama (H200), "
         "bench/RESULTS.md")  # fmt: skip


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _experts_read_per_expert(config: Any) -> bool:
    from ..model.moe import family_reads_per_expert

    return family_reads_per_expert(getattr(_text_config(config), "model_type", None))


def _gptq_batches(gptq_by_layer: dict[str, list], ranks: int, free_gpu_bytes: int | None) -> int:
    """GPTQ's compression beyond the accumulated Hessians: llm-compressor 0.14 quantizes a
    layer's same-shape modules as one stacked batch (`batched_quantization: auto`, as many
    as fit in 75 % of free GPU memory), with a stacked copy of their Hessians and three
    weight-sized fp32 working tensors (4·(in² + 3·out·in) bytes a module). 128 experts of
    one shape make this the MoE term: +9.1 GB on a Qwen3-30B-A3B-dims layer, where 9.2 GB
    were measured beyond the rest; on a dense 8B layer +1.5 GB (+0.5 to +1.3 measured)."""
    extra = 0
    for modules in gptq_by_layer.values():
        shapes = Counter((m.out_features, m.in_features) for m in modules)
        for (out_f, in_f), n in shapes.items():
            per = 4 * (in_f * in_f + 3 * out_f * in_f)
            n = -(-n // ranks)  # each rank compresses its share of the modules
            if free_gpu_bytes:
                n = min(n, max(1, int(free_gpu_bytes * 0.75) // per))
            extra = max(extra, n * per)
    return extra


def estimate(
    plan: Plan, config: Any, recipe: Recipe, device: str, *, offload: str = "none",
    ranks: int = 1, free_gpu_bytes: int | None = None,
) -> ResourceEstimate:  # fmt: skip
    cfg = _text_config(config)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    layers = max(len(plan.decoder_layers), 1)
    cal, ev = recipe.calibration, recipe.evaluation
    tokens = cal.num_samples * cal.seq_len
    # --gpus N: each rank calibrates on its share of the samples and caches only its share's
    # layer inputs; every rank holds the layer, its Hessians and the weights (ASSUMED_SPLIT)
    ranks = max(1, ranks)
    layer_of = {m.name: next((d for d in plan.decoder_layers if m.name.startswith(d + ".")), None)
                for m in plan.modules}  # fmt: skip
    in_layers = [m for m in plan.modules if layer_of[m.name]]
    layer_params = sum(m.in_features * m.out_features for m in in_layers) / layers
    kind = "cuda" if device.startswith("cuda") else "cpu"
    # the parameters of a layer as the time fit counts them: weighted by each method's cost
    # (seconds per parameter-token, quantize/methods.py: the fit above)
    timed_params = sum(m.in_features * m.out_features * ROUNDING[m.method].cost[kind]
                       for m in in_layers) / layers  # fmt: skip
    gptq_by_layer: dict[str, list] = {}
    for m in in_layers:
        if ROUNDING[m.method].hessians:
            gptq_by_layer.setdefault(str(layer_of[m.name]), []).append(m)
    hess = max((sum(m.in_features**2 * 4 for m in ms) for ms in gptq_by_layer.values()), default=0)
    hess += _gptq_batches(gptq_by_layer, ranks, free_gpu_bytes)
    awq = (
        cal.batch_size * heads * cal.seq_len**2 * 4
        if any(ROUNDING[m.method].attention_cache for m in plan.modules)
        else 0
    )
    w = plan.params.dense_bytes
    q = plan.expected_checkpoint_bytes
    unit = int(max(layer_params, vocab * hidden) * 2)  # the largest part onloaded at once
    acts = 2 * tokens * hidden * 2 // ranks
    gpu = device.startswith("cuda")
    if not gpu:
        offload = "disk" if offload == "disk" else "none"
    resident = w if offload == "none" else 2 * unit
    if gpu:
        quantized = [m for m in in_layers if METHODS[m.method].quantizes]
        experts = [m for m in quantized if m.role == "experts"]
        expert_bytes = sum(m.in_features * m.out_features * 2 for m in experts)  # bf16
        oneshot = resident + acts + hess + awq + C_GPU
        q_gpu: int | None = int(max(oneshot, resident + (q if offload == "none" else 0) + C_GPU))
        seconds = A_S * (len(quantized) - len(experts)) + A_EXPERT_S * len(experts)
        seconds += layers * B_S * timed_params * tokens / ranks / TOKENS_REF
        if offload != "none":
            seconds += layers * T_OFFLOAD * layer_params * 2 + T_OFFLOAD_MODULE * len(quantized)
        cpu = {"none": q, "cpu": w + q, "disk": max(unit, q)}[offload] + R_CPU * ranks
        if experts and offload != "none" and not _experts_read_per_expert(config):
            cpu += FUSED_RELOAD_HOST * expert_bytes
        # one model resident, a batch of fp32 logits and their float64 log-softmax (chunked)
        e_gpu: int | None = int(
            resident + ev.batch_size * ev.seq_len * vocab * 4 + 128 * vocab * 8 * 2 + C_GPU
        )
    else:
        q_gpu = e_gpu = None
        seconds = layers * K_CPU * timed_params * tokens
        cpu = (2 * w if offload == "none" else unit) + R_CPU  # float32 on the CPU
    reference = ev.sequences * (ev.seq_len - 1) * min(4096, vocab or 4096) * 8
    # + W while quantize runs: its finished layers, kept for a resume (resume.py)
    disk = w + 2 * q + reference + w + (w if offload == "disk" else 0)
    return ResourceEstimate(device="cuda" if gpu else "cpu", offload=offload, ranks=ranks,
                            quantize_gpu_bytes=q_gpu, quantize_cpu_bytes=int(cpu),
                            quantize_s=round(seconds, 1), evaluate_gpu_bytes=e_gpu,
                            disk_bytes=int(disk),
                            checkpoint_disk_bytes=int(q + (w if offload == "disk" else 0)),
                            basis=BASIS + (ASSUMED_SPLIT if ranks > 1 else ""))  # fmt: skip


def choose(
    plan: Plan, config: Any, recipe: Recipe, device: str, *, offload: str,
    free_gpu_bytes: int | None, free_cpu_bytes: int | None, ranks: int = 1,
) -> ResourceEstimate:  # fmt: skip
    """The estimate for `offload`; for "auto" the first of none, cpu, disk that fits (none
    on the CPU, or when nothing is known about free memory)."""
    if offload != "auto":
        return estimate(plan, config, recipe, device, offload=offload, ranks=ranks,
                        free_gpu_bytes=free_gpu_bytes)  # fmt: skip
    if free_gpu_bytes is None:
        return estimate(plan, config, recipe, device, ranks=ranks)
    for mode in ("none", "cpu"):
        est = estimate(plan, config, recipe, device, offload=mode, ranks=ranks,
                       free_gpu_bytes=free_gpu_bytes)  # fmt: skip
        gpu_ok = (est.quantize_gpu_bytes or 0) <= free_gpu_bytes
        if gpu_ok and (mode == "none" or free_cpu_bytes is None
                       or est.quantize_cpu_bytes <= free_cpu_bytes):  # fmt: skip
            return est
    return estimate(plan, config, recipe, device, offload="disk", ranks=ranks,
                    free_gpu_bytes=free_gpu_bytes)  # fmt: skip


def require_fit(
    est: ResourceEstimate, *, free_gpu_bytes: int | None, recipe: Recipe,
    free_cpu_bytes: int | None = None, free_disk_bytes: int | None = None,
    checkpoint_only: bool = False,
) -> None:  # fmt: skip
    """Exit 2 before anything is loaded when the predicted GPU peak, host peak or disk use
    exceeds what is free, saying what would fit."""
    need = est.quantize_gpu_bytes
    if need is not None and free_gpu_bytes is not None and need > free_gpu_bytes:
        _gpu_too_small(need, free_gpu_bytes, est, recipe)
    if free_cpu_bytes is not None and est.quantize_cpu_bytes > free_cpu_bytes:
        off = ("; --offload disk keeps the weights in memory-mapped files"
               if est.offload != "disk" and est.device == "cuda" else "")  # fmt: skip
        raise UsageError(
            f"quantize needs about {est.quantize_cpu_bytes / GB:.1f} GB of host memory "
            f"(predicted, --offload {est.offload}) but {free_cpu_bytes / GB:.1f} GB are free",
            path=recipe.path,
            hint=f"use a machine with more memory{off}; `qship plan` prints the estimate "
            "(a config.json that claims far more than its weights hold is refused as well)",
        )
    disk, what = est.disk_bytes, "cache entries and the artifact"
    if checkpoint_only and est.checkpoint_disk_bytes is not None:  # `qship quantize`: no cache
        disk, what = est.checkpoint_disk_bytes, "the checkpoint"
    if free_disk_bytes is not None and disk > free_disk_bytes:
        raise UsageError(
            f"the run needs about {disk / GB:.1f} GB of disk ({what}, predicted) but "
            f"{free_disk_bytes / GB:.1f} GB are free",
            path=recipe.path,
            hint="free space, or point $QSHIP_CACHE / --cache-dir at a larger file system",
        )


def _gpu_too_small(need: int, free_gpu_bytes: int, est: ResourceEstimate, recipe: Recipe) -> None:
    cal = recipe.calibration
    offload = ("--offload cpu (the weights in host memory, one decoder layer on the GPU at a "
               "time), " if est.offload == "none" else "")  # fmt: skip
    raise UsageError(
        f"quantize needs about {need / GB:.1f} GB of GPU memory (predicted, --offload "
        f"{est.offload}) but {free_gpu_bytes / GB:.1f} GB are free",
        path=recipe.path,
        hint=f"use {offload}a GPU with more free memory, quantize on the CPU (--device cpu), "
        f"or shrink calibration (num_samples {cal.num_samples}, seq_len {cal.seq_len}, "
        f"batch_size {cal.batch_size}); `qship plan --device cuda` prints the estimate",
    )
